"""Long runs a learner starts say how far they are: the simulation (cl.simulate_table) prints a line per configuration."""

from __future__ import annotations

import json
import re
import time

import pytest

from course_lib.measure import simulate

TINY = dict(hidden=64, layers=2, vocab=128, intermediate=128, heads=4, kv_heads=2)


@pytest.mark.slow
def test_a_simulation_worker_reports_each_configuration_as_it_ends():
    # One worker, one configuration: the cheapest real run (a worker imports torch and transformers).
    calls = []
    (result,) = simulate.simulate_many([dict(config=TINY, world_size=2)], processes=1,
                                       on_progress=lambda *call: calls.append(call))
    assert calls == [(1, 1, "custom on 2 ranks")] and result.world_size == 2


def test_progress_is_counted_per_worker(tmp_path):
    # Worker 0 ends two jobs, worker 1 one, interleaved: each job is reported once, in the order seen.
    files = [tmp_path / "worker0.jsonl", tmp_path / "worker1.jsonl"]
    script = [(files[0], 8), (files[1], 64), (files[0], 1024)]

    class Worker:
        def poll(self):
            if script:
                path, n = script.pop(0)
                with open(path, "a") as handle:
                    handle.write(json.dumps({"model": "llama-7b", "world_size": n}) + "\n")
                return None
            return 0

    calls = []
    simulate._follow_progress([(Worker(), None, None)], files, 3, time.monotonic() + 30,
                              lambda *call: calls.append(call))
    assert calls == [(1, 3, "llama-7b on 8 ranks"), (2, 3, "llama-7b on 64 ranks"), (3, 3, "llama-7b on 1024 ranks")]


def test_simulate_table_prints_a_line_per_configuration(monkeypatch, capsys):
    def fake_many(jobs, *, processes, timeout_s, on_progress):
        for done, job in enumerate(jobs, 1):
            on_progress(done, len(jobs), f"{job['config']} on {job['world_size']} ranks")
        return []

    monkeypatch.setattr(simulate, "simulate_many", fake_many)
    assert simulate.simulate_table(models=("llama-7b",), world_sizes=(8, 64)) == []
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("simulating 2 configurations")
    assert [re.sub(r"\(\d+ s\)", "(N s)", line) for line in lines[1:]] == [
        "simulated 1/2: llama-7b on 8 ranks (N s)", "simulated 2/2: llama-7b on 64 ranks (N s)"]


def test_the_sanitizer_drops_the_progress_lines():
    # Read as nbval reads it: a "replace:" line without its space would drop the rule silently.
    import pathlib

    from nbval.plugin import get_sanitize_patterns

    patterns = dict(get_sanitize_patterns(pathlib.Path(__file__).with_name("nbval_sanitize.cfg").read_text()))
    text = "simulating 6 configurations ...\nsimulated 1/6: llama-70b on 8 ranks (14 s)\nmodel  ranks\n"
    for regex, replace in patterns.items():
        text = re.sub(regex, replace, text)
    assert text == "simulating 6 configurations ...\nmodel  ranks\n"
