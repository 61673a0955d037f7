"""Drive launch/hub's JupyterHub from a script: start it, sign learners in, run cells in their kernels, stop it.

Used by tests/test_hub.py and bench/bench_hub.py (not by the hub itself). The hub runs as a child
process with the workshop's config plus one test service whose API token starts, reaches and stops
the learners' servers; learners sign in through the login form with the shared password, as in a
room. A kernel is driven over the server's REST and websocket API, through the hub's proxy.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

import psutil
import requests
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from course_lib.launcher.processes import kill_and_reap, processes_of_uid

HERE = pathlib.Path(__file__).resolve().parent
CONFIG = HERE / "jupyterhub_config.py"
SERVICE = "course-test"
LEFT_BEHIND = "left behind by"  # CourseSpawner.stop's log line when it had to end a learner's process

_TEST_CONFIG = """\
load_subconfig({config!r})
c.JupyterHub.services.append({{"name": {service!r}, "api_token": {token!r}}})
c.JupyterHub.load_roles.append({{"name": {service!r}, "services": [{service!r}],
    "scopes": ["admin:users", "admin:servers", "access:servers", "list:users", "read:users"]}})
"""


def proxy_command() -> str | None:
    """configurable-http-proxy as the config finds it (COURSE_HUB_PROXY, the venv's node_modules, PATH)."""
    for path in (os.environ.get("COURSE_HUB_PROXY"),
                 os.path.join(sys.prefix, "node_modules", ".bin", "configurable-http-proxy")):
        if path and os.path.exists(path):
            return path
    return shutil.which("configurable-http-proxy")


def free_port_run(count: int = 3) -> int:
    """A port P with P..P+count-1 all free on loopback (the hub's public, API and proxy API ports)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + count > 65535:
            continue
        try:
            held = []
            for port in range(first, first + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError("no run of free ports on 127.0.0.1")


def blocked_dirs(paths: list[str]) -> list[pathlib.Path]:
    """Folders above `paths` (and the paths themselves) that other users cannot enter (no o+x)."""
    blocked = []
    for path in paths:
        for folder in [pathlib.Path(path).resolve(), *pathlib.Path(path).resolve().parents]:
            if folder.is_dir() and not folder.stat().st_mode & 0o001 and folder not in blocked:
                blocked.append(folder)
    return blocked


def course_paths() -> list[str]:
    """What a learner's server must reach: the venv, the interpreter it links to, and the checkout."""
    return [sys.prefix, os.path.realpath(sys.executable), sys.base_prefix, str(HERE.parent.parent)]


class Traversable:
    """Give other users search permission (o+x, not read) on `folders` for a while, then take it back.

    For a test machine whose Python lives under a private home (pyenv in /root); a workshop machine
    installs the course where every learner can read it instead (launch/hub/README.md)."""

    def __init__(self, folders: list[pathlib.Path]):
        self.modes = {folder: folder.stat().st_mode & 0o7777 for folder in folders}

    def __enter__(self):
        for folder, mode in self.modes.items():
            os.chmod(folder, mode | 0o001)
        return self

    def __exit__(self, *exc):
        for folder, mode in self.modes.items():
            os.chmod(folder, mode)


def remove_user(name: str) -> None:
    """Delete a learner's Unix user and home (what the hub created), ending their processes first."""
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        return
    kill_and_reap(processes_of_uid(uid))
    subprocess.run(["userdel", "--remove", name], capture_output=True)


class Hub:
    """One JupyterHub on 127.0.0.1, state in `state_dir`; `start()`, use, `stop()`."""

    def __init__(self, state_dir: pathlib.Path, password: str, *, mem_limit: str = "4G",
                 env: dict[str, str] | None = None):
        self.state_dir = pathlib.Path(state_dir)
        self.password = password
        self.port = free_port_run()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = secrets.token_hex(32)
        self.log_path = self.state_dir / "hub.log"
        self.env = dict(os.environ, COURSE_HUB_PORT=str(self.port), COURSE_HUB_IP="127.0.0.1",
                        COURSE_HUB_PASSWORD=password, COURSE_HUB_MEM_LIMIT=mem_limit, **(env or {}))
        proxy = proxy_command()
        if proxy:
            self.env["COURSE_HUB_PROXY"] = proxy
        self.proc: subprocess.Popen | None = None

    # --- the hub process ----------------------------------------------------------------------------
    def start(self, timeout_s: float = 90) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        config = self.state_dir / "test_config.py"
        config.write_text(_TEST_CONFIG.format(config=str(CONFIG), service=SERVICE, token=self.token))
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", str(config)], cwd=self.state_dir,
                                     env=self.env, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the hub exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if requests.get(f"{self.url}/hub/health", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the hub did not answer in {timeout_s} s:\n{self.log()[-3000:]}")

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM, as an instructor's Ctrl-C or systemd would; the hub's exit status (SIGKILL after timeout_s)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def children(self) -> list[psutil.Process]:
        """The hub's processes below it now: its proxy and services (the learners' servers too, if any)."""
        return psutil.Process(self.proc.pid).children(recursive=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # --- the REST API -------------------------------------------------------------------------------
    def api(self, method: str, path: str, **kwargs) -> requests.Response:
        return requests.request(method, f"{self.url}/hub/api{path}", timeout=30,
                                headers={"Authorization": f"token {self.token}"}, **kwargs)

    def sign_in(self, name: str, password: str | None = None) -> bool:
        """The login form, as a browser posts it; True when the hub accepted the name and password."""
        session = requests.Session()
        session.get(f"{self.url}/hub/login", timeout=30)
        answer = session.post(f"{self.url}/hub/login", timeout=60, allow_redirects=False,
                              data={"username": name, "password": self.password if password is None else password,
                                    "_xsrf": session.cookies.get("_xsrf", "")})
        return answer.status_code == 302

    def start_server(self, name: str) -> None:
        answer = self.api("POST", f"/users/{name}/server")
        if answer.status_code not in (201, 202):
            raise RuntimeError(f"starting {name}'s server: {answer.status_code} {answer.text}")

    def wait_ready(self, name: str, timeout_s: float = 150) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            server = self.api("GET", f"/users/{name}").json().get("servers", {}).get("")
            if server and server.get("ready"):
                return
            if server is None and time.monotonic() > deadline - timeout_s + 5:
                raise RuntimeError(f"{name}'s server is gone:\n{self.log()[-3000:]}")
            time.sleep(0.3)
        raise RuntimeError(f"{name}'s server not ready in {timeout_s} s:\n{self.log()[-3000:]}")

    def stop_server(self, name: str, timeout_s: float = 60) -> None:
        self.api("DELETE", f"/users/{name}/server")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.api("GET", f"/users/{name}").json().get("servers"):
                return
            time.sleep(0.3)
        raise RuntimeError(f"{name}'s server still there after {timeout_s} s")

    def new_kernel(self, name: str) -> Kernel:
        answer = requests.post(f"{self.url}/user/{name}/api/kernels", timeout=60, json={"name": "python3"},
                               headers={"Authorization": f"token {self.token}"})
        answer.raise_for_status()
        return Kernel(self, name, answer.json()["id"])


class Kernel:
    """A learner's kernel, through the proxy: `await run(code)` returns what the cell printed and its error."""

    def __init__(self, hub: Hub, user: str, kernel_id: str):
        self.hub, self.user, self.id = hub, user, kernel_id
        self.session = uuid.uuid4().hex
        self.ws = None

    async def connect(self) -> None:
        url = f"ws://127.0.0.1:{self.hub.port}/user/{self.user}/api/kernels/{self.id}/channels"
        self.ws = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {self.hub.token}"}),
                                          max_message_size=64 << 20)

    async def run(self, code: str, timeout_s: float = 300) -> tuple[str, str, dict | None]:
        """(stdout, stderr, error) of one execute request; error is {"ename", "evalue"} or None."""
        if self.ws is None:
            await self.connect()
        msg_id = uuid.uuid4().hex
        await self.ws.write_message(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": self.user,
                       "session": self.session, "version": "5.3", "date": ""},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True}}))
        out, err, error, replied, idle = [], [], None, False, False
        deadline = time.monotonic() + timeout_s
        while not (replied and idle):
            raw = await asyncio.wait_for(self.ws.read_message(), max(0.1, deadline - time.monotonic()))
            if raw is None:
                raise RuntimeError(f"{self.user}'s kernel connection closed")
            msg = json.loads(raw)
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                (out if content["name"] == "stdout" else err).append(content["text"])
            elif kind == "error":
                error = {"ename": content["ename"], "evalue": content["evalue"]}
            elif kind == "execute_reply":
                replied = True
            elif kind == "status" and content["execution_state"] == "idle":
                idle = True
        return "".join(out), "".join(err), error

    async def close(self) -> None:
        if self.ws is not None:
            self.ws.close()

    def shutdown(self) -> None:
        """End the kernel (and with it whatever its cells left running) through the server's REST API."""
        requests.delete(f"{self.hub.url}/user/{self.user}/api/kernels/{self.id}", timeout=60,
                        headers={"Authorization": f"token {self.hub.token}"})


def rank_lines(text: str) -> dict[int, list[str]]:
    """`[rank N] line` blocks of a multi-rank cell's output, by rank."""
    lines: dict[int, list[str]] = {}
    for found in re.finditer(r"^\[rank (\d+)\] (.*)$", text, re.M):
        lines.setdefault(int(found.group(1)), []).append(found.group(2))
    return lines
