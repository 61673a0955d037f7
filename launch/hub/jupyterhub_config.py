# JupyterHub for a workshop on one machine: the course installed once, one server per learner.
#
#   sudo COURSE_HUB_PASSWORD='a-room-password' .venv/bin/jupyterhub -f launch/hub/jupyterhub_config.py
#
# Run it as root, from the folder where the hub keeps its state (its database, cookie secret and proxy
# pid file), with the course's venv (`make install`: JupyterHub, the idle culler and the proxy from npm).
# What it sets up (keys checked in jupyterhub 6.1's source):
# - Sign-in: a shared password (SharedPasswordAuthenticator, jupyterhub >= 5.3). It is for a CLOSED ROOM:
#   anyone with the password can sign in under any learner name, and plain http carries it in clear.
# - One local Unix user per learner, created at first sign-in (LocalAuthenticator.create_system_users,
#   needs root); each learner's server, kernel and ranks run as that user (LocalProcessSpawner).
# - Limits: each process of a learner may allocate at most COURSE_HUB_MEM_LIMIT (RLIMIT_DATA, as the
#   grader's ranks), the learner's processes and threads together at most COURSE_HUB_TASKS (RLIMIT_NPROC,
#   counted per user). CPU is not limited here: LocalProcessSpawner enforces neither mem_limit nor
#   cpu_limit; launch/hub/README.md says what would.
# - Idle servers are stopped by jupyterhub-idle-culler, run by the hub as a service.
# Environment (all optional but the password): see launch/hub/README.md.

import asyncio
import os
import pwd
import resource
import shutil
import sys
import time

from jupyterhub.auth import LocalAuthenticator
from jupyterhub.authenticators.shared import SharedPasswordAuthenticator
from jupyterhub.spawner import LocalProcessSpawner

from course_lib.launcher.processes import kill_and_reap, processes_of_uid

c = get_config()  # noqa: F821 (given by JupyterHub when it loads this file)

VENV_BIN = os.path.join(sys.prefix, "bin")  # the hub runs in the course's venv: its servers do too
PORT = int(os.environ.get("COURSE_HUB_PORT", "8000"))
COURSE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout
# What each learner gets in ~/course at their first start (the venv and the tests stay shared).
COURSE_COPY = os.environ.get("COURSE_HUB_COPY", "README.md notebooks exercises solutions launch").split()
LEFTOVER_GRACE_S = 15  # how long a stopped server's processes get to end on their own


class WorkshopAuthenticator(SharedPasswordAuthenticator, LocalAuthenticator):
    """The shared password signs a learner in; a Unix user of the same name is created if missing."""


class CourseSpawner(LocalProcessSpawner):
    """A learner's server as their Unix user, with per-process memory and per-user task limits.

    Stopping a server ends every process the learner still has (a terminal's background job, or
    anything the course failed to end), and says in the hub's log what it had to end."""

    tasks_limit = int(os.environ.get("COURSE_HUB_TASKS", "1024"))

    def make_preexec_fn(self, name):
        become_user = super().make_preexec_fn(name)
        memory, tasks = self.mem_limit, self.tasks_limit

        def preexec():
            # RLIMIT_DATA (heap and private writable mappings), not RLIMIT_AS: torch maps address space it
            # never touches, and under RLIMIT_AS imports fail (course_lib/grading/rank_runner.py).
            if memory:
                resource.setrlimit(resource.RLIMIT_DATA, (memory, memory))
            if tasks:
                resource.setrlimit(resource.RLIMIT_NPROC, (tasks, tasks))
            become_user()

        return preexec

    async def start(self):
        _give_course(self.user.name)
        return await super().start()

    async def stop(self, now=False):
        await super().stop(now=now)
        # The kernel ends on its own once its server is gone (it polls its parent), and its ranks with it
        # (the course's watchdog): give them a few seconds before ending what is left.
        uid = pwd.getpwnam(self.user.name).pw_uid
        deadline = time.monotonic() + LEFTOVER_GRACE_S
        while (left := processes_of_uid(uid)) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        for proc in left:
            self.log.warning("left behind by %s's server, killed: pid %d %s", self.user.name, proc.pid,
                             " ".join(proc.info["cmdline"] or [])[:200])
        kill_and_reap(left)


