"""A class on one machine: launch/hub's JupyterHub, run for real with three learners at once.

The hub (JupyterHub from PyPI, configurable-http-proxy from npm) starts on 127.0.0.1; three learners
sign in with the shared password and get a server each, as their own Unix user. In the three kernels
at the same time: a 2-rank `%%torchrun` cell and a `%%dist` cell on persistent ranks, each printing
values only that learner's ranks can compute. Each learner must see their own ranks, as their own
user, on their own port and temporary folder; then a rank over the memory limit gets the course's
one-line error; stopping a server must leave none of the learner's processes, and the hub stops clean.

Needs root (a Unix user per learner) and the proxy (`make install` puts it in the venv with npm):
elsewhere it skips saying which; in CI (CI=true) it fails instead.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import pwd
import shutil
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "launch" / "hub"))

pytestmark = pytest.mark.slow

LEARNERS = {"hubtest-a": 1, "hubtest-b": 2, "hubtest-c": 3}  # name -> a number only their cells use
PASSWORD = "a-closed-room"
MEM_LIMIT_GIB = 2


def _missing() -> str | None:
    try:
        import jupyterhub  # noqa: F401
        import jupyterhub_idle_culler  # noqa: F401
    except ImportError as exc:
        return f"{exc.name} is not installed (pip install -e '.[test]')"
    from hub_client import proxy_command
    if os.geteuid() != 0:
        return "needs root: the hub creates a Unix user per learner"
    if shutil.which("useradd") is None:
        return "no useradd on this machine"
    if proxy_command() is None:
        return "no configurable-http-proxy: `make install` installs it with npm into the venv"
    return None


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    why = _missing()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the JupyterHub test, but: {why}")
        pytest.skip(why)
    from hub_client import Hub, Traversable, blocked_dirs, course_paths, remove_user

    for name in LEARNERS:
        remove_user(name)  # a user left by an earlier, interrupted run
    hub = Hub(tmp_path_factory.mktemp("hub"), PASSWORD, mem_limit=f"{MEM_LIMIT_GIB}G")
    # The learners' servers run the venv's Python; where it lies under a private home (pyenv in /root),
    # the folders above it get o+x for the test (taken back after).
    with Traversable(blocked_dirs(course_paths())):
        try:
            hub.start()
            yield hub
        finally:
            hub.stop()
            for name in LEARNERS:
                remove_user(name)


TORCHRUN_CELL = """%%torchrun -n 2
import getpass, os, stat, torch, torch.distributed as dist
import course_lib as cl
info = cl.init()
t = torch.tensor([{k} * 10.0 + info.rank])
dist.all_reduce(t)
folder = os.environ["COURSE_RESULTS_DIR"]
run_dir = os.stat(os.path.dirname(folder))  # the launch's own folder (mkdtemp): this user's, 0700
mine = run_dir.st_uid == os.getuid() and stat.S_IMODE(run_dir.st_mode) == 0o700
print(f"user={{getpass.getuser()}} port={{os.environ['MASTER_PORT']}} folder={{folder}} private={{mine}} sum={{t.item():g}}")
cl.publish("t", t)
dist.destroy_process_group()
"""

DIST_CELL = """%%dist
import getpass, torch, torch.distributed as dist
x = torch.tensor([{k} * 100.0]) * (dist.get_rank() + 1)
dist.all_reduce(x)
print(f"user={{getpass.getuser()}} sum={{x.item():g}}")
"""


TOO_BIG = f"torch.empty({MEM_LIMIT_GIB + 1} << 30, dtype=torch.uint8)"  # over the per-process limit


async def _learner(hub, name: str, k: int) -> dict:
    """One learner's session: (stdout, stderr, error) of each cell, by a short name."""
    kernel = hub.new_kernel(name)
    seen = {}
    try:
        for cell in ("%load_ext course_lib", "%dist start -n 2"):
            seen[cell] = await kernel.run(cell)
        seen["torchrun"] = await kernel.run(TORCHRUN_CELL.format(k=k))
        seen["results"] = await kernel.run(
            "import course_lib as cl; print(sorted((r, v.item()) for r, v in cl.results['t'].items()))")
        seen["dist"] = await kernel.run(DIST_CELL.format(k=k))
        if k == 1:  # this learner's rank asks for more memory than the limit, while the others run
            seen["rank too big"] = await kernel.run(f"%%torchrun -n 1\nimport torch\nx = {TOO_BIG}\nprint('allocated')")
        if k == 2:  # and this one's kernel does
            seen["kernel too big"] = await kernel.run(f"import torch\nx = {TOO_BIG}")
            seen["kernel after"] = await kernel.run("print('still here')")
    finally:
        await kernel.close()
    return seen


