"""What the ranks wrote, from torchrun's per-rank log files to deterministic, rank-ordered text.

torchrun (`--log-dir DIR --redirects 3`) writes each rank's stdout and stderr
to files (layout in `course_lib.rank.contract`). Two readers follow them:
`LogFollower` for a one-shot launch (every rank, as the files appear) and
`RankFdOutput` for a persistent rank, whose Python prints go over its
connection but whose writes below Python (C++ warnings, `os.write(1, ...)`,
subprocesses) land only in these files. We read torchrun's files rather than
pipe the descriptors through a thread: a file keeps the last words of a rank
that aborts (a pipe's unread bytes die with the process), and reading an
unchanged file costs microseconds.

The rest are pure functions (no processes), unit-tested directly: torchrun's
failure summary, stable paths, `[rank N]` blocks, exit codes in words.
"""


from __future__ import annotations

import codecs
import pathlib
import re
import signal
import sysconfig
from typing import Any

from ..rank.contract import CELL_LABEL, log_files, parse_log_path

__all__ = [
    "MAX_LINES_PER_RANK", "LogFollower", "RankFdOutput", "clean_paths", "clean_rank_text", "cut_traceback", "describe_exit",
    "short_frames", "attempt_failures", "exit_summary", "parse_torchrun_failures", "rank_block", "ranks_phrase",
    "readable_stack",
]

MAX_LINES_PER_RANK = 400

_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


# The agent's line for each attempt that failed: "... failed (exitcode: -9) local_rank: 1 (pid: 123) of binary: ..."
_ATTEMPT_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")


def attempt_failures(agent_output: str) -> list[tuple[int, int]]:
    """(local rank, exit code) of the first failure torchrun saw in each failed attempt, in order."""
    return [(int(rank), int(code)) for code, rank in _ATTEMPT_FAILED.findall(agent_output)]


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


# Where packages are installed differs between machines and shows the learner's own folders (a clone's
# absolute path for an editable install): frames are named from the package down, torch/..., course_lib/...
_INSTALLED = re.compile(r'File "[^"]*/(?:site|dist)-packages/')
_COURSE_ROOT = str(pathlib.Path(__file__).resolve().parents[2])  # the folder that holds course_lib/
# The standard library's folders (the base Python's, and a virtual environment's): `File "dataclasses.py"`.
_STDLIB = sorted({f'File "{sysconfig.get_paths()[key]}/' for key in ("stdlib", "platstdlib")}, key=len, reverse=True)


# The GPU-node rehearsal (course_lib/rank/rehearsal.py) sits between the program and torch under test:
# its frames, and torch's dispatch to it, are not the learner's program. In a faulthandler stack
# (most recent call first) its frame, then `handle_torch_function` and the frame that dispatched;
# in a traceback (most recent call last) each frame with its indented source lines.
_REHEARSAL_STACK = re.compile(
    r'^[^\n]*File "[^"]*course_lib/rank/rehearsal\.py", line \d+ in [^\n]*\n'
    r'(?:[^\n]*File "[^"]*torch/overrides\.py", line \d+ in handle_torch_function\n[^\n]*\n)?', re.M)
_REHEARSAL_TRACEBACK = re.compile(
    r'^([ \t]*)File "[^"]*(?:course_lib/rank/rehearsal\.py|torch/overrides\.py)", line \d+, in [^\n]*\n'
    r'(?:\1[ \t]+[^\n]*\n)*', re.M)


# ... and the frame that handed the call to it (its source line calls handle_torch_function).
_DISPATCHING_FRAME = re.compile(
    r'^([ \t]*)File "[^"]*", line \d+, in [^\n]*\n\1[ \t]+[^\n]*handle_torch_function\([^\n]*\n(?:\1[ \t]+[ ~^]+\n)?', re.M)


_STACK_FRAME = re.compile(r'File "([^"]*)", line \d+ in (\S+)')


