"""Run a `%%torchrun` cell as a rank's main program, so that the processes it spawns do not run it again.

    torchrun --standalone --nproc-per-node 2 -m course_lib.rank.cell_runner /tmp/course_lib_xyz/cell.py

`run_torchrun` starts every rank this way. The runner installs the cell hook
(collective ledger, stack dumps: cell_hook.py), then runs the cell's file as
the program: in a fresh `__main__` module, `__file__` the cell's file,
tracebacks naming the cell's file and lines (the launcher shows it as
`<cell>`). As for `python -m`, the working directory comes first on `sys.path`.

Why not let torchrun run the cell's file itself: a cell has no
`if __name__ == "__main__":` guard, and a process started with the spawn
method (`torch.multiprocessing.spawn`, a DataLoader with
`multiprocessing_context="spawn"`, DCP's `async_save` in process mode) first
imports its parent's main program again, as `__mp_main__`, to find the
functions and classes it is sent. It would run the whole cell again: its
`init_process_group`, its collectives, its prints, its own `mp.spawn` (which
then fails, or the rank hangs). Here the main program is this module, and
multiprocessing imports a `-m` program again by its module name: a spawned
child imports this module as `__mp_main__`, which runs only the cell's
definitions, read from the file named by `ENV_CELL_FILE`.

When the cell ends, the rank ends as Python would (threads joined, atexit functions run, output
flushed, the same exit status and traceback) but without the interpreter's finalization, where a
gloo worker thread can abort a rank that has finished its work (process_exit.py).

What a spawned child sees of the cell, in the cell's order:

- its top-level `import` and `from ... import` statements;
- its top-level `def`, `async def` and `class` statements (their decorators
  and default values are evaluated, as they would be in any import);
- top-level assignments of a literal to names: `STEPS = 10`,
  `SIZES = (2, 4)`, `LR = 3e-4 * 2`, `NAME: str = "gpt"`.

Nothing else runs: no call (`init_process_group`, `mp.spawn`, `print`), no
assignment computed from a call or a name (`model = nn.Linear(4, 4)`,
`world = dist.get_world_size()`), nothing nested in `if`, `for`, `with` or
`try`. So a function run by a child finds the cell's imports, functions,
classes and literal constants; pass it anything else as an argument:
`mp.spawn(worker, args=(state_dict,), nprocs=2)`.
"""

from __future__ import annotations

import ast
import builtins
import os
import sys
import types

from .contract import CELL_HOOK_MODULE, ENV_CELL_FILE
from .process_exit import exit_status, exit_without_finalizing

__all__ = ["definitions", "main"]


def _is_literal(node: ast.expr) -> bool:
    """A constant, or containers of and arithmetic on constants: nothing to look up, nothing to call."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return all(_is_literal(item) for item in node.elts)
    if isinstance(node, ast.Dict):
        return all(key is not None and _is_literal(key) and _is_literal(value)
                   for key, value in zip(node.keys, node.values))
    if isinstance(node, ast.UnaryOp):
        return _is_literal(node.operand)
    if isinstance(node, ast.BinOp):
        return _is_literal(node.left) and _is_literal(node.right)
    return False


def _is_names(target: ast.expr) -> bool:
    """`x` or `x, y`: an assignment to an attribute or an item (`os.environ["X"] = ...`) changes something else."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return all(_is_names(item) for item in target.elts)
    return isinstance(target, ast.Name)


def _is_definition(statement: ast.stmt) -> bool:
    if isinstance(statement, ast.Import):
        # Line 1 of the launcher's script imports the hook: it instruments the rank, not its children
        # (which would write the rank's ledger and stacks files).
        return all(alias.name != CELL_HOOK_MODULE for alias in statement.names)
    if isinstance(statement, (ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return True
    if isinstance(statement, ast.Assign):
        return all(_is_names(target) for target in statement.targets) and _is_literal(statement.value)
    if isinstance(statement, ast.AnnAssign):
        return isinstance(statement.target, ast.Name) and statement.value is not None and _is_literal(statement.value)
    return False


def definitions(source: str, filename: str = "<cell>") -> ast.Module:
    """The part of a cell a spawned child runs: its top-level imports, defs, classes and literal assignments.

    Statements keep their line numbers, so a child's traceback names the cell's lines.
    """
    tree = ast.parse(source, filename)
    tree.body = [statement for statement in tree.body if _is_definition(statement)]
    return tree


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as file:
        return file.read()


def _new_main(path: str) -> types.ModuleType:
    """An empty `__main__` module for the cell, in place of this one."""
    module = types.ModuleType("__main__")
    module.__file__ = path
    # What multiprocessing reads to start a spawned child's main program: this module, by name.
    module.__spec__ = __spec__
    module.__builtins__ = builtins
    # `__mp_main__` too: multiprocessing's alias of the main module, where a child's pickled
    # objects (from the child's own `__mp_main__`) are looked up in this process.
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module
    return module


def _without_runner_frames(previous):
    """sys.excepthook that prints a traceback from the cell's first frame, as if the cell were the program."""
    ours = {__file__, "<frozen runpy>"}

    def excepthook(kind, value, tb):
        while tb is not None and tb.tb_frame.f_code.co_filename in ours:
            tb = tb.tb_next
        if isinstance(value, BaseException):
            value.with_traceback(tb)  # the default hook prints the exception's own traceback
        previous(kind, value, tb)

    return excepthook


def main(argv: list[str]) -> None:
    """Run the cell file `argv[0]` as this process's `__main__` program (`argv[1:]`: its arguments)."""
    from . import cell_hook  # noqa: F401 - installs itself on import

    path = argv[0]
    sys.excepthook = _without_runner_frames(sys.excepthook)
    os.environ[ENV_CELL_FILE] = path  # inherited by every process the cell starts
    # dont_inherit: the cell's own `from __future__` lines count, not this module's.
    code = compile(_read(path), path, "exec", dont_inherit=True)
    module = _new_main(path)
    sys.argv = [path, *argv[1:]]
    try:
        exec(code, module.__dict__)
    except SystemExit as exc:
        exit_without_finalizing(exit_status(exc))
    except KeyboardInterrupt:
        raise  # Python's own way out: the rank ends by SIGINT, as torchrun expects of an interrupted program
    except BaseException as exc:  # noqa: BLE001 - printed as Python prints an uncaught exception, exit status 1
        sys.excepthook(type(exc), exc, exc.__traceback__)
        exit_without_finalizing(1)
    # Not a return into the interpreter's finalization, where a torch thread can abort the rank (process_exit.py).
    exit_without_finalizing(0)


def _define_cell(namespace: dict) -> None:
    """In a spawned child: run the cell's `definitions` and put what they define into `namespace`."""
    path = os.environ.get(ENV_CELL_FILE)
    if path is None:  # imported as __mp_main__, but not below a cell run by `main`
        return
    cell = {"__name__": namespace["__name__"], "__file__": path, "__builtins__": builtins}
    exec(compile(definitions(_read(path), path), path, "exec", dont_inherit=True), cell)
    # multiprocessing copies this module's globals into the child's `__main__`, where the
    # pickled references (`__main__.worker`) are looked up.
    namespace.update(cell)


if __name__ == "__main__":
    main(sys.argv[1:])
elif __name__ == "__mp_main__":
    _define_cell(globals())
