"""The collective ledger: every collective and point-to-point call a rank makes, as it makes it.

`install(path)` wraps the public functions of `torch.distributed` that
`course_lib.vocabulary.RECORDED_OPS` names (all_reduce, broadcast, send, ...).
Each call appends one JSON line when it starts and one when it returns,
straight to the file (no buffering), so the record survives a rank that hangs
or is killed mid-collective. `op` is the course's name for the collective,
the same on every torch version (`vocabulary.canonical_op`: torch 2.11's
`all_gather_into_tensor` and 2.13's `all_gather_single` are both
`all_gather_single`); `call` is the function the program called. The kernel
reads the files:

    {"seq": 7, "op": "all_reduce", "call": "all_reduce", "group": "world", "shapes": [[1024]],
     "dtype": "float32", "bytes": 4096, "start": 12.345, "async": false}     # entered
    {"seq": 7, "end": 12.349}                                  # returned
    {"seq": 7, "end": 12.349, "error": "RuntimeError"}         # ... or raised

`seq` counts calls per process group, so entry #7 of every member of a group
is meant to be the same collective: where ranks' ledgers disagree is where a
program went wrong. Calls made inside another recorded call (all_gather_object
calls all_gather) are not recorded twice. An `async_op=True` call "returns" when
its work object is created, not when the transfer completes.

The wrapper is the course's, not the learner's: a collective that raises shows
the learner's line, then torch's frames, never the wrapper's. A frame cannot
leave a traceback it raises through, so `hide_frames` unlinks it afterwards,
where tracebacks are printed: `install` hooks `sys.excepthook` (a `%%torchrun`
rank's uncaught error), and the pool worker calls it (`%%dist`).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import threading
import time
import types
from typing import Any, Callable

from ..vocabulary import ALWAYS_ASYNC, RECORDED_OPS, canonical_op

__all__ = ["LedgerReader", "hide_frames", "install", "read_ledger"]

_state = threading.local()  # .depth: >0 while inside a recorded call
_WRAPPER_CODE: set[types.CodeType] = set()  # the code of `recorded` below: its frames are hidden from tracebacks


def _tensors(value: Any) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, _p2p_op_type()):  # batch_isend_irecv's list: each op's tensor, sent or received
        return [value.tensor]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _p2p_op_type() -> type:
    from torch.distributed import P2POp

    return P2POp


def _p2p_ops(value: Any) -> str:
    """batch_isend_irecv's ops as JSON: [["isend", peer, bytes], ["irecv", peer, bytes], ...], in the list's order."""
    ops = [[getattr(op.op, "__name__", str(op.op)), op.peer, op.tensor.numel() * op.tensor.element_size()]
           for op in value or () if isinstance(op, _p2p_op_type())]
    return json.dumps(ops, separators=(",", ":"))


def _group_name(group: Any) -> str:
    import torch.distributed as dist

    if group is None or group is dist.GroupMember.WORLD:
        return "world"
    try:
        return "ranks " + ",".join(map(str, dist.get_process_group_ranks(group)))
    except Exception:  # noqa: BLE001 - a group this rank is not in, or a P2POp list
        return "other"


# The argument that holds this rank's input, by name, in order of preference.
_INPUT_PARAMS = ("tensor", "input_tensor", "input_tensor_list", "input_list", "input", "tensor_list", "p2p_op_list")


def _arg(args: tuple, kwargs: dict, index: int | None, name: str) -> Any:
    if index is not None and index < len(args):
        return args[index]
    return kwargs.get(name)


class _Recorder:
    """Writes two lines per call. Kept lean: it runs around every collective (bench/ measures it)."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.seq: dict[str, int] = {}
        self.lock = threading.Lock()

    def wrap(self, name: str, fn):
        params = list(inspect.signature(fn).parameters)
        input_name = next((p for p in _INPUT_PARAMS if p in params), None)
        input_index = params.index(input_name) if input_name else None
        group_index = params.index("group") if "group" in params else None
        async_index = params.index("async_op") if "async_op" in params else None
        always_async = name in ALWAYS_ASYNC
        is_batch_p2p = input_name == "p2p_op_list"
        op = canonical_op(name)
        fd, seqs, lock = self.fd, self.seq, self.lock

        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            if getattr(_state, "depth", 0):
                return fn(*args, **kwargs)
            tensors = _tensors(_arg(args, kwargs, input_index, input_name)) if input_name else []
            group = _group_name(_arg(args, kwargs, group_index, "group"))
            is_async = always_async or bool(_arg(args, kwargs, async_index, "async_op"))
            with lock:
                seq = seqs[group] = seqs.get(group, 0) + 1
            dtype = f'"{str(tensors[0].dtype)[6:]}"' if tensors else "null"  # "torch.float32" -> "float32"
            shapes = [list(t.shape) for t in tensors]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            # batch_isend_irecv: "bytes" counts sends and receives together; "ops" says which is which.
            ops = f',"ops":{_p2p_ops(_arg(args, kwargs, input_index, input_name))}' if is_batch_p2p else ""
            os.write(fd, (
                f'{{"seq":{seq},"op":"{op}","call":"{name}","group":"{group}","shapes":{shapes},"dtype":{dtype},'
                f'"bytes":{nbytes},"start":{time.monotonic()!r},"async":{"true" if is_async else "false"}{ops}}}\n'
            ).encode())
            _state.depth = 1
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                # Returned, but failed: say so, or a peer's death would look like a completed call.
                os.write(fd, f'{{"seq":{seq},"group":"{group}","end":{time.monotonic()!r},'
                             f'"error":"{type(exc).__name__}"}}\n'.encode())
                raise
            finally:
                _state.depth = 0
            os.write(fd, f'{{"seq":{seq},"group":"{group}","end":{time.monotonic()!r}}}\n'.encode())
            return result

        recorded.__course_lib_ledger__ = True
        _WRAPPER_CODE.add(recorded.__code__)  # every wrapper shares this code object
        return recorded


