"""The collective ledger: every collective and point-to-point call a rank makes, as it makes it.

`install(path)` wraps the public functions of `torch.distributed` (all_reduce,
broadcast, send, ...). Each call appends one JSON line when it starts and one
when it returns, straight to the file (no buffering), so the record survives
a rank that hangs or is killed mid-collective. The kernel reads the files:

    {"seq": 7, "op": "all_reduce", "group": "world", "shapes": [[1024]], "dtype": "float32",
     "bytes": 4096, "start": 12.345, "async": false}          # entered
    {"seq": 7, "end": 12.349}                                  # returned

`seq` counts calls per process group, so entry #7 of every member of a group
is meant to be the same collective: where ranks' ledgers disagree is where a
program went wrong. Calls made inside another recorded call (all_gather_object
calls all_gather) are not recorded twice. An `async_op=True` call "returns" when
its work object is created, not when the transfer completes.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import threading
import time
from typing import Any

__all__ = ["RECORDED_OPS", "install", "read_ledger"]

RECORDED_OPS = (
    "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "gather", "scatter",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
)

_state = threading.local()  # .depth: >0 while inside a recorded call


def _tensors(value: Any) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _group_name(group: Any) -> str:
    import torch.distributed as dist

    if group is None or group is dist.GroupMember.WORLD:
        return "world"
    try:
        return "ranks " + ",".join(map(str, dist.get_process_group_ranks(group)))
    except Exception:  # noqa: BLE001 - a group this rank is not in, or a P2POp list
        return "other"


class _Recorder:
    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.seq: dict[str, int] = {}
        self.lock = threading.Lock()

    def write(self, record: dict) -> None:
        os.write(self.fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def wrap(self, name: str, fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            if getattr(_state, "depth", 0):
                return fn(*args, **kwargs)
            bound = signature.bind_partial(*args, **kwargs).arguments
            tensors = _tensors(bound.get("tensor", bound.get("input_tensor", bound.get("tensor_list",
                               bound.get("input_tensor_list", bound.get("p2p_op_list"))))))
            if not tensors:
                tensors = _tensors(list(bound.values()))
            group = _group_name(bound.get("group"))
            with self.lock:
                seq = self.seq[group] = self.seq.get(group, 0) + 1
            self.write({
                "seq": seq, "op": name, "group": group,
                "shapes": [list(t.shape) for t in tensors],
                "dtype": str(tensors[0].dtype).removeprefix("torch.") if tensors else None,
                "bytes": sum(t.numel() * t.element_size() for t in tensors),
                "start": time.monotonic(), "async": bool(bound.get("async_op", False)) or name.startswith("i"),
            })
            _state.depth = 1
            try:
                return fn(*args, **kwargs)
            finally:
                _state.depth = 0
                self.write({"seq": seq, "group": group, "end": time.monotonic()})

        recorded.__course_lib_ledger__ = True
        return recorded


def install(path: str) -> None:
    """Record this process's collectives into `path` (idempotent)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

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


def read_ledger(path: str) -> list[dict]:
    """The entries of one rank's ledger file, each with `end` (None while still inside the call)."""
    entries: dict[tuple[str, int], dict] = {}
    order: list[tuple[str, int]] = []
    try:
        with open(path) as handle:
            lines = handle.read().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
        key = (record["group"], record["seq"])
        if "op" in record:
            entries[key] = {**record, "end": None}
            order.append(key)
        elif key in entries:
            entries[key]["end"] = record["end"]
    return [entries[key] for key in order]
