"""DTensor's collectives as DTensor issues them (lesson 06): a `TorchDispatchMode` that records each functional
collective, with its bytes in and out, below autograd. The course's ledger sees torch.distributed's Python calls
only, and `CommDebugMode` counts these collectives without their bytes."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["COLLECTIVES", "Collectives"]

COLLECTIVES = frozenset(
    {("_c10d_functional", name)
     for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")}
    | {("_dtensor", "shard_dim_alltoall")})  # DTensor's all-to-all on a CUDA mesh: one op, seen whole


class Collectives(TorchDispatchMode):
    """`with Collectives() as seen: ...`, then `seen.calls`: (name, bytes in, bytes out) of each collective that
    ran under it, in order (backward included when it runs on this thread, as on the CPU). Not recorded, as run in
    lesson 06 on torch 2.13: loss_parallel's all-reduces, issued inside DTensor's cross-entropy (CommDebugMode
    counts them)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if (func.namespace, name) in COLLECTIVES:
            self.calls.append((name, args[0].nbytes, out.nbytes))
        return out
