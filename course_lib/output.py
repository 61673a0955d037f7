"""Turn what the ranks printed into deterministic, rank-ordered text.

Pure functions (no processes), so they are unit-tested directly.
"""

from __future__ import annotations

import re
import signal

__all__ = ["MAX_LINES_PER_RANK", "clean_paths", "clean_rank_text", "describe_exit", "exit_summary", "parse_torchrun_failures", "ranks_phrase", "rank_block"]

MAX_LINES_PER_RANK = 400

_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def parse_torchrun_failures(agent_output: str) -> tuple[dict[int, int], int | None]:
    """Read torchrun's ChildFailedError summary: ({rank: exit code}, root-cause rank).

    torchrun lists every rank that did not exit 0 (including those it sent
    SIGTERM after the first failure, exit code -15) and names the first
    observed failure as "Root Cause".
    """
    codes = {int(rank): int(code) for rank, code in _FAILURE.findall(agent_output)}
    root = None
    _, sep, after = agent_output.partition("Root Cause")
    if sep:
        match = _FAILURE.search(after)
        if match:
            root = int(match.group(1))
    return codes, root


def clean_paths(text: str, script_path: str, label: str = "<cell>") -> str:
    """Replace the temporary script path (it changes every run) with a stable label."""
    return text.replace(script_path, label)


def clean_rank_text(rank: int, text: str, script_path: str) -> str:
    """Stable script label, and without torch's own "[rankN]: " prefix (we add "[rank N]")."""
    return re.sub(rf"^\[rank{rank}\]: ?", "", clean_paths(text, script_path), flags=re.MULTILINE)


def rank_block(rank: int, text: str, max_lines: int = MAX_LINES_PER_RANK) -> str:
    """Prefix every line with `[rank N]`; keep the first and last lines of very long output."""
    lines = text.splitlines()
    if len(lines) > max_lines:
        head = max_lines // 2
        tail = max_lines - head
        omitted = len(lines) - max_lines
        lines = lines[:head] + [f"... {omitted} lines omitted ..."] + lines[len(lines) - tail:]
    return "".join(f"[rank {rank}] {line}\n" for line in lines)


def ranks_phrase(ranks: list[int]) -> str:
    """"rank 3" or "ranks 0, 2"."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def describe_exit(code: int | None) -> str:
    """0, 1, ... as is; a negative code is the signal that ended the process."""
    if code is None:
        return "still running, killed"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return str(code)


def exit_summary(exit_codes: dict[int, int | None], not_started: list[int] = ()) -> str:
    """One line, e.g. "exit: ranks 0, 2 -> 0; rank 1 -> 1; rank 3 -> SIGTERM"."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(exit_codes):
        what = "not started" if rank in not_started else describe_exit(exit_codes[rank])
        groups.setdefault(what, []).append(rank)
    return "exit: " + "; ".join(f"{ranks_phrase(ranks)} -> {what}" for what, ranks in groups.items())
