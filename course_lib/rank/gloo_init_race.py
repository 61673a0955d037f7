"""A gloo rank the course starts waits at torch's init barrier: gloo's start loses a slow rank otherwise.

Upstream race (seen on torch 2.13 and 2.15, gloo's TCP transport): `init_process_group` returns on a
rank as soon as its own side of the full mesh is connected. A rank whose peers are all connected can
run a cell that calls no collective, destroy its group and exit while a slower rank is still reading
its side of one connection; that rank then fails inside `init_process_group` with "Gloo
connectFullMesh failed ... Connection closed by peer". With rank 0 starved (nice 19, the others busy)
it happened in 3 of 40 four-rank starts on torch 2.13 and 8 of 60 on 2.15 at load 4-5 (2 of 40 on an
idle machine with the four ranks on one core); lesson 02's sampler cell
(no collective) failed this way in a CI run.

`TORCH_DIST_INIT_BARRIER=1` (torch's own switch, off by default since 2023) makes every rank wait in a
store-based barrier after its process group is built, so no rank leaves before all are connected: 0 of
150 starts failed with it. It is a store round trip, not a collective: ledgers do not change.
It is set only around the default group's `init_process_group` (rank/__init__.py's wrapper, in every
notebook launch; the grader's ranks call a barrier right after init), because torch reads it in `new_group` too, where it would make every rank of
the world wait for every group's creation: lesson 01 shows `use_local_synchronization` and a rank
returning from `new_group` before the members, which that barrier would deadlock. Only gloo ranks get
it: on NCCL it would make init wait for every rank, which lesson 01 says NCCL without a bound device
does not. tests/test_gloo_init_race.py reproduces the race without it and checks it holds with it. A
learner's own `torchrun` (launch/) runs without it; a script that calls any collective is not exposed.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

__all__ = ["INIT_BARRIER_ENV", "init_barrier"]

INIT_BARRIER_ENV = "TORCH_DIST_INIT_BARRIER"


@contextlib.contextmanager
def init_barrier() -> Iterator[None]:
    """torch's init barrier on for the `init_process_group` called inside, off again after it (new_group
    keeps torch's default); a value someone set on purpose stands."""
    if INIT_BARRIER_ENV in os.environ:
        yield
        return
    os.environ[INIT_BARRIER_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(INIT_BARRIER_ENV, None)
