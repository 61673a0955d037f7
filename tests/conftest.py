"""Shared by every test under tests/ (not by the notebooks nbval runs from notebooks/, solutions/, exercises/)."""

import pytest

from course_lib.rank.rehearsal import ENV_REHEARSE


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
