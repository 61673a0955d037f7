"""One exercise's results as the learner reads them (cl.check, the grader's console).

Lines are wrapped at WIDTH columns between words (never inside `all-reduce` or a name), each
continuation indented under its item's text: a notebook would break them anywhere.
"""

from __future__ import annotations

import textwrap

from .spec import ItemResult

__all__ = ["WIDTH", "hint_line", "item_line", "score_text", "wrapped"]

WIDTH = 100
MESSAGE_INDENT = " " * 8  # under the item's name: "  FAIL  " is 8 columns
HINT_INDENT = " " * 4


def wrapped(text: str, first: str, rest: str) -> str:
    """`text` after `first`, wrapped at WIDTH columns, continuation lines starting with `rest`."""
    return "\n".join(textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=rest,
                                   break_long_words=False, break_on_hyphens=False)) or first.rstrip()


def score_text(score: float, max_score: float) -> str:
    return f"{score:g}/{max_score:g}"


def item_line(item: ItemResult) -> str:
    """`  pass  name (1/1)`, or `  FAIL  name (0/1)` with the reason on the next line."""
    mark = "pass" if item.passed else "FAIL"
    # A no-break space (textwrap breaks only at ASCII whitespace) keeps the score on its name's last line.
    name = f"{item.name}\N{NO-BREAK SPACE}({score_text(item.score, item.max_score)})"
    text = wrapped(name, f"  {mark}  ", MESSAGE_INDENT).replace("\N{NO-BREAK SPACE}", " ")
    if item.message:
        text += "\n" + wrapped(item.message, MESSAGE_INDENT, MESSAGE_INDENT)
    return text


def hint_line(hints: tuple[str, ...], failed_before: int) -> str:
    """The hint after a failed check: level `failed_before` + 1 of `hints` (the last level once all were shown).

    Level 1 points to the lesson's section, level 2 names the API, level 3 describes the approach."""
    if not hints:
        return ""
    level = min(failed_before, len(hints) - 1)
    more = "; the next failed check shows the next" if level < len(hints) - 1 else ""
    return wrapped(f"hint {level + 1} of {len(hints)}{more}: {hints[level]}", "", HINT_INDENT)
