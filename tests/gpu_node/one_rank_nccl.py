"""Run on a GPU node: every multi-rank cell of a lesson at 1 rank under NCCL, and what each did.

    python tests/gpu_node/one_rank_nccl.py notebooks/02_ddp.ipynb [...]

With one GPU, NCCL runs one rank. Every `%%torchrun -n K` and `%dist start -n K` becomes
`-n 1 --backend nccl`; the notebook runs top to bottom in a fresh kernel (errors allowed), and one
line per multi-rank cell says whether it ran, or its error's first line. Cells written for
several ranks can fail at one for reasons of the lesson (a peer to send to); read those as such.
"""

import re
import sys

import nbformat
from nbclient import NotebookClient

MULTI = re.compile(r"^(%%torchrun|%dist start|%%dist)")
FAILED = re.compile(r"^.*(\w+(Error|Failure)\b|Traceback|exit code).*$", re.M)

for path in sys.argv[1:]:
    nb = nbformat.read(path, as_version=4)
    marked = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        source = re.sub(r"^(%%torchrun|%dist start)\s+-n\s+\d+", r"\1 -n 1 --backend nccl", cell.source, flags=re.M)
        source = source.replace("--expect-failure", "")
        cell.source = source
        cell.outputs, cell.execution_count = [], None  # a cell the run never reached shows "not run"
        if MULTI.match(source.lstrip()) or "%dist start" in source:
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
        errors = [o for o in cell.get("outputs", []) if o.output_type == "error"]
        text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream")
        first = text.strip().splitlines()[0][:120] if text.strip() else ""
        if cell.get("execution_count") is None:
            state = "not run"
        elif errors:
            state = f"ERROR {errors[0].ename}: {errors[0].evalue.splitlines()[0][:200] if errors[0].evalue else ''}"
        elif FAILED.search(text):
            state = "FAILED: " + FAILED.search(text).group(0)[:200]
        else:
            state = "ran"
        print(f"{path} cell {index}: {state} | {first}", flush=True)