def _unlinked(tb: types.TracebackType | None, hidden: Callable[[types.CodeType], bool]):
    """The traceback `tb` without the entries whose code is hidden (entries are relinked in place)."""
    head = last = None
    while tb is not None:
        following = tb.tb_next
        if not hidden(tb.tb_frame.f_code):
            if last is None:
                head = tb
            else:
                last.tb_next = tb
            last = tb
        tb = following
    if last is not None:
        last.tb_next = None
    return head


def hide_frames(exc: BaseException, also: Callable[[types.CodeType], bool] = lambda code: False) -> BaseException:
    """Unlink the ledger's wrapper frames, and those whose code `also` names, from the tracebacks of
    `exc` and of every exception chained to it (cause, context, group members); returns `exc`."""
    def hidden(code: types.CodeType) -> bool:
        return code in _WRAPPER_CODE or also(code)

    todo, seen = [exc], set()
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.with_traceback(_unlinked(current.__traceback__, hidden))
        todo += [current.__cause__, current.__context__, *getattr(current, "exceptions", ())]
    return exc


def _install_excepthook() -> None:
    """A rank's uncaught error is printed without the wrapper's frames (idempotent).

    Installed before the learner's `init_process_group`, which wraps whatever
    `sys.excepthook` is then (to prefix lines with "[rankN]: "), so this runs inside it.
    """
    previous = sys.excepthook
    if getattr(previous, "__course_lib_ledger__", False):
        return

    def excepthook(etype, value, tb):
        if isinstance(value, BaseException):
            tb = hide_frames(value).__traceback__
        previous(etype, value, tb)

    excepthook.__course_lib_ledger__ = True
    sys.excepthook = excepthook


def install(path: str) -> None:
    """Record this process's collectives into `path`, and hide the recording from tracebacks (idempotent)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    _install_excepthook()
    recorder = _Recorder(path)
    for name in RECORDED_OPS:
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "__course_lib_ledger__", False):
            continue
        wrapped = recorder.wrap(name, original)
        # Both spellings: `dist.all_reduce` and `distributed_c10d.all_reduce`.
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)


class LedgerReader:
    """Reads one rank's ledger file incrementally: each call parses only the lines added since."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0
        self.partial = b""
        self.entries: list[dict] = []
        self.open: dict[tuple[str, int], dict] = {}  # entered, not yet returned

    def read(self) -> list[dict]:
        """All entries so far, each with `end` (None while still inside the call)."""
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return self.entries
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            key = (record["group"], record["seq"])
            if "op" in record:
                entry = {**record, "end": None, "error": None}
                self.entries.append(entry)
                self.open[key] = entry
            elif key in self.open:
                entry = self.open.pop(key)
                entry["end"] = record["end"]
                entry["error"] = record.get("error")  # the exception's name, if the call raised
        return self.entries


def read_ledger(path: str) -> list[dict]:
    """The entries of one rank's ledger file, each with `end` (None while still inside the call)."""
    return LedgerReader(path).read()
