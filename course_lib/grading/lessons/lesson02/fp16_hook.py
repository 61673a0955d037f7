"""02.fp16_compress_hook: a DDP communication hook that all-reduces float16, half the bytes."""

from __future__ import annotations

from ....units import binary_bytes
from ...compare import each_result, first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import (ALL_REDUCE, DDP_PRELOAD, FP16_ATOL, FP16_RTOL, NAMES, _batch_label, _full_batch, _grads,
                     _ratio_hint, _shard_cases)

__all__ = ["FP16_HOOK"]

def _own_hook(judge):
    """`judge`, after checking that the hook did not use torch's own compression hooks."""

    def judged(outcome: RunOutcome) -> list[str]:
        for _, rank, result in each_result(outcome):
            # fp16_compress_hook and bf16_compress_hook call _compress_hook: name what the learner called.
            used = [n for n in result.output["torch_compression"] if n != "_compress_hook"] or \
                result.output["torch_compression"]
            if used:
                return [f"rank {rank}: your hook uses torch's own {', '.join(used)}; write the compression "
                        "yourself (cast, divide, all_reduce, cast back)"]
        return judge(outcome)

    judged.__doc__ = judge.__doc__
    return judged


# Targets scaled so that each rank's largest gradient is about 42,600: within float16 (largest 65504), as is
# the average over the ranks, while the sum of 2 ranks' is not.
LARGE_TARGETS = 150_000.0


def _large_gradient_case(n: int) -> dict[int, tuple]:
    """Every rank the same 4 rows, targets scaled by LARGE_TARGETS: equal gradients near 42,600 on each rank."""
    (case,) = _shard_cases(n, [(9, 4 * n, 73, ())])
    _, inputs, targets, _ = case[0]
    return {r: (case[r][0], inputs, targets * LARGE_TARGETS) for r in range(n)}


def _overflow_hint(got) -> str:
    import torch

    if torch.isfinite(got).all():
        return ""
    return (": float16 overflowed (its largest value is 65504): each rank's gradient fits and so does the "
            "average, but the sum over the ranks does not; keep every value within range on the way")


def _hook_grads(outcome: RunOutcome) -> list[str]:
    """Every rank's .grad is the full-batch gradient, within float16 rounding."""
    n = outcome.nproc
    for case, by_rank in enumerate(outcome.results):
        weights = outcome.inputs[case][0][0]
        expected = _grads(weights, *_full_batch(outcome, case))
        for rank in range(n):
            got = by_rank[rank].output["grads"]
            for name in NAMES:
                wrong = first_difference(got[name], expected[name], rtol=FP16_RTOL, atol=FP16_ATOL)
                if wrong:
                    # A sum of N float16 gradients carries N times their rounding.
                    hint = _overflow_hint(got[name]) or _ratio_hint(got[name], expected[name], n, FP16_RTOL,
                                                                    n * FP16_ATOL)
                    return [f"rank {rank}, {_batch_label(outcome, case)}: {name}.grad {wrong}{hint}"]
    return []


def _float16_on_the_wire(outcome: RunOutcome) -> list[str]:
    """The ledger: one all_reduce per DDP bucket, float16, 2 bytes per gradient element."""
    for case, rank, result in each_result(outcome):
        buckets = result.output["buckets"]
        calls = [entry for entry in result.ledger if entry["op"] == "all_reduce"]
        where = f"rank {rank}, {_batch_label(outcome, case)}"
        expected = ", ".join(f"float16 of {binary_bytes(2 * numel)}" for numel in buckets)
        got = ", ".join(f"{entry['dtype']} of {binary_bytes(entry['bytes'])}" for entry in calls)
        if [(e["dtype"], e["bytes"]) for e in calls] == [("float16", 2 * numel) for numel in buckets]:
            continue
        hint = ""
        if calls and all(e["dtype"] == "float32" for e in calls):
            hint = (": float32 on the wire, twice the bytes; all-reduce bucket.buffer().to(torch.float16), "
                    "not the buffer itself")
        return [f"{where}: all_reduce {got or 'never called'}, expected {len(buckets)} call"
                f"{'s' if len(buckets) != 1 else ''}: {expected} (half the float32 gradients' bytes){hint}"]
    return []


def _asynchronous(outcome: RunOutcome) -> list[str]:
    """The ledger: the hook's all_reduce was started with async_op=True (backward goes on meanwhile)."""
    for case, rank, result in each_result(outcome):
        blocking = [e for e in result.ledger if e["op"] == "all_reduce" and not e["async"]]
        if blocking:
            return [f"rank {rank}, {_batch_label(outcome, case)}: the all_reduce was not asynchronous, so "
                    "backward waited for it; call dist.all_reduce(..., async_op=True) and return "
                    ".get_future().then(...)"]
    return []


FP16_HOOK = Exercise(
    id="02.fp16_compress_hook",
    function="fp16_compress",
    signature="fp16_compress(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) "
              "-> torch.futures.Future[torch.Tensor]",
    driver="ddp_comm_hook",
    allowed_ops=ALL_REDUCE,
    required_ops=ALL_REDUCE,
    preload=DDP_PRELOAD,
    runs=(
        RunSpec(2, lambda n: [{r: case[r][:3] for r in case} for case in _shard_cases(n, [(7, 8, 71, ())])]
                + [_large_gradient_case(n)],
                (Item("gradients equal the full-batch ones within float16 rounding (2 ranks)", 1,
                      _own_hook(_hook_grads)),
                 Item("all-reduces float16: half the bytes of the float32 gradients (2 ranks)", 1,
                      _own_hook(_float16_on_the_wire)),
                 Item("starts the all_reduce with async_op=True and returns its future", 1,
                      _own_hook(_asynchronous)))),
        RunSpec(3, lambda n: [{r: case[r][:3] for r in case} for case in _shard_cases(n, [(8, 9, 72, ())])],
                (Item("gradients equal the full-batch ones within float16 rounding (3 ranks)", 1,
                      _own_hook(_hook_grads)),
                 Item("all-reduces float16: half the bytes of the float32 gradients (3 ranks)", 1,
                      _own_hook(_float16_on_the_wire)))),
    ),
    hints=(
        "Reread lesson 02, section 7 'Communication hooks: compress what goes on the wire', and in section 4 "
        "'The two pieces of the overlap': an all-reduce that returns before it has finished, and its future.",
        "GradBucket.buffer(); torch.Tensor.to(torch.float16); dist.all_reduce(..., async_op=True) and the "
        "handle's get_future(); torch.futures.Future.then.",
        "Take the bucket's flat float32 gradients, make a float16 copy divided by the group's size (so that the "
        "sum stays within float16's range), start its all-reduce without waiting, and return a future that, "
        "once the all-reduce is done, copies the result back into the bucket's buffer and gives that buffer.",
    ),
)
