"""Run the GPU script's steps in parallel and write what each saw as one record entry.

    python tests/gpu_node/run_steps.py OUT [--dry-run] [--jobs N] [--notebooks 00_setup,02_ddp] [--cells K]
                                          [--record tests/gpu_node/record.json]

Each step (tests/gpu_node/steps.py) runs as its own process group with its own time limit; its output goes
to OUT/<step>.log; one line per step goes to stdout as it ends. The entry (OUT/record_entry.json, and
appended to --record when given) holds the machine (`date`, `gpu`, `torch`, `cuda`, `nccl`, `python`)
and, per notebook, `cells_run`, `cells_failed` and each failure's cell and one-line cause, for nbval and
for the 1-rank run; then the other steps' outcome. `record_table.py` turns the record into the README's
"What has run on a GPU" table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from steps import ROOT, Step, plan  # noqa: E402

CELL = re.compile(r"Cell (\d+)$")


def machine() -> dict:
    """The machine's facts for the record: date, GPU, torch, CUDA, NCCL, Python."""
    import torch

    cuda = torch.cuda.is_available()
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(0) if cuda else "none (CPU dry run)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "python": platform.python_version(),
    }


def run_step(step: Step, out: pathlib.Path, deadline: float) -> dict:
    """Run one step in a process group of its own; kill the whole group at its limit or the run's deadline."""
    started = time.monotonic()
    log = out / f"{step.name}.log"
    limit = min(step.limit_s, deadline - started)
    if limit <= 0:
        log.write_text("not started: the run's time budget was spent\n")
        return {"rc": None, "seconds": 0, "timed_out": True}
    with log.open("w") as sink:
        proc = subprocess.Popen(step.argv, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **dict(step.env)})
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the ranks and kernels it started go too
            proc.wait()
            rc = None
    return {"rc": rc, "seconds": round(time.monotonic() - started), "timed_out": rc is None}


def first_line(text: str) -> str:
    """The first line that says something, cut to 160 characters."""
    for line in (text or "").splitlines():
        if line.strip() and not set(line.strip()) <= set("-_=~^ "):
            return line.strip()[:160]
    return ""


def read_nbval(xml_path: pathlib.Path) -> dict:
    """cells_run, cells_failed and the failures from nbval's junit XML (absent: nothing ran)."""
    if not xml_path.exists():
        return {"cells_run": 0, "cells_failed": 0, "failures": [{"cell": None, "cause": "no junit XML: nbval did not finish"}]}
    cases = ET.parse(xml_path).getroot().iter("testcase")
    run, failures = 0, []
    for case in cases:
        name = CELL.search(case.get("name", ""))
        if name is None or case.find("skipped") is not None:
            continue
        run += 1
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            cause = first_line(bad.get("message", "")) or first_line(bad.text or "")
            failures.append({"cell": int(name.group(1)), "cause": cause})
    return {"cells_run": run, "cells_failed": len(failures), "failures": failures}


def read_one_rank(log: pathlib.Path) -> dict:
    """cells_run, cells_failed and the failures of the 1-rank run (its RESULT lines)."""
    lines = [json.loads(line[len("RESULT "):]) for line in log.read_text().splitlines() if line.startswith("RESULT ")]
    ran = [r for r in lines if r["state"] != "not run"]
    failed = [{"cell": r["cell"], "cause": r["state"][:160]} for r in ran if r["state"] != "ran"]
    return {"cells_run": len(ran), "cells_failed": len(failed), "failures": failed,
            "not_run": [r["cell"] for r in lines if r["state"] == "not run"]}


def entry_of(steps: list[Step], outcomes: dict[str, dict], out: pathlib.Path, dry_run: bool) -> dict:
    notebooks: dict[str, dict] = {}
    others: dict[str, dict] = {}
    for step in steps:
        outcome = outcomes[step.name]
        if step.kind.startswith("nbval"):
            notebooks.setdefault(step.notebook, {})[step.kind] = {**read_nbval(out / f"{step.name}.xml"),
                                                                  "timed_out": outcome["timed_out"]}
        elif step.kind == "one_rank":
            notebooks.setdefault(step.notebook, {})["one_rank"] = {
                **read_one_rank(out / f"{step.name}.log"), "backend": "gloo" if dry_run else "nccl",
                "timed_out": outcome["timed_out"]}
        else:
            log = (out / f"{step.name}.log").read_text(errors="replace").strip().splitlines()
            last = log[-1].replace(str(out), "OUT")[:160] if log else ""  # no path of the machine in the record
            others[step.name] = {**outcome, "last_line": last}
    return {**machine(), "dry_run": dry_run, "notebooks": notebooks, "steps": others}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--dry-run", action="store_true", help="on CPU, gloo, the first few cells of each lesson")
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--notebooks", help="comma-separated notebook stems (dry run)")
    parser.add_argument("--cells", type=int, default=2, help="code cells per notebook in a dry run")
    parser.add_argument("--record", type=pathlib.Path, help="append the entry to this JSON list")
    parser.add_argument("--budget-s", type=float, default=450,
                        help="every step ends by then (default 450: the script within 8 minutes with its set-up)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    steps = plan(out, dry_run=args.dry_run, notebooks=args.notebooks.split(",") if args.notebooks else None,
                 cells=args.cells)
    outcomes: dict[str, dict] = {}
    started = time.monotonic()
    deadline = started + args.budget_s
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        running = {pool.submit(run_step, step, out, deadline): step for step in steps}
        for done in concurrent.futures.as_completed(running):
            step = running[done]
            outcomes[step.name] = done.result()
            o = outcomes[step.name]
            ended = "timed out" if o["timed_out"] else f"rc={o['rc']}"
            print(f"STEP {step.name}: {ended} in {o['seconds']} s", flush=True)
    entry = entry_of(steps, outcomes, out, args.dry_run)
    entry["seconds"] = round(time.monotonic() - started)
    (out / "record_entry.json").write_text(json.dumps(entry, indent=1) + "\n")
    if args.record:
        record = json.loads(args.record.read_text()) if args.record.exists() else []
        args.record.write_text(json.dumps([*record, entry], indent=1) + "\n")
    print(f"all steps in {entry['seconds']} s; entry in {out / 'record_entry.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