def test_three_learners_at_once(hub):
    from hub_client import LEFT_BEHIND, rank_lines
    from course_lib.launcher.processes import processes_of_uid

    assert not hub.sign_in("hubtest-a", "not-the-password"), "a wrong password signed a learner in"
    for name in LEARNERS:
        assert hub.sign_in(name), f"{name} could not sign in with the shared password:\n{hub.log()[-3000:]}"
        hub.start_server(name)
    for name in LEARNERS:
        hub.wait_ready(name)
        user = pwd.getpwnam(name)  # each learner's own copy of the lessons, theirs to change
        lesson = pathlib.Path(user.pw_dir, "course", "notebooks", "00_setup.ipynb")
        assert lesson.exists() and lesson.stat().st_uid == user.pw_uid, f"{name} has no own copy of the course"

    async def everyone():
        return await asyncio.gather(*(_learner(hub, name, k) for name, k in LEARNERS.items()))

    sessions = dict(zip(LEARNERS, asyncio.run(everyone())))
    ports, folders = {}, {}
    for name, k in LEARNERS.items():
        seen = sessions[name]
        limit_cells = {cell: seen.pop(cell) for cell in ("rank too big", "kernel too big") if cell in seen}
        for cell, (out, err, error) in seen.items():
            assert error is None, f"{name}, {cell!r}: {error}\n{out}\n{err}"
        # %%torchrun: both ranks, as this learner, the learner's own sum (10k + 10k+1), a private folder
        ranks = rank_lines(seen["torchrun"][0])
        assert sorted(ranks) == [0, 1] and all(len(lines) == 1 for lines in ranks.values()), seen["torchrun"]
        fields = {r: dict(item.split("=", 1) for item in lines[0].split()) for r, lines in ranks.items()}
        for fields_r in fields.values():
            assert fields_r["user"] == name and fields_r["sum"] == f"{20 * k + 1:g}", seen["torchrun"]
            assert fields_r["private"] == "True", seen["torchrun"]
        assert fields[0]["port"] == fields[1]["port"] and fields[0]["folder"] == fields[1]["folder"]
        ports[name], folders[name] = fields[0]["port"], fields[0]["folder"]
        assert seen["results"][0].strip() == f"[(0, {20 * k + 1:.1f}), (1, {20 * k + 1:.1f})]", seen["results"]
        # %%dist: persistent ranks of this learner, 100k * (1 + 2)
        dist = rank_lines(seen["dist"][0])
        assert dist == {0: [f"user={name} sum={300 * k:g}"], 1: [f"user={name} sum={300 * k:g}"]}, seen["dist"]
        # Over the memory limit: a rank's failure is the course's one line (RankFailure); the kernel's own
        # allocation fails with torch's error and the kernel lives on.
        if "rank too big" in limit_cells:
            out, err, error = limit_cells["rank too big"]
            assert error is not None and error["ename"] == "RankFailure", (out, err, error)
            assert "can't allocate memory" in error["evalue"] and "\n" not in error["evalue"], error
            assert "allocated" not in out
        if "kernel too big" in limit_cells:
            out, err, error = limit_cells["kernel too big"]
            assert error is not None and "can't allocate memory" in error["evalue"], (out, err, error)
            assert seen["kernel after"][0] == "still here\n"
    assert len(set(ports.values())) == len(LEARNERS), f"two learners' ranks shared a port: {ports}"
    assert len(set(folders.values())) == len(LEARNERS), f"two learners' ranks shared a folder: {folders}"

    # Stopping a server ends every process of that learner, without the spawner's sweep having to.
    for name in LEARNERS:
        hub.api("DELETE", f"/users/{name}/server")
    for name in LEARNERS:
        hub.stop_server(name)  # waits until the hub says it is stopped
        left = processes_of_uid(pwd.getpwnam(name).pw_uid)
        assert not left, f"{name}'s processes outlived their server: {[p.cmdline() for p in left]}"
    swept = [line for line in hub.log().splitlines() if LEFT_BEHIND in line]
    assert not swept, "the course left processes behind when a server stopped:\n" + "\n".join(swept)

    # The hub stops clean: exit 0, its proxy and idle culler gone.
    children = hub.children()
    assert any("jupyterhub_idle_culler" in " ".join(p.cmdline()) for p in children), "no idle culler running"
    assert hub.stop() == 0, hub.log()[-3000:]
    alive = [p for p in children if p.is_running() and p.status() != "zombie"]
    assert not alive, f"left running after the hub stopped: {[p.cmdline() for p in alive]}"
