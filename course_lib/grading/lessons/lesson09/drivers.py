"""The rank side of lesson 09: context parallelism: how each exercise calls the learner's function.

Runs on the ranks, in the learner's process (see course_lib/grading/drivers.py for the rules every driver
follows: copy the inputs, return plain data). The ring drivers also record, on `time.monotonic()` (the
ledger's clock), when the learner's code computes (each matmul-like torch call, seen by a TorchFunctionMode)
and when it waits for a transfer (each `Work.wait()`), so that a judge can tell a transfer in flight during a
compute from one waited for first.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import time

import torch

from ...drivers import describe

__all__ = ["ring_backward", "ring_forward", "zigzag"]

# Torch calls that compute scores or a weighted sum of values: what "computing with a block" means here.
COMPUTE = frozenset(("matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "einsum",
                     "scaled_dot_product_attention"))


class _Computes(torch.overrides.TorchFunctionMode):
    """Appends the time of every matmul-like call made inside it to `times`."""

    def __init__(self, times: list):
        super().__init__()
        self.times = times

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in COMPUTE:
            self.times.append(time.monotonic())
        return func(*args, **(kwargs or {}))


class _Refused(torch.overrides.TorchFunctionMode):
    """torch.logsumexp and torch.logaddexp raise one line: the exercise carries the running max and sum."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("logsumexp", "logaddexp"):
            raise RuntimeError(f"torch.{func.__name__} is not allowed here: carry each query row's running max "
                               "and sum of exponentials yourself (lse = m + log(l))")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _recorded(computes: list, waits: list, messages: list, refuse: bool):
    """While inside: computes (times), waits ([start, end, work]) and point-to-point messages (["send" | "recv",
    peer, bytes, posted, returned, work], from the process group's methods, alone or inside batch_isend_irecv)
    recorded, `work` numbering the Work each returned, so a wait is paired with its own transfer; with `refuse`,
    torch.logsumexp and torch.logaddexp raise. Every Work is kept alive while inside (a receive the learner
    dropped unwaited would otherwise leave gloo a pending receive with no owner), and a transfer the learner
    never waited for is completed when the function returns, so the rank's group stays usable. All put back on
    the way out."""
    cpp = torch._C._distributed_c10d
    saved = [(cpp.Work, "wait", cpp.Work.wait), (cpp.ProcessGroup, "send", cpp.ProcessGroup.send),
             (cpp.ProcessGroup, "recv", cpp.ProcessGroup.recv)]
    wait_, send_, recv_ = (original for _, _, original in saved)

    kept: list = []                            # every Work returned, by number

    def number(work) -> int | None:
        return next((i for i, mine in enumerate(kept) if mine is work), None)

    def wait(self, *args, **kwargs):
        start = time.monotonic()
        try:
            return wait_(self, *args, **kwargs)
        finally:
            waits.append([start, time.monotonic(), number(self)])

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    def send(self, tensors, peer, tag=0):
        start = time.monotonic()
        work = send_(self, tensors, peer, tag)
        kept.append(work)
        messages.append(["send", int(peer), nbytes(tensors), start, time.monotonic(), len(kept) - 1])
        return work

    def recv(self, tensors, peer, tag=0):
        start = time.monotonic()
        work = recv_(self, tensors, peer, tag)
        kept.append(work)
        messages.append(["recv", int(peer), nbytes(tensors), start, time.monotonic(), len(kept) - 1])
        return work

    cpp.Work.wait, cpp.ProcessGroup.send, cpp.ProcessGroup.recv = wait, send, recv
    try:
        with _Computes(computes), (_Refused() if refuse else contextlib.nullcontext()):
            yield
        waited = {w[2] for w in waits}
        for work, handle in enumerate(kept):       # sends too: gloo would go on polling a dropped pending one
            if work not in waited:                 # not recorded: the judge names a receive never waited for
                _complete(wait_, handle, next(m for m in messages if m[5] == work), messages)
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


# How long a transfer the learner never waited for may take to complete after the function returns. Its peer
# has posted the other half by then, or never will (on gloo a wait that times out closes the pair: the rank's
# group is gone, so the run ends here, with the reason).
UNMATCHED_S = 5.0


