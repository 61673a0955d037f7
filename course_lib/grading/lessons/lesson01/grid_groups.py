"""01.grid_groups: the row and column process groups of a rows x cols grid, checked on 4 real ranks.

Judges: each rank's row group and column group hold the right ranks (2x2 and 1x4 grids), and an all_reduce
over each sums its members. They recognise rows and columns swapped, and two groups created under one
name (gloo would connect both sets of ranks as one group).
"""

from __future__ import annotations

from ...compare import each_result
from ...spec import Exercise, Item, RunOutcome, RunSpec

__all__ = ["GRID"]


def _grid_cases(nproc: int) -> list[dict[int, tuple]]:
    return [{rank: (rows, cols) for rank in range(nproc)} for rows, cols in ((2, 2), (1, 4))]


def _expected_members(kind: str, rank: int, rows: int, cols: int) -> list[int]:
    row, col = divmod(rank, cols)
    if kind == "row":
        return [row * cols + c for c in range(cols)]
    return [r * cols + col for r in range(rows)]


def _group_judge(kind: str):
    other = "col" if kind == "row" else "row"
    word = {"row": "row", "col": "column"}

    def judge(outcome: RunOutcome) -> list[str]:
        for case, rank, result in each_result(outcome):
            rows, cols = outcome.inputs[case][0]
            out = result.output
            where = f"rank {rank} of a {rows}x{cols} grid"
            if "not_a_pair" in out:
                return [f"{where}: returned a {out['not_a_pair']}, expected (row_group, col_group)"]
            if "error" in out[kind]:
                return [f"{where}: the {word[kind]} group is not usable here: {out[kind]['error']}"]
            expected = _expected_members(kind, rank, rows, cols)
            got = out[kind]["members"]
            if sorted(got) != expected:
                hint = ""
                if sorted(got) == _expected_members(other, rank, rows, cols):
                    hint = f": that is its {word[other]}; rank r sits at row r // cols, column r % cols"
                return [f"{where}: {word[kind]} group has ranks {got}, expected {expected}{hint}"]
        return []

    judge.__doc__ = f"Judge: each rank's {word[kind]} group holds exactly the ranks of its {word[kind]}."

    return judge


def _groups_work(outcome: RunOutcome) -> list[str]:
    """Judge: an all_reduce over each group sums its members' ranks; two groups never share a name."""
    for case, rank, result in each_result(outcome):
        rows, cols = outcome.inputs[case][0]
        where = f"rank {rank} of a {rows}x{cols} grid"
        for kind in ("row", "col"):
            part = result.output.get(kind, {})
            if "same_name" in part:
                other = part["same_name"]
                return [f"{where}: its {'row' if kind == 'row' else 'column'} group {part['members']} has the same "
                        f"name ({other['name']!r}) as the group {other['members']} that rank {other['rank']} created, "
                        "so gloo would connect the ranks of both as one group (a hang or a wrong sum, depending on "
                        "timing; the check did not use it). A plain new_group names each group by how many groups "
                        "this process has created so far (lesson 01, section 6)"]
            if "sum" not in part:
                return [f"{where}: no usable {kind} group to all_reduce over"]
            expected = sum(_expected_members(kind, rank, rows, cols))
            if part["sum"] != expected:
                return [f"{where}: all_reduce of the ranks over its {kind} group gave {part['sum']}, "
                        f"expected {expected}"]
    return []


GRID = Exercise(
    id="01.grid_groups",
    function="grid_groups",
    signature="grid_groups(rows: int, cols: int) -> tuple[ProcessGroup, ProcessGroup]",
    driver="process_groups",
    hints=(
        "Reread lesson 01, section 6 'Groups and sub-groups' (which ranks call new_group, and in which "
        "order) and 'A first look at DeviceMesh' (which ranks share a row, which a column).",
        "dist.new_group(ranks=[...]), plain or with use_local_synchronization=True, and dist.get_rank().",
        "List the members of every row (rank r is in row r // cols) and of every column (column r % cols). "
        "With a plain new_group, every rank creates every one of those groups, in the same order on every "
        "rank, members or not, and keeps the two it belongs to. With use_local_synchronization=True, a rank "
        "may create only its own row's group and then its own column's.",
    ),
    runs=(
        RunSpec(4, _grid_cases,
                (Item("row groups of a 2x2 and a 1x4 grid", 1, _group_judge("row")),
                 Item("column groups of a 2x2 and a 1x4 grid", 1, _group_judge("col")),
                 Item("each group works (all_reduce over it)", 1, _groups_work))),
    ),
)
