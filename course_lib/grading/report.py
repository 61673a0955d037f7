"""One exercise's results as the learner reads them (cl.check, the grader's console)."""

from __future__ import annotations

from .spec import ItemResult

__all__ = ["item_line", "score_text"]


def score_text(score: float, max_score: float) -> str:
    return f"{score:g}/{max_score:g}"


def item_line(item: ItemResult, hints_shown: set[str] | None = None) -> str:
    """`  pass  name (1/1)`, or `  FAIL  name (0/1)` with the reason on the next line and the hint, if any, after it.

    `hints_shown`: the hints a report has already shown, which this line leaves out and adds its own to,
    so that a report shows each hint once (every item of a stub fails with the same one).
    """
    mark = "pass" if item.passed else "FAIL"
    text = f"  {mark}  {item.name} ({score_text(item.score, item.max_score)})"
    if item.message:
        text += f"\n        {item.message}"
    if item.hint and (hints_shown is None or item.hint not in hints_shown):
        text += f"\n        hint: {item.hint}"
        if hints_shown is not None:
            hints_shown.add(item.hint)
    return text
