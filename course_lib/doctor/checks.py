"""The pre-flight check: is this machine ready for the course? One line per check, one verdict.

    python -m course_lib.doctor

Each check reads one fact of the machine and says `ok`, `warn` (the course runs,
something is worse than it could be) or `BLOCKING` (lessons will fail), and for
every problem what to do. The exit status is 1 when any check is blocking, so a
workshop's setup script can stop on it.

The facts are read first (`read_facts`), then judged (`judge`): tests hand
`judge` the facts of another machine (an old torch, one core) without needing one.
It runs where torch is missing or broken too: that is one of the problems it names.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import socket
import sys
import time

__all__ = ["Facts", "Finding", "MAX_RANKS", "MIN_CORES", "MIN_PYTHON", "NEWEST_TESTED_TORCH", "judge", "main",
           "read_facts", "verdict"]

MIN_PYTHON = (3, 10)  # pyproject.toml's requires-python (tests/test_doctor.py checks they agree)
NEWEST_TESTED_TORCH = (2, 15)  # README, "Testing": the suite runs on 2.13.0 and 2.15.0
MAX_RANKS = 4  # the most ranks a lesson cell starts (`%%torchrun -n 4`; tests/test_doctor.py counts them)
MIN_CORES = 2  # the lessons are timed, and their deadlines set, on 2 cores
JUPYTER_PACKAGES = ("jupyterlab", "ipykernel", "ipywidgets", "jupyterlab_widgets")
WIDGET_PLUGIN = "@jupyter-widgets/jupyterlab-manager:plugin"  # as in lab_settings.PLUGIN
INSTALL = "`make install` from the course's folder (or `pip install -e .` in your environment)"

OK, WARN, BLOCKING = "ok", "warn", "BLOCKING"


@dataclasses.dataclass
class Finding:
    check: str  # a short name: "python", "torch", ...
    status: str  # OK, WARN or BLOCKING
    what: str  # what was found, one line
    todo: str = ""  # what to do about it (WARN and BLOCKING)


@dataclasses.dataclass
class Facts:
    python: tuple[int, ...]
    torch: str | None  # the installed version, None when `import torch` fails
    torch_error: str = ""  # why `import torch` failed
    distributed: bool = False  # torch.distributed.is_available()
    backends: dict[str, bool] = dataclasses.field(default_factory=dict)  # compiled in: gloo, nccl, ...
    gpus: list[str] = dataclasses.field(default_factory=list)
    cores: int = 0  # the cores this process may run on (a container's or taskset's limit included)
    localhost: str = ""  # "" when `localhost` resolves and ports bind there, else what failed
    packages: dict[str, str | None] = dataclasses.field(default_factory=dict)  # Jupyter's, None when missing
    save_widget_state: bool | None = None  # JupyterLab's effective setting; None when it cannot be read
    settings_file: str = ""  # the overrides.json `make install` writes
    widget_user_file: str = ""  # the user settings file, when it is what sets saveState (it beats overrides.json)
    launch_port: str = ""  # "" when launch/multinode.sh's default rendezvous port is free, else what holds it
    job: str | None = None  # the 2-rank gloo job: "" when it ran and gave the right sum, else what went wrong
    job_s: float = 0.0


# ---------------------------------------------------------------- reading the facts

def _cores(cgroup_root: pathlib.Path = pathlib.Path("/sys/fs/cgroup"),
           own_cgroup: pathlib.Path = pathlib.Path("/proc/self/cgroup")) -> int:
    """The cores this process may use: the CPUs it may run on (cpusets, taskset), and no more than its CPU
    quota allows (cgroup v2 `cpu.max`: what JupyterHub's systemd and Kubernetes spawners set)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    quota = _cpu_quota(cgroup_root, own_cgroup)
    return max(1, min(cores, quota)) if quota is not None else cores


def _cpu_quota(cgroup_root: pathlib.Path, own_cgroup: pathlib.Path) -> int | None:
    """Cores' worth of CPU time this process's cgroup and its ancestors allow (cgroup v2 `cpu.max`, "QUOTA
    PERIOD" or "max PERIOD"), rounded up; None when there is no quota or no cgroup v2 to read."""
    try:
        line = next(ln for ln in own_cgroup.read_text().splitlines() if ln.startswith("0::"))
    except (OSError, StopIteration):
        return None
    path, limits = pathlib.PurePosixPath(line[3:].strip() or "/"), []
    for folder in (path, *path.parents):
        try:
            quota, period = (cgroup_root / folder.relative_to("/") / "cpu.max").read_text().split()
        except (OSError, ValueError):
            continue
        if quota != "max":
            limits.append(math.ceil(int(quota) / int(period)))
    return min(limits) if limits else None


def _localhost() -> str:
    """torchrun --standalone starts its rendezvous on a free port of localhost; 4 ranks need a few ports."""
    try:
        socket.getaddrinfo("localhost", None)
    except OSError as error:
        return f"the name localhost does not resolve ({error})"
    held = []
    try:
        for _ in range(MAX_RANKS + 1):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind(("127.0.0.1", 0))
            sock.listen()
    except OSError as error:
        return f"cannot open {MAX_RANKS + 1} listening ports on 127.0.0.1 ({error})"
    finally:
        for sock in held:
            sock.close()
    return ""


LAUNCH_PORT = 29500  # launch/multinode.sh's default RDZV_ENDPOINT port (and torchrun's without --standalone)


def _launch_port(port: int = LAUNCH_PORT) -> str:
    """"" when `port` can be bound on 127.0.0.1, else why not (another program listens there)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as error:
        return f"port {port} on 127.0.0.1 cannot be bound ({error.strerror or error})"
    finally:
        sock.close()
    return ""


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _lab_dirs() -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    """JupyterLab's app dir, the user settings dir and the labextensions dir, as JupyterLab finds them.

    Read here rather than through jupyterlab and jupyterlab_server, whose imports take seconds.
    """
    app = pathlib.Path(os.environ.get("JUPYTERLAB_DIR") or pathlib.Path(sys.prefix, "share", "jupyter", "lab"))
    config = os.environ.get("JUPYTER_CONFIG_DIR") or pathlib.Path.home() / ".jupyter"
    user = pathlib.Path(os.environ.get("JUPYTERLAB_SETTINGS_DIR") or pathlib.Path(config, "lab", "user-settings"))
    return app, user, pathlib.Path(sys.prefix, "share", "jupyter", "labextensions")


def _read_json5(path: pathlib.Path) -> dict:
    import json5  # JupyterLab's settings files may hold comments; jupyterlab_server depends on json5

    return json5.loads(path.read_text()) if path.is_file() else {}


def _widget_state_setting() -> tuple[bool | None, str, str]:
    """saveState as JupyterLab will see it (user setting, else overrides.json, else the default); the overrides
    file; the user settings file when it is the one that sets saveState ("" when not)."""
    app, user, labextensions = _lab_dirs()
    settings_file = app / "settings" / "overrides.json"
    package, plugin = WIDGET_PLUGIN.split(":")
    schema = labextensions / package / "schemas" / package / f"{plugin}.json"
    user_file = user / package / f"{plugin}.jupyterlab-settings"
    try:
        if not schema.is_file():
            return None, str(settings_file), ""  # no widget manager installed in this environment
        value = _read_json5(schema)["properties"]["saveState"].get("default", False)
        value = _read_json5(settings_file).get(WIDGET_PLUGIN, {}).get("saveState", value)
        users = _read_json5(user_file)
    except (OSError, ValueError, KeyError, ImportError):
        return None, str(settings_file), ""
    if "saveState" in users:
        return bool(users["saveState"]), str(settings_file), str(user_file)
    return bool(value), str(settings_file), ""


JOB = """\
import torch
import torch.distributed as dist
import course_lib as cl

info = cl.init()
total = torch.tensor([info.rank + 1.0])
dist.all_reduce(total)
cl.publish("total", total.item())
"""


def _run_job(timeout_s: float = 120.0) -> tuple[str, float]:
    """The course's own launcher runs a 2-rank gloo all_reduce: "" if both ranks got 1 + 2, else what happened."""
    from ..launcher.torchrun import run_torchrun

    start = time.monotonic()
    try:
        result = run_torchrun(JOB, 2, backend="gloo", timeout_s=timeout_s, first_line="doctor")
    except Exception as error:  # noqa: BLE001 - whatever stops the launch is the finding
        return f"could not start torchrun: {type(error).__name__}: {error}", time.monotonic() - start
    seconds = time.monotonic() - start
    if result.timed_out:
        return f"did not finish within {timeout_s:.0f} s (ranks still running: {result.unfinished})", seconds
    got = result.results.get("total", {})
    if not result.ok or got != {0: 3.0, 1: 3.0}:
        lines = [line for rank in sorted(result.stderr) for line in result.stderr[rank].splitlines() if line.strip()]
        last = lines[-1] if lines else (result.agent_output.strip().splitlines() or ["no output"])[-1]
        return f"failed (exit codes {result.exit_codes}, sums {got}): {last}", seconds
    return "", seconds


def read_facts(*, run_job: bool = True) -> Facts:
    """This machine's facts; `run_job=False` skips the 2-rank job (a few seconds)."""
    facts = Facts(python=tuple(sys.version_info[:3]), torch=None, cores=_cores(), localhost=_localhost(),
                  launch_port=_launch_port(),
                  packages={name: _package_version(name) for name in JUPYTER_PACKAGES})
    try:
        import torch
        import torch.distributed as dist
    except Exception as error:  # noqa: BLE001 - missing, or a broken build: both are the finding
        facts.torch_error = f"{type(error).__name__}: {error}"
    else:
        facts.torch = torch.__version__
        facts.distributed = dist.is_available()
        if facts.distributed:
            facts.backends = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available()}
        if torch.cuda.is_available():
            facts.gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    facts.save_widget_state, facts.settings_file, facts.widget_user_file = _widget_state_setting()
    if run_job and facts.torch and facts.backends.get("gloo"):
        facts.job, facts.job_s = _run_job()
    return facts


