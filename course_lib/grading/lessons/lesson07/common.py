"""What lesson 07's exercises share: tolerances, DCP's modules to preload, one process's reference, and how a
judge says where and what differs.

Every run trains lesson 07's run (drivers.train: lessons 04-05's model, Adam with a StepLR, a shuffled sampler,
noise from the global RNG) with FSDP2 over a CPU mesh (gloo). References are one process, computed here with
the same `train` and no torch.distributed (`drivers.one_process_app` for 07.app_state's own run).
"""

from __future__ import annotations

import functools

from ...compare import first_difference
from ...spec import RunOutcome
from .drivers import full_state, new_run, train

__all__ = ["ATOL", "DCP_PRELOAD", "RTOL", "one_process", "state_wrong", "where"]

RTOL, ATOL = 1e-5, 1e-6
DCP_PRELOAD = ("torch._dynamo", "torch.distributed.fsdp", "torch.distributed.checkpoint",
               "torch.distributed.checkpoint.state_dict")


@functools.cache
def one_process(steps: int) -> tuple[list[float], dict]:
    """One process's losses of the first `steps` steps and its state afterwards (drivers.full_state)."""
    run = new_run(None)
    losses = train(run, steps)
    return losses, full_state(run.model, run.optimizer)


def where(outcome: RunOutcome, case: int, rank: int) -> str:
    return f"rank {rank}, case {case + 1} of {len(outcome.inputs)} ({outcome.nproc} ranks)"


def state_wrong(got: dict, want: dict, parts=("model", "exp_avg", "exp_avg_sq")) -> str:
    """"" if `got`'s parameters and Adam moments equal `want`'s; else the first difference, in words."""
    for part in (p for p in parts if p != "steps"):
        for name, value in want[part].items():
            if name not in got[part]:
                what = "the parameter" if part == "model" else f"Adam's {part}"
                return f"{what} of {name} is missing (the optimizer holds no state for it)"
            wrong = first_difference(got[part][name], value, rtol=RTOL, atol=ATOL)
            if wrong:
                what = name if part == "model" else f"Adam's {part} of {name}"
                return f"{what} {wrong}"
    if "steps" in parts and got["steps"] != want["steps"]:
        return f"Adam's step counters are {sorted(set(got['steps'].values()))}, expected {sorted(set(want['steps'].values()))}"
    return ""


