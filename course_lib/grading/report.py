"""One exercise's results as the learner reads them (cl.check, the grader's console)."""

from __future__ import annotations

from .checker import ItemResult

__all__ = ["format_report", "score_text"]


def score_text(score: float, max_score: float) -> str:
    return f"{score:g}/{max_score:g}"


def format_report(exercise_id: str, items: list[ItemResult]) -> str:
    """A heading with the points, then one line per item: pass/FAIL, name, points, and why."""
    score = sum(i.score for i in items)
    total = sum(i.max_score for i in items)
    lines = [f"{exercise_id}: {score_text(score, total)} points"]
    for item in items:
        mark = "pass" if item.passed else "FAIL"
        lines.append(f"  {mark}  {item.name} ({score_text(item.score, item.max_score)})")
        if item.message:
            lines.append(f"        {item.message}")
    return "\n".join(lines)