# ---------------------------------------------------------------- judging them

def _dotted(numbers) -> str:
    return ".".join(map(str, numbers))


def check_python(version: tuple[int, ...]) -> Finding:
    if tuple(version[:2]) < MIN_PYTHON:
        return Finding("python", BLOCKING, f"Python {_dotted(version)}; the course needs {_dotted(MIN_PYTHON)} or newer",
                       f"install Python >= {_dotted(MIN_PYTHON)} and make the course's venv with it "
                       f"(`make install PYTHON=python3.11`)")
    return Finding("python", OK, f"Python {_dotted(version)} (the course needs >= {_dotted(MIN_PYTHON)})")


def check_torch(version: str | None, error: str = "") -> Finding:
    from ..torch_support import _numbers, minimum_torch

    low, high = _dotted(minimum_torch()), _dotted(NEWEST_TESTED_TORCH)
    if version is None:
        return Finding("torch", BLOCKING, f"torch cannot be imported ({error or 'not installed'})",
                       f"{INSTALL} installs torch {low}; on a GPU node keep its own build: "
                       "`make install TORCH_SPEC=preinstalled`")
    numbers = _numbers(version)
    if numbers[:2] < minimum_torch()[:2]:
        return Finding("torch", BLOCKING, f"torch {version} is older than {low}, the oldest the course is tested with",
                       f"install torch>={low} (`pip install 'torch>={low}'`, or {INSTALL}); lesson cells use "
                       "APIs older versions lack")
    if numbers[:2] > NEWEST_TESTED_TORCH:
        return Finding("torch", WARN, f"torch {version} is newer than {high}, the newest the course is tested with",
                       "it should work; if a cell fails with an API error, `make lab TORCH_SPEC=torch==2.15.0` "
                       "gives a tested version in a venv of its own")
    return Finding("torch", OK, f"torch {version} (tested: {low} to {high})")


