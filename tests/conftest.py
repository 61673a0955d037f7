"""Shared by every test under tests/; and, when the notebooks are collected with tests/ (`make test`), one
more item after each lesson notebook: its reveals run again after Run All (tests/reveals_after_run_all.py)."""

import pytest
from reveals_after_run_all import add_reveal_items

from course_lib.rank.rehearsal import ENV_REHEARSE


def pytest_collection_modifyitems(items):
    add_reveal_items(items)


@pytest.fixture(autouse=True, scope="module")
def _engine_tests_run_unrehearsed():
    """`make test` rehearses a GPU node in every rank it starts (COURSE_REHEARSE_GPU_NODE=1) so that the
    lessons' cells are checked; the engine's own test scripts keep their tensors on the CPU on purpose
    (they test launching, ledgers, deadlines), so tests/ runs them unrehearsed, from before a module's
    first fixture (a kernel started for the module inherits the environment) to after its last.
    test_gpu_node_rehearsal.py turns it back on for its cells."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(ENV_REHEARSE, raising=False)
        yield