def _complete(wait_, handle, message: list, messages: list) -> None:
    """Wait for a transfer the learner left unwaited, at most UNMATCHED_S; raise one line naming it if its peer
    never posted the matching half (an isend with no irecv, or the reverse)."""
    try:
        wait_(handle, timeout=datetime.timedelta(seconds=UNMATCHED_S))
    except RuntimeError:
        kind, peer, size = message[0], message[1], message[2]
        nth = sum(1 for m in messages[:messages.index(message) + 1] if m[0] == kind)
        done = "received" if kind == "send" else "sent"
        other = "irecv" if kind == "send" else "isend"
        raise RuntimeError(
            f"{kind} {nth} ({'to' if kind == 'send' else 'from'} rank {peer}, {size:,} bytes) was never {done}: "
            f"every {'isend' if kind == 'send' else 'irecv'} needs a matching {other} on its peer, and a ring's "
            f"last step sends nothing ({_count(messages, 'send')} and {_count(messages, 'recv')} here)") from None


def _count(messages: list, kind: str) -> str:
    """"3 sends", "1 receive": how many transfers of one kind the learner posted."""
    n = sum(1 for m in messages if m[0] == kind)
    return f"{n} {'send' if kind == 'send' else 'receive'}{'' if n == 1 else 's'}"


def _tensor(value, name: str):
    """A returned tensor on the CPU, detached, floats as float32 (the statements ask for values, not a dtype:
    a running state kept in float64 is judged by its values); or None and what it was instead."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return (value.float() if value.is_floating_point() else value).clone(), ""
    return None, f"{name} is a {describe(value)}"


def ring_forward(fn, q, k, v, positions, causal):
    """09.ring_online: the learner's (out, lse) for this rank's rows, with when it computed and waited."""
    computes, waits, messages = [], [], []
    with _recorded(computes, waits, messages, refuse=True):
        got = fn(q.clone(), k.clone(), v.clone(), [p.clone() for p in positions], causal)
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return {"returned": f"returned a {describe(got)}, not a pair (out, lse)"}
    out, wrong_out = _tensor(got[0], "out")
    lse, wrong_lse = _tensor(got[1], "lse")
    return {"returned": wrong_out or wrong_lse, "out": out, "lse": lse, "computes": computes, "waits": waits,
            "messages": messages}


def ring_backward(fn, q, k, v, out, lse, grad_out, positions, causal):
    """09.ring_backward: the learner's (dq, dk, dv) for this rank's rows."""
    computes, waits, messages = [], [], []
    with _recorded(computes, waits, messages, refuse=False):
        got = fn(q.clone(), k.clone(), v.clone(), out.clone(), lse.clone(), grad_out.clone(),
                 [p.clone() for p in positions], causal)
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        return {"returned": f"returned a {describe(got)}, not a triple (dq, dk, dv)"}
    found, wrong = {}, ""
    for name, value in zip(("dq", "dk", "dv"), got):
        found[name], said = _tensor(value, name)
        wrong = wrong or said
    return {"returned": wrong, "messages": messages, **found}


def _call(fn, *args):
    """fn(*args), or None and the exception in one line: each case of 09.zigzag is judged on its own."""
    try:
        return fn(*args), ""
    except Exception as exc:  # noqa: BLE001 - reported to the learner, case by case
        return None, f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")


def zigzag(fn, cases: list):
    """09.zigzag: for each (x, p, reference shards) case this rank was given, the learner's `zigzag_split(x, p)`
    and its `zigzag_merge` (defined in the same cell) of the reference shards, each judged on its own."""
    merge_fn = inspect.unwrap(fn).__globals__.get("zigzag_merge")  # the cell's module: fn is wrapped
    out = []
    for x, p, reference_shards in cases:
        entry = {"split": None, "split_returned": "", "merge": None, "merge_returned": ""}
        got, entry["split_returned"] = _call(fn, x.clone(), p)
        if isinstance(got, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in got):
            entry["split"] = [t.detach().clone() for t in got]
        elif not entry["split_returned"]:
            entry["split_returned"] = f"returned a {describe(got)}, not a list of tensors"
        if not callable(merge_fn):
            entry["merge_returned"] = "is missing: your cell defines no function zigzag_merge(shards)"
            out.append(entry)
            continue
        with getattr(fn, "learner_code", contextlib.nullcontext)():  # the learner's code runs: a hang is named
            merged, entry["merge_returned"] = _call(merge_fn, [t.clone() for t in reference_shards])
        if isinstance(merged, torch.Tensor):
            entry["merge"] = merged.detach().clone()
        elif not entry["merge_returned"]:
            entry["merge_returned"] = f"returned a {describe(merged)}, not a tensor"
        out.append(entry)
    return out