def check_distributed(facts: Facts) -> Finding | None:
    if facts.torch is None:
        return None  # check_torch said it
    if not facts.distributed or not facts.backends.get("gloo"):
        return Finding("distributed", BLOCKING, "this torch has no torch.distributed with gloo"
                       if facts.distributed else "this torch was built without torch.distributed",
                       f"install a build from pytorch.org (Linux and macOS wheels have gloo): {INSTALL}")
    built = ", ".join(name for name, there in facts.backends.items() if there)
    return Finding("distributed", OK, f"torch.distributed with {built}")


def check_gpus(facts: Facts) -> Finding | None:
    if facts.torch is None:
        return None
    n = len(facts.gpus)
    if n == 0:
        return Finding("gpus", OK, "no CUDA GPU: every cell runs gloo on the CPU (the course is written for that)")
    names = ", ".join(sorted(set(facts.gpus)))
    if not facts.backends.get("nccl"):
        return Finding("gpus", WARN, f"{n} CUDA GPU(s) ({names}) but this torch has no NCCL: cells run gloo",
                       "install a CUDA build of torch with NCCL (pytorch.org's Linux CUDA wheels have it)")
    fallback = f"; cells with more than {n} ranks run gloo on the CPU" if n < MAX_RANKS else ""
    return Finding("gpus", OK, f"{n} CUDA GPU(s) ({names}) with NCCL: a cell of up to {n} ranks runs NCCL, "
                               f"one GPU per rank{fallback}")


