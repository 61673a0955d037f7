"""02.bucketed_allreduce: average a list of tensors with one all_reduce per bucket of at most a cap."""

from __future__ import annotations

from ....units import binary_bytes
from ...compare import first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import ALL_REDUCE, ATOL, RTOL, _ratio_hint

__all__ = ["BUCKETED", "greedy_buckets"]

def greedy_buckets(sizes: list[int], cap: int) -> list[int]:
    """Bytes of each bucket when tensors of `sizes` bytes, in order, fill buckets of at most `cap` bytes.

    A tensor joins the open bucket if the bucket stays within `cap`; otherwise it opens the next.
    A tensor larger than `cap` gets a bucket of its own.
    """
    buckets: list[int] = []
    for size in sizes:
        if buckets and buckets[-1] + size <= cap:
            buckets[-1] += size
        else:
            buckets.append(size)
    return buckets


def _tensor_lists(n: int, specs: list[tuple[list[tuple], str, int]], seed: int) -> list[dict[int, tuple]]:
    """One case per (shapes, dtype name, cap in bytes): rank r gets its own integer-valued tensors."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    cases = []
    for shapes, dtype, cap in specs:
        cases.append({r: ([torch.randint(-9, 10, shape, generator=generator).to(getattr(torch, dtype))
                           for shape in shapes], cap) for r in range(n)})
    return cases


def _list_label(outcome: RunOutcome, case: int) -> str:
    tensors, cap = outcome.inputs[case][0]
    shapes = ", ".join("x".join(map(str, t.shape)) for t in tensors)
    return (f"case {case + 1} of {len(outcome.inputs)} ({str(tensors[0].dtype)[6:]} tensors of shapes {shapes}, "
            f"cap {binary_bytes(cap)})")


def _list_averaged(outcome: RunOutcome) -> list[str]:
    """Every tensor of the list holds the average over ranks, in place, in its dtype."""
    import torch

    n = outcome.nproc
    for case, by_rank in enumerate(outcome.results):
        tensors = [outcome.inputs[case][r][0] for r in range(n)]
        expected = [sum(t[i].double() for t in tensors).div(n).to(tensors[0][i].dtype) for i in range(len(tensors[0]))]
        for rank in range(n):
            got = by_rank[rank].output["tensors"]
            where = f"rank {rank}, {_list_label(outcome, case)}"
            for index, want in enumerate(expected):
                wrong = first_difference(got[index], want, rtol=RTOL, atol=ATOL)
                if not wrong:
                    continue
                hint = ""
                if torch.equal(got[index], tensors[rank][index]):
                    hint = (": it is unchanged; copy the averaged flat bucket back into the tensors "
                            "(views of it, or torch._utils._unflatten_dense_tensors)")
                else:
                    hint = _ratio_hint(got[index], want, n)
                return [f"{where}: tensor {index} {wrong}{hint}"]
    return []


def _one_all_reduce_per_bucket(outcome: RunOutcome) -> list[str]:
    """The ledger: one all_reduce per bucket of the greedy packing, each of the bucket's bytes."""
    for case, by_rank in enumerate(outcome.results):
        tensors, cap = outcome.inputs[case][0]
        sizes = [t.numel() * t.element_size() for t in tensors]
        expected = greedy_buckets(sizes, cap)
        for rank, result in sorted(by_rank.items()):
            got = [entry["bytes"] for entry in result.ledger if entry["op"] == "all_reduce"]
            if got == expected:
                continue
            shown = lambda sizes: ", ".join(binary_bytes(s) for s in sizes)  # noqa: E731
            hint = ""
            if got == greedy_buckets(sizes, cap - 1):
                hint = (f": a bucket of exactly {binary_bytes(cap)} was split; a bucket may hold up to the cap, "
                        "equal included")
            elif got == sizes:
                hint = ": one all_reduce per tensor; pack consecutive tensors into flat buckets first"
            elif len(got) == 1 and len(expected) > 1:
                hint = f": everything in one bucket; start a new bucket when the next tensor would pass {binary_bytes(cap)}"
            elif sum(got) == sum(sizes):
                hint = (f": a bucket takes the next tensor while it stays within {binary_bytes(cap)}; a tensor "
                        "larger than the cap gets a bucket of its own")
            return [f"rank {rank}, {_list_label(outcome, case)}: {len(got)} all_reduce call{'s' if len(got) != 1 else ''}"
                    f"{' of ' + shown(got) if got else ''}, expected {len(expected)}, of {shown(expected)} "
                    f"(consecutive tensors, in order, in buckets of at most {binary_bytes(cap)}){hint}"]
    return []


BUCKETED = Exercise(
    id="02.bucketed_allreduce",
    function="allreduce_bucketed",
    signature="allreduce_bucketed(tensors: list[torch.Tensor], bucket_cap_bytes: int) -> None",
    driver="in_place_list",
    allowed_ops=ALL_REDUCE,
    required_ops=ALL_REDUCE,
    runs=(
        RunSpec(2, lambda n: _tensor_lists(n, [([(3, 4), (5,), (2, 2), (7,), (6,)], "float32", 64),
                                               ([(4,), (2, 3), (3,)], "float64", 100)], seed=21),
                (Item("averages every tensor in place on 2 ranks (float32 and float64)", 1, _list_averaged),
                 Item("one all_reduce per bucket, of the bucket's bytes, on 2 ranks", 1, _one_all_reduce_per_bucket))),
        # 8, 160, 12, 20, 4, 4 B: one tensor per call and a bucket split at the cap give different calls here
        # (without the last two tensors both would send 8, 160, 12, 20 B).
        RunSpec(3, lambda n: _tensor_lists(n, [([(2,), (10, 4), (3,), (5,), (1,), (1,)], "float32", 32)], seed=22),
                (Item("averages on 3 ranks, with a tensor larger than the cap", 1, _list_averaged),
                 Item("one all_reduce per bucket on 3 ranks (the large tensor alone)", 1, _one_all_reduce_per_bucket))),
    ),
    hints=(
        "Reread lesson 02, section 4 'Buckets: what backward sends, and when': why DDP packs gradients into "
        "buckets, and how a bucket fills up to a cap.",
        "torch.cat (or one flat buffer and views of it), dist.all_reduce, torch.Tensor.copy_; a tensor's bytes "
        "are its numel() times its element_size().",
        "Walk the tensors in order, adding each to the open bucket while the bucket's bytes stay within the cap, "
        "else opening the next one. For each bucket make one flat tensor of its tensors, all-reduce it once, "
        "divide by the world size, and copy each tensor's slice back into that same tensor (the caller keeps "
        "the tensors, not the list).",
    ),
)
