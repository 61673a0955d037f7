"""One exercise's results as the learner reads them (cl.check, the grader's console)."""

from __future__ import annotations

from .spec import ItemResult

__all__ = ["hint_line", "item_line", "score_text"]


def score_text(score: float, max_score: float) -> str:
    return f"{score:g}/{max_score:g}"


def item_line(item: ItemResult) -> str:
    """`  pass  name (1/1)`, or `  FAIL  name (0/1)` with the reason on the next line."""
    mark = "pass" if item.passed else "FAIL"
    text = f"  {mark}  {item.name} ({score_text(item.score, item.max_score)})"
    if item.message:
        text += f"\n        {item.message}"
    return text


def hint_line(hints: tuple[str, ...], failed_before: int) -> str:
    """The hint after a failed check: level `failed_before` + 1 of `hints` (the last level once all were shown).

    Level 1 points to the lesson's section, level 2 names the API, level 3 describes the approach."""
    if not hints:
        return ""
    level = min(failed_before, len(hints) - 1)
    more = "; the next failed check shows the next" if level < len(hints) - 1 else ""
    return f"hint {level + 1} of {len(hints)}{more}: {hints[level]}"
