"""The README's "What has run on a GPU" table, made from tests/gpu_node/record.json.

    python tests/gpu_node/record_table.py            # print the table
    python tests/gpu_node/record_table.py --write    # put it into README.md between its markers
    python tests/gpu_node/record_table.py --add OUT/record_entry.json   # a GPU run's entry: record + README

tests/test_gpu_node_script.py fails when the README's table is not what this prints. An entry written by
run_steps.py has counts per notebook; the first entry (2026-11-25, before the record existed) has the
words of that day's README under `seen` instead.
"""

from __future__ import annotations

import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
RECORD = HERE / "record.json"
README = HERE.parents[1] / "README.md"
START, END = "<!-- gpu-record:start -->", "<!-- gpu-record:end -->"
HEADER = ["| when, machine | what ran | what was seen |", "|---|---|---|"]
WHAT_RAN = {
    "nbval": "every lesson notebook under nbval, `--nbval-lax` (cells of 2 or more ranks on gloo: one GPU)",
    "one_rank": "every multi-rank cell at 1 rank under NCCL (`one_rank_nccl.py`)",
    "nbval_shared_gpu": "every lesson under nbval with its ranks sharing the GPU: gloo moving CUDA tensors "
                        "(`COURSE_GLOO_ON_SHARED_GPU=1`)",
}


def machine(entry: dict) -> str:
    return (f"{entry['date']}, {entry['gpu']}; torch {entry['torch']}, CUDA {entry['cuda']}, NCCL {entry['nccl']}, "
            f"Python {entry['python']}")


def seen_per_notebook(entry: dict, kind: str) -> str:
    """'N of M cells ran in K notebooks' and each failure as 'notebook cell C: cause'."""
    runs = {name: parts[kind] for name, parts in entry["notebooks"].items() if kind in parts}
    total = sum(r["cells_run"] for r in runs.values())
    failed = [f"{name} cell {f['cell']}: {f['cause']}" for name, r in runs.items() for f in r["failures"]]
    late = [name for name, r in runs.items() if r.get("timed_out")]
    text = f"{total} cells ran in {len(runs)} notebooks, {len(failed)} failed"
    if late:
        text += f"; stopped at the step's time limit: {', '.join(late)}"
    return text + ("" if not failed else ": " + "; ".join(failed))


def rows(entry: dict) -> list[str]:
    if "seen" in entry:  # the entry from before the record: what that day's README said
        return [f"| {machine(entry) if i == 0 else 'same'} | {what} | {seen} |" for i, (what, seen) in
                enumerate(entry["seen"])]
    lines = [(WHAT_RAN[kind], seen_per_notebook(entry, kind)) for kind in WHAT_RAN
             if any(kind in parts for parts in entry["notebooks"].values())]
    for name, step in entry["steps"].items():
        ended = "timed out" if step["timed_out"] else f"exit {step['rc']}"
        lines.append((f"`{name}`", f"{ended} in {step['seconds']} s: {step['last_line']}"))
    return [f"| {machine(entry) if i == 0 else 'same'} | {what} | {seen} |" for i, (what, seen) in enumerate(lines)]


def table(record: list[dict]) -> str:
    return "\n".join([*HEADER, *(row for entry in record for row in rows(entry))])


def readme_with(readme: str, record: list[dict]) -> str:
    before, rest = readme.split(START, 1)
    _, after = rest.split(END, 1)
    return f"{before}{START}\n{table(record)}\n{END}{after}"


if __name__ == "__main__":
    record = json.loads(RECORD.read_text())
    if sys.argv[1:2] == ["--add"]:
        entry = json.loads(pathlib.Path(sys.argv[2]).read_text())
        if entry.get("dry_run"):
            sys.exit("record_table: a dry run's entry stays out of the record (it ran on no GPU)")
        record.append(entry)
        RECORD.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    if sys.argv[1:2] in (["--write"], ["--add"]):
        README.write_text(readme_with(README.read_text(), record))
    else:
        print(table(record))