def check_cores(cores: int) -> Finding:
    if cores < MIN_CORES:
        return Finding("cores", BLOCKING, f"{cores} CPU core for cells of up to {MAX_RANKS} ranks: the ranks take "
                       f"turns on it and cells miss their deadlines",
                       f"give this machine (VM, container: `docker run --cpuset-cpus 0-{MIN_CORES - 1}`, taskset) at least "
                       f"{MIN_CORES} cores")
    share = f"; {MAX_RANKS}-rank cells share them" if cores < MAX_RANKS else ""
    return Finding("cores", OK, f"{cores} CPU cores for up to {MAX_RANKS} ranks a cell (the lessons are timed on "
                                f"{MIN_CORES}{share})")


def check_ports(problem: str) -> Finding:
    if problem:
        return Finding("ports", BLOCKING, problem,
                       "torchrun starts its rendezvous on localhost: add `127.0.0.1 localhost` to /etc/hosts and "
                       "allow listening on the loopback interface")
    return Finding("ports", OK, f"localhost resolves and {MAX_RANKS + 1} free ports open on 127.0.0.1")


def check_launch_port(problem: str) -> Finding:
    """Notebook cells pick free ports; launch/multinode.sh (and torchrun without --standalone) use 29500."""
    if problem:
        return Finding("launch port", WARN, f"{problem}: launch/multinode.sh's default rendezvous port is taken "
                       "(notebook cells are not affected: they pick free ports)",
                       f"give the launcher another port: RDZV_ENDPOINT=127.0.0.1:29600 bash launch/multinode.sh ..., "
                       f"or stop the program on port {LAUNCH_PORT} (`ss -ltnp | grep {LAUNCH_PORT}` names it)")
    return Finding("launch port", OK, f"port {LAUNCH_PORT} free for launch/multinode.sh's rendezvous")


def check_job(problem: str | None, seconds: float) -> Finding | None:
    if problem is None:
        return None  # not run: torch or gloo is missing, which another check says
    if problem:
        return Finding("2-rank job", BLOCKING, f"a 2-rank gloo all_reduce {problem}",
                       "the end of the line above is the ranks' last error; with a firewall or VPN on the "
                       "loopback interface, set GLOO_SOCKET_IFNAME=lo (gloo then uses the loopback interface)")
    return Finding("2-rank job", OK, f"a 2-rank gloo all_reduce gave 1 + 2 = 3 on both ranks ({seconds:.0f} s)")


