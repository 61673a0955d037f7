"""03.counting_joinable: a Joinable of one's own, a counter of the calls made over all ranks.

The checker makes `Counter()` on every rank and calls it a different number of times per rank inside
torch's `Join([counter])`. Every rank's `count` must be the number of calls over all ranks, and
`is_last_joiner` (from the hook's post_hook) True exactly on the ranks with the most calls. Judges
recognise: a joined rank counted as taking part, a join hook that adds nothing, a post_hook that
records nothing, an object that is not a Joinable.
"""

from __future__ import annotations

from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import ALL_REDUCE, counts_label as _counts_label

__all__ = ["COUNTING"]




def _iteration_cases(n: int, specs: list[tuple[int, ...]]) -> list[dict[int, tuple]]:
    """One case per tuple of iterations, rank r calling the counter counts[r] times."""
    return [{r: (counts[r],) for r in range(n)} for counts in specs]


def _iterations(outcome: RunOutcome, case: int) -> list[int]:
    return [outcome.inputs[case][r][0] for r in range(outcome.nproc)]


def _iterations_label(outcome: RunOutcome, case: int) -> str:
    return f"case {case + 1} of {len(outcome.inputs)} (calls per rank: {_counts_label(_iterations(outcome, case))})"


def _not_joinable(outcome: RunOutcome) -> str:
    for case, by_rank in enumerate(outcome.results):
        for rank, result in sorted(by_rank.items()):
            if "not_joinable" in result.output:
                return (f"rank {rank}, {_iterations_label(outcome, case)}: Counter() made a "
                        f"{result.output['not_joinable']}, not a Joinable; subclass "
                        "torch.distributed.algorithms.join.Joinable")
    return ""


def _counted(outcome: RunOutcome) -> list[str]:
    """Every rank's count equals the number of calls over all ranks (the ranks taking part, summed over iterations)."""
    n = outcome.nproc
    if (problem := _not_joinable(outcome)):
        return [problem]
    for case, by_rank in enumerate(outcome.results):
        counts = _iterations(outcome, case)
        expected = float(sum(counts))
        for rank in range(n):
            got = by_rank[rank].output["count"]
            where = f"rank {rank}, {_iterations_label(outcome, case)}"
            if not isinstance(got, float):
                return [f"{where}: counter.count is a {got}, expected a number or a one-element tensor"]
            if got == expected:
                continue
            own = float(sum(sum(1 for c in counts if c > k) for k in range(counts[rank])))
            hint = ""
            if got == float(n * max(counts)):
                hint = (f": that is {n} ranks times {max(counts)} iterations, every rank counted in every "
                        "iteration; a joined rank takes no part: its main_hook all-reduces zeros, not ones")
            elif got == own:
                hint = (f": that counts only the {counts[rank]} iteration{'s' if counts[rank] != 1 else ''} this "
                        "rank took part in; a joined rank's main_hook must all-reduce zeros (matching the others' "
                        "all-reduce of ones) and add the result to count, so that it counts their iterations too")
            return [f"{where}: count is {got:g}, expected {expected:g} (the ranks taking part in each "
                    f"iteration, summed){hint}"]
    return []


def _last_joiner(outcome: RunOutcome) -> list[str]:
    """post_hook recorded is_last_joiner: True exactly on the ranks with the most calls."""
    if (problem := _not_joinable(outcome)):
        return [problem]
    for case, by_rank in enumerate(outcome.results):
        counts = _iterations(outcome, case)
        for rank, result in sorted(by_rank.items()):
            got, expected = result.output["is_last_joiner"], counts[rank] == max(counts)
            if got == expected and isinstance(got, bool):
                continue
            where = f"rank {rank}, {_iterations_label(outcome, case)}"
            if got is None:
                return [f"{where}: counter.is_last_joiner is None afterwards; post_hook(is_last_joiner) must "
                        "store it on the counter"]
            if not isinstance(got, bool):
                return [f"{where}: counter.is_last_joiner is a {got}, expected a bool"]
            why = "the most calls" if expected else f"fewer calls than {max(counts)}"
            return [f"{where}: is_last_joiner is {got}, expected {expected} (this rank made {why})"]
    return []


COUNTING = Exercise(
    id="03.counting_joinable",
    function="Counter",
    signature="class Counter(Joinable): __call__() -> None, join_hook(**kwargs) -> JoinHook",
    driver="counting_joinable",
    allowed_ops=ALL_REDUCE,
    required_ops=ALL_REDUCE,
    runs=(
        RunSpec(2, lambda n: _iteration_cases(n, [(2, 3)]),
                (Item("every rank counts 5 calls (2 ranks: 2 and 3 calls)", 1, _counted),
                 Item("post_hook: is_last_joiner True on the rank with the most calls only (2 ranks)", 1,
                      _last_joiner)), timeout_s=10),
        RunSpec(3, lambda n: _iteration_cases(n, [(1, 3, 2), (3, 1, 3)]),
                (Item("every rank counts all calls (3 ranks: 1, 3, 2 and 3, 1, 3 calls)", 1, _counted),
                 Item("post_hook: is_last_joiner True on the ranks with the most calls, a tie included (3 ranks)",
                      1, _last_joiner)), timeout_s=10),
    ),
    hints=(
        "Reread lesson 03, section 8 'A Joinable of your own' (what Join calls, when, and on which ranks).",
        "torch.distributed.algorithms.join: Joinable, JoinHook.main_hook / post_hook(is_last_joiner), "
        "Join.notify_join_context(joinable); dist.all_reduce.",
        "A rank still iterating announces itself to the context manager before its own collective; a rank that "
        "has run out must take part in the same collective, once per iteration of the others, contributing "
        "nothing to the count but still adding what the others counted; at the end, remember what post_hook "
        "is told.",
    ),
)
