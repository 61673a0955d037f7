"""Run on a GPU node: every multi-rank cell of a lesson at 1 rank under NCCL, and what each did.

    python tests/gpu_node/one_rank_nccl.py [--backend nccl] [--cells K] [--json] notebooks/02_ddp.ipynb [...]

With one GPU, NCCL runs one rank. Every `%%torchrun -n K` and `%dist start -n K` becomes
`-n 1 --backend nccl`; the notebook runs top to bottom in a fresh kernel (errors allowed), and one
line per multi-rank cell says whether it ran, or its error's first line. Cells written for
several ranks can fail at one for reasons of the lesson (a peer to send to); read those as such.
`--backend gloo` is the CPU dry run (tests/gpu_node/steps.py); `--cells K` runs the first K code cells
only; `--json` prints each cell's line as `RESULT {json}` for run_steps.py's record.
"""

import argparse
import json
import re

import nbformat
from nbclient import NotebookClient

MULTI = re.compile(r"^(%%torchrun|%dist start|%%dist)")
FAILED = re.compile(r"^.*(\w+(Error|Failure)\b|Traceback|exit code).*$", re.M)


def one_rank(source: str, backend: str) -> str:
    source = re.sub(r"^(%%torchrun|%dist start)\s+-n\s+\d+", rf"\1 -n 1 --backend {backend}", source, flags=re.M)
    return source.replace("--expect-failure", "")


def state_of(cell) -> str:
    errors = [o for o in cell.get("outputs", []) if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream")
    if cell.get("execution_count") is None:
        return "not run"
    if errors:
        return f"ERROR {errors[0].ename}: {errors[0].evalue.splitlines()[0][:200] if errors[0].evalue else ''}"
    if FAILED.search(text):
        return "FAILED: " + FAILED.search(text).group(0)[:200]
    return "ran"


def run(path: str, backend: str, cells: int | None, as_json: bool) -> None:
    nb = nbformat.read(path, as_version=4)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    if cells is not None:  # keep the markdown, drop the code cells after the first `cells`
        nb.cells = [c for i, c in enumerate(nb.cells) if c.cell_type != "code" or i in code[:cells]]
    marked = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        cell.source = one_rank(cell.source, backend)
        cell.outputs, cell.execution_count = [], None  # a cell the run never reached shows "not run"
        if MULTI.match(cell.source.lstrip()) or "%dist start" in cell.source:
            marked.append(index)
    client = NotebookClient(nb, timeout=45, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": "notebooks"}})
    try:
        client.execute()
    except Exception as error:  # noqa: BLE001 - a cell that outlived its timeout ends the notebook: say so
        ran = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.get("execution_count")]
        print(f"{path}: stopped after cell {ran[-1] if ran else None}: {type(error).__name__}: {str(error)[:200]!r}")
    for index in marked:
        cell = nb.cells[index]
        state = state_of(cell)
        text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream")
        first = text.strip().splitlines()[0][:120] if text.strip() else ""
        if as_json:
            print("RESULT " + json.dumps({"cell": index, "state": state, "first_line": first}), flush=True)
        else:
            print(f"{path} cell {index}: {state} | {first}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+")
    parser.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    parser.add_argument("--cells", type=int, default=None, help="run only the first K code cells")
    parser.add_argument("--json", action="store_true", help="one RESULT {json} line per multi-rank cell")
    args = parser.parse_args()
    for notebook in args.notebooks:
        run(notebook, args.backend, args.cells, args.json)
