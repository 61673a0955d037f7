"""03.counting_joinable: a Joinable of one's own: the count, sum and maximum of values over all ranks.

The checker makes `Counter()` on every rank and calls `counter(value)` once per value of that rank's
list (their number differs per rank) inside torch's `Join([counter])`. Every rank's `count`, `total`
and `peak` must be the number, sum and maximum of the values over all ranks, and `is_last_joiner`
(from the hook's post_hook) True exactly on the ranks with the most calls. The values are negative
halves (exact in float32), so a joined rank that stands in with 0 for the maximum shows. Judges
recognise: a joined rank counted as taking part, a join hook that adds nothing, a 0 standing in for
a maximum, a post_hook that records nothing, an object that is not a Joinable.
"""

from __future__ import annotations

from ...compare import each_result
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import ALL_REDUCE, counts_label

__all__ = ["COUNTING"]


def _value_cases(n: int, specs: list[tuple[tuple[float, ...], ...]]) -> list[dict[int, tuple]]:
    """One case per tuple of per-rank value lists: rank r calls counter(v) for each v of specs[case][r]."""
    return [{r: (list(values[r]),) for r in range(n)} for values in specs]


def _calls(outcome: RunOutcome, case: int) -> list[int]:
    return [len(outcome.inputs[case][r][0]) for r in range(outcome.nproc)]


def _label(outcome: RunOutcome, case: int) -> str:
    return f"case {case + 1} of {len(outcome.inputs)} (calls per rank: {counts_label(_calls(outcome, case))})"


def _not_joinable(outcome: RunOutcome) -> str:
    for case, rank, result in each_result(outcome):
        if "not_joinable" in result.output:
            return (f"rank {rank}, {_label(outcome, case)}: Counter() made a "
                    f"{result.output['not_joinable']}, not a Joinable; subclass "
                    "torch.distributed.algorithms.join.Joinable")
    return ""


def _counted(outcome: RunOutcome) -> list[str]:
    """Every rank's count, total and peak: the number, sum and maximum of every rank's values."""
    n = outcome.nproc
    if (problem := _not_joinable(outcome)):
        return [problem]
    for case, by_rank in enumerate(outcome.results):
        values = [outcome.inputs[case][r][0] for r in range(n)]
        calls = _calls(outcome, case)
        everything = [v for vs in values for v in vs]
        expected = {"count": float(len(everything)), "total": float(sum(everything)), "peak": float(max(everything))}
        for rank in range(n):
            where = f"rank {rank}, {_label(outcome, case)}"
            for key, want in expected.items():
                got = by_rank[rank].output[key]
                if not isinstance(got, float):
                    return [f"{where}: counter.{key} is a {got}, expected a number or a one-element tensor"]
                if got == want:
                    continue
                hint = ""
                took_part = [k for k in range(calls[rank])]  # the iterations this rank called in
                own = [vs[k] for vs in values for k in took_part if k < len(vs)]
                if key == "count" and got == float(n * max(calls)):
                    hint = (f": that is {n} ranks times {max(calls)} iterations, every rank counted in every "
                            "iteration; a rank that has joined takes no part in the others' iterations")
                elif key == "peak" and got == 0.0:
                    hint = (": every value is negative, so 0 came from a rank that had joined; what a joined rank "
                            "contributes must change no result: 0 leaves a sum alone, not a maximum")
                elif (key, got) in (("count", float(len(own))), ("total", float(sum(own)))):
                    hint = (f": that counts only the {calls[rank]} iteration{'s' if calls[rank] != 1 else ''} this "
                            "rank called in; after it has joined, it must still take part in the others' "
                            "collectives, and add what they found")
                return [f"{where}: {key} is {got:g}, expected {want:g} (over every rank's values){hint}"]
    return []


def _last_joiner(outcome: RunOutcome) -> list[str]:
    """post_hook recorded is_last_joiner: True exactly on the ranks with the most calls."""
    if (problem := _not_joinable(outcome)):
        return [problem]
    for case, by_rank in enumerate(outcome.results):
        calls = _calls(outcome, case)
        for rank, result in sorted(by_rank.items()):
            got, expected = result.output["is_last_joiner"], calls[rank] == max(calls)
            if got == expected and isinstance(got, bool):
                continue
            where = f"rank {rank}, {_label(outcome, case)}"
            if got is None:
                return [f"{where}: counter.is_last_joiner is None afterwards; what post_hook is told must be "
                        "stored on the counter"]
            if not isinstance(got, bool):
                return [f"{where}: counter.is_last_joiner is a {got}, expected a bool"]
            why = "the most calls" if expected else f"fewer calls than {max(calls)}"
            return [f"{where}: is_last_joiner is {got}, expected {expected} (this rank made {why})"]
    return []


COUNTING = Exercise(
    id="03.counting_joinable",
    function="Counter",
    signature="class Counter(Joinable): __call__(value: float) -> None, join_hook(**kwargs) -> JoinHook",
    driver="counting_joinable",
    allowed_ops=ALL_REDUCE,
    required_ops=ALL_REDUCE,
    runs=(
        RunSpec(2, lambda n: _value_cases(n, [((-1.5, -2.0), (-0.5, -3.0, -1.0))]),
                (Item("every rank: count 5, total -8, peak -0.5 (2 ranks: 2 and 3 calls)", 1, _counted),
                 Item("post_hook: is_last_joiner True on the rank with the most calls only (2 ranks)", 1,
                      _last_joiner)), timeout_s=10),
        RunSpec(3, lambda n: _value_cases(n, [((-2.5,), (-4.0, -1.5, -0.5), (-3.0, -1.0)),
                                              ((-1.0, -2.0, -0.5), (-3.5,), (-2.0, -1.5, -4.0))]),
                (Item("every rank: the count, total and peak of all values (3 ranks: 1, 3, 2 and 3, 1, 3 calls)", 1,
                      _counted),
                 Item("post_hook: is_last_joiner True on the ranks with the most calls, a tie included (3 ranks)",
                      1, _last_joiner)), timeout_s=10),
    ),
    hints=(
        "Reread lesson 03, section 8 'A Joinable of your own' (what Join calls, when, and on which ranks).",
        "torch.distributed.algorithms.join: Joinable, JoinHook.main_hook / post_hook(is_last_joiner), "
        "Join.notify_join_context(joinable); dist.all_reduce(tensor, op=dist.ReduceOp.SUM or MAX).",
        "A rank still iterating announces itself to the context manager before its own collectives; a rank that "
        "has run out must make the same collectives, once per iteration of the others, with values that change "
        "no result (what leaves a sum unchanged, and what never wins a maximum), and still update its own count, "
        "total and peak with what the others found; at the end, remember what post_hook is told.",
    ),
)