def _without_redispatch(text: str) -> str:
    """A faulthandler stack without torch's dispatch to a mode: `handle_torch_function` and, below it,
    the frames that repeat the ones above it (the public function called again by the mode)."""
    lines = text.splitlines(keepends=True)
    kept: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if 'torch/overrides.py"' in line and "in handle_torch_function" in line:
            above = {m.groups() for m in map(_STACK_FRAME.search, kept) if m}
            index += 1
            while index < len(lines) and (m := _STACK_FRAME.search(lines[index])) and m.groups() in above:
                index += 1
            continue
        kept.append(line)
        index += 1
    return "".join(kept)


def without_rehearsal(text: str) -> str:
    """`text` without the GPU-node rehearsal's frames (the same output as an unrehearsed run)."""
    if "rehearsal.py" not in text and "handle_torch_function" not in text:
        return text
    text = _DISPATCHING_FRAME.sub("", _REHEARSAL_TRACEBACK.sub("", _REHEARSAL_STACK.sub("", text)))
    return _without_redispatch(text)


def short_frames(text: str) -> str:
    """Traceback and stack frames named from their package down: `File "torch/..."`, `File "course_lib/..."`,
    the standard library's `File "dataclasses.py"`."""
    text = _INSTALLED.sub('File "', text).replace(f'File "{_COURSE_ROOT}/course_lib/', 'File "course_lib/')
    for prefix in _STDLIB:  # after site-packages, which may lie below a standard library folder
        text = text.replace(prefix, 'File "')
    return without_rehearsal(text)


_IMPORT_MACHINERY = re.compile(r'^[^\n]*File "<frozen importlib\._bootstrap(?:_external)?>"[^\n]*\n?', re.M)


def readable_stack(text: str) -> str:
    """A faulthandler stack without the import machinery's frames (`<frozen importlib._bootstrap>`): while
    a rank imports torch they are most of its stack, and none is the learner's or torch's code."""
    return _IMPORT_MACHINERY.sub("", text)


def clean_paths(text: str, script_path: str, label: str = CELL_LABEL) -> str:
    """Replace the temporary script path (it changes every run) with a stable label; frames named short."""
    return short_frames(text.replace(script_path, label))


def clean_rank_text(rank: int, text: str, script_path: str) -> str:
    """Stable script label, and without torch's own "[rankN]: " prefix (we add "[rank N]")."""
    return re.sub(rf"^\[rank{rank}\]: ?", "", clean_paths(text, script_path), flags=re.MULTILINE)


# Where a C++ error was raised in torch's build tree, e.g. "[/__w/pytorch/pytorch/third_party/gloo/.../pair.cc:553] ".
_BUILD_PATH = re.compile(r"\[/[^\]\s]*\.(?:cc|cpp|cu|h|hpp):\d+\] ")