def check_jupyter(packages: dict[str, str | None]) -> Finding:
    missing = [name for name, version in packages.items() if version is None]
    if missing:
        return Finding("jupyter", BLOCKING, f"missing: {', '.join(missing)}",
                       f"{INSTALL} (JupyterLab runs the lessons; ipywidgets draws their explorers)")
    return Finding("jupyter", OK, ", ".join(f"{name} {version}" for name, version in packages.items()))


def check_widget_state(on: bool | None, settings_file: str, user_file: str = "") -> Finding:
    todo = (f"`python -m course_lib.doctor.lab_settings {settings_file}` (`make install` does it), or "
            "Settings > Jupyter Widgets > Save Jupyter widget state in notebook")
    if user_file:  # a user setting beats overrides.json: only the user's own setting can turn it back on
        todo = ("your own JupyterLab setting turns it off, and it beats the course's overrides.json: Settings > "
                f"Jupyter Widgets > Save Jupyter widget state in notebook (or \"saveState\": true in {user_file})")
    if on is None:
        return Finding("widget state", WARN, "JupyterLab's widget setting cannot be read (no jupyterlab_widgets?)",
                       todo)
    if not on:
        return Finding("widget state", WARN, "JupyterLab does not save widget state: a reopened notebook shows "
                       '"model not found" for each explorer until its cell runs again', todo)
    return Finding("widget state", OK, "JupyterLab saves widget state with each notebook")


def judge(facts: Facts) -> list[Finding]:
    found = [check_python(facts.python), check_torch(facts.torch, facts.torch_error), check_distributed(facts),
             check_gpus(facts), check_cores(facts.cores), check_ports(facts.localhost),
             check_job(facts.job, facts.job_s), check_jupyter(facts.packages),
             check_launch_port(facts.launch_port),
             check_widget_state(facts.save_widget_state, facts.settings_file, facts.widget_user_file)]
    return [finding for finding in found if finding is not None]


def verdict(findings: list[Finding]) -> str:
    blocking = [f.check for f in findings if f.status == BLOCKING]
    warnings = [f.check for f in findings if f.status == WARN]
    if blocking:
        return (f"verdict: NOT READY: {len(blocking)} blocking problem{'s' * (len(blocking) > 1)} "
                f"({', '.join(blocking)}); fix {'them' if len(blocking) > 1 else 'it'} and run the doctor again")
    if warnings:
        return f"verdict: ready, with {len(warnings)} warning{'s' * (len(warnings) > 1)} ({', '.join(warnings)})"
    return f"verdict: ready for the course ({len(findings)} checks passed)"


def report(findings: list[Finding]) -> str:
    lines = []
    for finding in findings:
        lines.append(f"  {finding.status:<8} {finding.check:<13} {finding.what}")
        if finding.todo:
            lines.append(f"  {'':<8} {'':<13} what to do: {finding.todo}")
    lines.append(verdict(findings))
    return "\n".join(lines)


def main(argv: list[str] | None = None, *, facts: Facts | None = None) -> int:
    """Print the report; 1 when a check is blocking, else 0. `facts`: judge these instead of this machine's."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m course_lib.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--no-job", action="store_true", help="skip the 2-rank gloo job (a few seconds)")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON instead")
    args = parser.parse_args(argv)
    if facts is None:
        if not args.json:  # --json prints JSON only: a setup script parses stdout whole
            job = "" if args.no_job else " (its 2-rank job takes a few seconds)"
            print(f"course doctor: checking this machine, {platform.system()} {platform.machine()}{job}", flush=True)
        facts = read_facts(run_job=not args.no_job)
    findings = judge(facts)
    if args.json:
        print(json.dumps({"findings": [dataclasses.asdict(f) for f in findings], "verdict": verdict(findings)},
                         indent=1))
    else:
        print(report(findings))
    return 1 if any(f.status == BLOCKING for f in findings) else 0
