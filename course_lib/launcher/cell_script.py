"""Write a notebook's `%%torchrun` cell out as a script that plain torchrun runs unchanged.

    python -m course_lib.launcher.cell_script notebooks/05_fsdp2.ipynb            # list its cells
    python -m course_lib.launcher.cell_script notebooks/05_fsdp2.ipynb --cell 3 -o fsdp2.py
    NPROC=2 bash launch/local.sh fsdp2.py

A `%%torchrun` cell is already a complete script: `run_torchrun` writes its body
to a file and torchrun runs that file on every rank. This command writes the
same body to a file of your choosing, with a header that says where it came
from and the command that runs it (the cell's `-n` ranks). `cl.publish` does
nothing outside a notebook; everything else runs as in the cell.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shlex
import sys

__all__ = ["TorchrunCell", "main", "script_of", "torchrun_cells"]

MAGIC = "%%torchrun"


@dataclasses.dataclass(frozen=True)
class TorchrunCell:
    number: int  # 1-based among the notebook's %%torchrun cells
    index: int  # 0-based among all its cells
    options: str  # what follows %%torchrun on the magic line
    body: str  # the script: the cell without its magic line
    section: str  # the last markdown heading above the cell

    @property
    def nproc(self) -> int:
        words = shlex.split(self.options)
        for i, word in enumerate(words):
            if word in ("-n", "--nproc", "--nproc-per-node") and i + 1 < len(words):
                return int(words[i + 1])
            if word.startswith(("--nproc=", "--nproc-per-node=")):
                return int(word.split("=", 1)[1])
        return 2  # the magic's default

    @property
    def max_restarts(self) -> int:
        """The cell's `--max-restarts K` (torchrun's own option), 0 without it."""
        words = shlex.split(self.options)
        for i, word in enumerate(words):
            if word == "--max-restarts" and i + 1 < len(words):
                return int(words[i + 1])
            if word.startswith("--max-restarts="):
                return int(word.split("=", 1)[1])
        return 0

    @property
    def expects_failure(self) -> bool:
        return "--expect-failure" in shlex.split(self.options)


def torchrun_cells(notebook: pathlib.Path) -> list[TorchrunCell]:
    """The notebook's `%%torchrun` cells, in order."""
    cells = json.loads(pathlib.Path(notebook).read_text())["cells"]
    found, section = [], ""
    for index, cell in enumerate(cells):
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] == "markdown":
            headings = [ln.lstrip("#").strip() for ln in source.splitlines() if ln.startswith("#")]
            section = headings[-1] if headings else section
        if cell["cell_type"] != "code" or not source.startswith(MAGIC):
            continue
        first, _, body = source.partition("\n")
        found.append(TorchrunCell(len(found) + 1, index, first[len(MAGIC):].strip(), body, section))
    return found


def script_of(notebook: pathlib.Path, cell: TorchrunCell, output: pathlib.Path) -> str:
    """The script's text: a header (origin, the command that runs it), then the cell's body."""
    restarts = cell.max_restarts
    header = [
        f"# {MAGIC} cell {cell.number} of {pathlib.Path(notebook).name} (notebook cell {cell.index + 1}), "
        f"written out by `python -m course_lib.launcher.cell_script`.",
        f"# Run: {run_command(cell, output)}",
        f"#  or: torchrun --standalone --nproc-per-node {cell.nproc}"
        f"{f' --max-restarts={restarts}' if restarts else ''} {output}",
    ]
    if cell.expects_failure:
        header.append("# NOTE: the lesson runs this cell with --expect-failure: it is meant to fail.")
    return "\n".join(header) + "\n" + cell.body.rstrip("\n") + "\n"


def run_command(cell: TorchrunCell, script: pathlib.Path) -> str:
    """How launch/local.sh runs the written script, with the cell's rank count and restarts."""
    restarts = f"MAX_RESTARTS={cell.max_restarts} " if cell.max_restarts else ""
    return f"{restarts}NPROC={cell.nproc} bash launch/local.sh {script}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.launcher.cell_script",
                                     description="Write a %%torchrun cell out as a script for launch/local.sh.")
    parser.add_argument("notebook", type=pathlib.Path)
    parser.add_argument("--cell", type=int, metavar="N", help="which %%torchrun cell (1 = the first); "
                        "without it, list them")
    parser.add_argument("-o", "--output", type=pathlib.Path, help="the script to write (default: print it)")
    args = parser.parse_args(argv)
    if not args.notebook.is_file():
        print(f"cell_script: no notebook {args.notebook}", file=sys.stderr)
        return 2
    cells = torchrun_cells(args.notebook)
    if not cells:
        print(f"cell_script: {args.notebook} has no {MAGIC} cell", file=sys.stderr)
        return 2
    if args.cell is None:
        for cell in cells:
            print(f"{cell.number:>3}  {MAGIC} {cell.options:<32} {cell.section[:60]}")
        print(f"write one out: python -m course_lib.launcher.cell_script {args.notebook} --cell N -o script.py")
        return 0
    if not 1 <= args.cell <= len(cells):
        print(f"cell_script: --cell {args.cell}: {args.notebook} has {MAGIC} cells 1 to {len(cells)}",
              file=sys.stderr)
        return 2
    cell = cells[args.cell - 1]
    if args.output is None:
        sys.stdout.write(script_of(args.notebook, cell, pathlib.Path("script.py")))
        return 0
    args.output.write_text(script_of(args.notebook, cell, args.output))
    print(f"wrote {args.output}; run it: {run_command(cell, args.output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
