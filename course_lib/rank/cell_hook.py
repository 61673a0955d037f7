"""Imported before every `%%torchrun` cell runs: instrument the rank without `cl.init()`.

A cell may start its process group with `dist.init_process_group(...)` and
never import course_lib. Its collectives should still reach the ledger, and a
stuck rank should still show its stack. So the cell runner (cell_runner.py)
imports this module before it runs the cell, and the launcher writes the
script as

    import course_lib.rank.cell_hook  # %%torchrun -n 2      <- line 1, as in the cell
    <the cell>

(a script plain torchrun can run too). This module (1) registers the
SIGUSR1 stack dump at once, and (2) wraps the collectives the moment
`torch.distributed.distributed_c10d` finishes loading, before
`torch.distributed` copies their names (`from .distributed_c10d import *`),
and arranges for the default process group to be destroyed at exit if the
cell leaves it open. Importing torch here instead would cost a cell that
never uses torch a second; waiting for the import costs nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Callable

from . import destroy_process_group_at_exit, dump_stacks_on_signal, mark_ready_after_init, record_collectives
from .rehearsal import install_after_init

C10D = "torch.distributed.distributed_c10d"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then()` right after the module `name` executes; removes itself from sys.meta_path."""

    def __init__(self, name: str, then: Callable[[], None]):
        self.name = name
        self.then = then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # not a plain source/bytecode module: leave it alone, record nothing
        loader, then = spec.loader, self.then
        run_module = loader.exec_module

        def exec_module(module):
            run_module(module)
            try:
                then()
            except Exception as exc:  # noqa: BLE001 - the learner's import of torch must not fail because of us
                print(f"course_lib: collective ledger off for this rank: {exc!r}", file=sys.stderr)

        loader.exec_module = exec_module  # this loader instance serves only this spec
        return spec


def _on_distributed_loaded() -> None:
    record_collectives()
    install_after_init()  # the GPU-node rehearsal, when the test suite asks for it (rehearsal.py)
    mark_ready_after_init()  # the launcher's deadline starts when every rank's group is up
    destroy_process_group_at_exit()  # a cell that forgets destroy_process_group() still ends cleanly


def install() -> None:
    """Stack dumps now; the ledger and the exit-time destroy when torch.distributed loads (or now, if it has)."""
    dump_stacks_on_signal()
    if C10D in sys.modules:
        _on_distributed_loaded()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(C10D, _on_distributed_loaded))


install()