def _give_course(name):
    """At a learner's first start: their own copy of the lessons in ~/course (lessons link to ../exercises and
    ../launch), owned by them; a later start leaves it as the learner left it."""
    user = pwd.getpwnam(name)
    target = os.path.join(user.pw_dir, "course")
    if os.path.exists(target):
        return
    staging = target + ".partial"  # a copy cut short (the hub stopped) is redone, never half kept
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    skip = shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints", "*.pyc")
    for item in COURSE_COPY:
        source = os.path.join(COURSE_ROOT, item)
        if os.path.isdir(source):
            shutil.copytree(source, os.path.join(staging, item), ignore=skip)
        elif os.path.exists(source):
            shutil.copy2(source, staging)
    for folder, dirs, files in os.walk(staging):
        for entry in [folder] + [os.path.join(folder, f) for f in files]:
            os.lchown(entry, user.pw_uid, user.pw_gid)
    os.rename(staging, target)


# --- where it listens -------------------------------------------------------------------------------
# Learners open http://<this machine>:PORT; the hub's own API and the proxy's API stay on loopback.
c.JupyterHub.bind_url = f"http://{os.environ.get('COURSE_HUB_IP', '0.0.0.0')}:{PORT}"
c.JupyterHub.hub_bind_url = f"http://127.0.0.1:{PORT + 1}"
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{PORT + 2}"
# configurable-http-proxy, installed from npm into the venv by `make install`, else found on PATH.
_proxy = os.environ.get("COURSE_HUB_PROXY") or os.path.join(sys.prefix, "node_modules", ".bin",
                                                             "configurable-http-proxy")
c.ConfigurableHTTPProxy.command = [_proxy if os.path.exists(_proxy) else "configurable-http-proxy"]

# --- who signs in -----------------------------------------------------------------------------------
c.JupyterHub.authenticator_class = WorkshopAuthenticator
c.SharedPasswordAuthenticator.user_password = os.environ["COURSE_HUB_PASSWORD"]  # 8 characters at least
c.LocalAuthenticator.create_system_users = True
c.LocalAuthenticator.add_user_cmd = ["useradd", "--create-home", "--shell", "/bin/bash"]
# A learner name is also a Unix user name: refuse others at sign-in rather than fail at useradd.
c.Authenticator.username_pattern = r"^[a-z][a-z0-9-]{0,30}$"
_learners = [n.strip() for n in os.environ.get("COURSE_HUB_LEARNERS", "").split(",") if n.strip()]
if _learners:
    c.Authenticator.allowed_users = set(_learners)
else:
    c.Authenticator.allow_all = True  # any name with the password: a closed room only

# --- each learner's server --------------------------------------------------------------------------
c.JupyterHub.spawner_class = CourseSpawner
c.Spawner.cmd = [os.path.join(VENV_BIN, "jupyterhub-singleuser")]
c.Spawner.default_url = "/lab/tree/course/notebooks/00_setup.ipynb"
c.Spawner.mem_limit = os.environ.get("COURSE_HUB_MEM_LIMIT", "4G")  # per process (RLIMIT_DATA), see above
c.Spawner.environment = {
    "PATH": os.pathsep.join([VENV_BIN, "/usr/local/bin", "/usr/bin", "/bin"]),
    "HF_HUB_OFFLINE": "1",  # the lessons build their models from a config: nothing to download
    # One thread per process: the kernel's single-process baselines share the cores with the whole room
    # (the ranks get 1 from the launcher already).
    "OMP_NUM_THREADS": "1",
}
# PYTHONPATH passes through so that a checkout's course_lib can be served without installing it (the test).
c.Spawner.env_keep = ["JUPYTERHUB_SINGLEUSER_APP", "PYTHONPATH", "LANG"]
c.Spawner.http_timeout = 120  # a server's first start imports a lot on a loaded machine
c.Spawner.start_timeout = 120

# --- idle servers -----------------------------------------------------------------------------------
# A server with no activity (kernels, terminals, browser) for COURSE_HUB_CULL_AFTER seconds is stopped,
# which ends its ranks too; the learner's files stay, and signing in again starts a fresh server.
_cull_after = int(os.environ.get("COURSE_HUB_CULL_AFTER", "3600"))
c.JupyterHub.services = [{
    "name": "idle-culler",
    "command": [sys.executable, "-m", "jupyterhub_idle_culler", f"--timeout={_cull_after}",
                f"--cull-every={max(10, min(300, _cull_after // 2))}"],
}]
c.JupyterHub.load_roles = [{
    "name": "idle-culler",
    "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"],
    "services": ["idle-culler"],
}]
