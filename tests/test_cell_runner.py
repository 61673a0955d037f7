"""course_lib.rank.cell_runner: a `%%torchrun` cell that spawns processes runs once per rank.

A cell has no `if __name__ == "__main__":` guard; a process started with the
spawn method imports its parent's main program again. Run as the program
itself, the cell would run again in every child (issue 12). The runner makes
children see only the cell's definitions: first which statements those are
(no process), then a real 2-rank launch whose cell calls
`torch.multiprocessing.spawn`.
"""

import ast
import importlib.util
import textwrap

import pytest

from course_lib.rank import cell_runner
from course_lib.rank.cell_runner import definitions
from course_lib.rank.contract import CELL_RUNNER_MODULE
from proc_helpers import launch, no_new_children

# Each statement a spawned child runs ends with "# kept"; every other one must not run there.
CELL = '''\
import course_lib.rank.cell_hook  # %%torchrun -n 2 (the launcher's line 1: instruments the rank only)
"""What the cell does."""
import os, torch  # kept
from torch import nn  # kept
import torch.multiprocessing as mp  # kept
STEPS = 10  # kept
SIZES, NAME = (2, 4), "gpt"  # kept
LR: float = 3e-4 * 2  # kept
TABLE = {"a": [1, -2.5], "b": None, "c": {1, 2}}  # kept
world = dist.get_world_size()
model = nn.Linear(4, 4)
ALIAS = STEPS
DTYPE = torch.float32
os.environ["X"] = "1"
model.lr = 0.1
count: int
count += 1
print("hello")
dist.init_process_group("gloo")
mp.spawn(worker, nprocs=2)
@torch.no_grad()
def worker(i, sizes=SIZES):  # kept
    return i
async def fetch():  # kept
    pass
class Config:  # kept
    lr = 0.1
if __name__ == "__main__":
    def hidden():
        pass
try:
    import numpy
except ImportError:
    numpy = None
for step in range(STEPS):
    pass
with open("x") as file:
    pass
'''


def test_definitions_keep_imports_defs_classes_and_literal_assignments_only():
    expected = [n for n, line in enumerate(CELL.splitlines(), 1) if line.endswith("# kept")]
    kept = definitions(CELL).body
    assert [statement.lineno for statement in kept] == expected  # in order, at the cell's line numbers
    worker = kept[-3]
    assert isinstance(worker, ast.FunctionDef) and [ast.unparse(d) for d in worker.decorator_list] == ["torch.no_grad()"]


def test_definitions_keep_a_future_import_first():
    source = "# %%torchrun -n 2\nfrom __future__ import annotations\nimport dataclasses\nprint(1)\n"
    tree = definitions(source)
    assert ast.unparse(tree) == "from __future__ import annotations\nimport dataclasses"
    compile(tree, "<cell>", "exec", dont_inherit=True)  # still a valid module: the future import comes first


def test_definitions_of_nothing_to_keep_is_an_empty_module():
    assert definitions("print('a')\nx = f()\n").body == []


def test_the_runner_module_named_in_the_contract_is_this_one():
    # torchrun finds it by this name (`-m`), and so does multiprocessing in a spawned child.
    assert importlib.util.find_spec(CELL_RUNNER_MODULE).origin == cell_runner.__file__


# ---------------------------------------------------------------- a real launch


SPAWN_CELL = """\
import os
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import course_lib as cl

OUT_DIR = {out_dir!r}
SCALE = 10


class Job:
    def __init__(self, rank):
        self.rank = rank


def work(i, job):
    # In a spawned child: os, SCALE and Job come from the cell's definitions, job from the parent.
    with open(os.path.join(OUT_DIR, f"{{job.rank}}.{{i}}"), "w") as file:
        file.write(str(SCALE * (job.rank + 1) + i))


print(f"cell starts as {{__name__}}", flush=True)
dist.init_process_group("gloo")
rank = dist.get_rank()
mp.spawn(work, args=(Job(rank),), nprocs=2)
mine = sorted(int(open(os.path.join(OUT_DIR, f"{{rank}}.{{i}}")).read()) for i in range(2))
total = torch.tensor([float(sum(mine))])
dist.all_reduce(total)
cl.publish("mine", mine)
cl.publish("total", total.item())
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def spawn_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("spawned")
    with no_new_children():
        run = launch(SPAWN_CELL.format(out_dir=str(out_dir)), 2, timeout_s=120)
    return run, out_dir


def test_a_cell_that_calls_mp_spawn_finishes_with_its_childrens_results(spawn_run):
    run, out_dir = spawn_run
    result = run.result
    assert result.ok, (result.stderr, result.agent_output)
    assert sorted(p.name for p in out_dir.iterdir()) == ["0.0", "0.1", "1.0", "1.1"]
    assert result.results["mine"] == {0: [10, 11], 1: [20, 21]}
    assert result.results["total"] == {0: 62.0, 1: 62.0}  # the all_reduce after mp.spawn: every rank got there
    assert run.leftovers == []


def test_the_cell_runs_once_per_rank_as_main(spawn_run):
    # Had a child run the cell again, its print would be in the rank's output too (children share it).
    result = spawn_run[0].result
    assert result.stdout == {0: "cell starts as __main__\n", 1: "cell starts as __main__\n"}
    assert result.stderr == {0: "", 1: ""}
    assert [e["op"] for e in result.ledgers[0]] == ["all_reduce"]  # the children recorded nothing here


def test_a_spawned_childs_error_names_the_cell_line():
    # The child runs the cell's definitions compiled at the cell's own line numbers.
    cell = textwrap.dedent("""\
        import torch.multiprocessing as mp

        def work(i):
            raise ValueError(f"child {i} gives up")

        mp.spawn(work, nprocs=1)
        """)
    with no_new_children():
        run = launch(cell, 1, timeout_s=90)
    err = run.result.stderr[0]
    assert not run.result.ok
    assert 'File "<cell>", line 5, in work' in err  # line 4 of the script, below the launcher's line 1
    assert "ValueError: child 0 gives up" in err
    assert run.leftovers == []