def cut_traceback(text: str) -> str:
    """`text` with its first traceback cut to the exception's last line (no build path) and how many lines went;
    text without a traceback unchanged. For an error that only follows from another rank's exit."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")), None)
    last = next((i for i in range(len(lines) - 1, start or 0, -1) if lines[i].strip()), None)
    if start is None or last is None:
        return text
    error = _BUILD_PATH.sub("", lines[last].strip())
    return "\n".join(lines[:start] + [f"{error} (its traceback of {last - start} lines cut)"]) + "\n"


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


# --- reading torchrun's log files -------------------------------------------------------------------


class LogFollower:
    """Follows `<log_dir>/<run id>/attempt_<k>/<local_rank>/{stdout,stderr}.log` as torchrun creates them.

    After a restart (`--max-restarts`) each attempt's text is kept apart: torchrun creates attempt
    k+1's files only once it has stopped every process of attempt k.
    """

    def __init__(self, log_dir: pathlib.Path, nproc: int):
        self.log_dir = log_dir
        self.nproc = nproc
        self.files: dict[pathlib.Path, Any] = {}  # by path: a (rank, stream) has one file per attempt
        self.keys: dict[pathlib.Path, tuple[int, int, str]] = {}  # (attempt, rank, stream)
        self.decoders: dict[pathlib.Path, Any] = {}
        self.text: dict[tuple[int, int, str], list[str]] = {}

    def _open_new(self) -> None:
        for path in sorted(log_files(self.log_dir), key=_attempt_of):
            key = parse_log_path(path)
            if key is not None and key[0] < self.nproc and path not in self.files:
                self.files[path] = open(path, "rb")
                self.keys[path] = (_attempt_of(path), *key)
                self.decoders[path] = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def poll(self) -> list[tuple[int, str, str]]:
        """New text since the last call, as (rank, stream, text), earlier attempts first."""
        self._open_new()
        new = []
        for path, handle in sorted(self.files.items(), key=lambda item: _attempt_of(item[0])):
            data = handle.read()
            if data:
                text = self.decoders[path].decode(data)
                if text:
                    attempt, rank, stream = self.keys[path]
                    self.text.setdefault((attempt, rank, stream), []).append(text)
                    new.append((rank, stream, text))
        return new

    def close(self) -> None:
        for handle in self.files.values():
            handle.close()

    def started(self, attempt: int | None = None) -> set[int]:
        """Ranks torchrun has started (in `attempt`, if given): it creates a rank's log files as it starts it."""
        return {rank for at, rank, _ in self.keys.values() if attempt is None or at == attempt}

    def attempts(self) -> list[int]:
        """The attempts torchrun started, in order ([0] without a restart; [] before any rank started)."""
        return sorted({attempt for attempt, _, _ in self.keys.values()})

    def joined(self, stream: str, attempt: int | None = None) -> dict[int, str]:
        """{rank: text} of one attempt (default: the last)."""
        if attempt is None:
            attempt = max(self.attempts(), default=0)
        return {r: "".join(self.text.get((attempt, r, stream), [])) for r in range(self.nproc)}


def _attempt_of(path: pathlib.Path) -> int:
    """k of a log file under `.../attempt_<k>/...` (sorting by name would put attempt_10 before attempt_2)."""
    return next((int(part[len("attempt_"):]) for part in path.parts if part.startswith("attempt_")), 0)


class _Tail:
    """One file, read incrementally; decodes UTF-8 across read boundaries."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.handle = None
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def skip_to_end(self) -> None:
        if self._open():
            self.handle.seek(0, 2)

    def read(self) -> str:
        if not self._open():
            return ""
        return self.decoder.decode(self.handle.read())

    def _open(self) -> bool:
        if self.handle is None:
            try:
                self.handle = open(self.path, "rb")  # noqa: SIM115 - kept open between cells, closed by close()
            except FileNotFoundError:
                return False
        return True

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


class RankFdOutput:
    """Rank `rank`'s stdout.log and stderr.log under torchrun's `log_dir`, read incrementally."""

    def __init__(self, log_dir: pathlib.Path, rank: int):
        self.log_dir, self.rank = log_dir, rank
        self.tails: dict[str, _Tail] = {}

    def _tail(self, stream: str) -> _Tail | None:
        if stream not in self.tails:
            # A pool has one attempt, so one file per stream.
            paths = log_files(self.log_dir, self.rank, stream)
            if not paths:
                return None
            self.tails[stream] = _Tail(paths[-1])
        return self.tails[stream]

    def skip_to_end(self) -> None:
        """Forget what was written so far (start-up output) so that cells show only their own."""
        for stream in ("stdout", "stderr"):
            tail = self._tail(stream)
            if tail is not None:
                tail.skip_to_end()

    def read(self) -> list[tuple[str, str]]:
        """[(stream, text)] written since the previous read; empty texts left out."""
        new = []
        for stream in ("stdout", "stderr"):
            tail = self._tail(stream)
            text = tail.read() if tail is not None else ""
            if text:
                new.append((stream, text))
        return new

    def close(self) -> None:
        for tail in self.tails.values():
            tail.close()
