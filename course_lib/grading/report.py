"""One exercise's results as the learner reads them (cl.check, the grader's console)."""

from __future__ import annotations

from .spec import ItemResult

__all__ = ["item_line", "score_text"]


def score_text(score: float, max_score: float) -> str:
    return f"{score:g}/{max_score:g}"


def item_line(item: ItemResult) -> str:
    """`  pass  name (1/1)`, or `  FAIL  name (0/1)` with the reason on the next line."""
    mark = "pass" if item.passed else "FAIL"
    text = f"  {mark}  {item.name} ({score_text(item.score, item.max_score)})"
    return text + (f"\n        {item.message}" if item.message else "")
