"""Lesson 00 in a real browser: JupyterLab on 127.0.0.1 with a token, driven in headless Chromium.

What a learner does first, through the page and nothing else: open lesson 00 from
the file browser, run its first multi-rank cell (`%%torchrun -n 2`) and see each
rank's lines, draw the cell's matplotlib figure, and show an ipywidgets control
(a cell typed into the notebook: lesson 00 has none of its own). A screenshot is
left in tests/browser/artifacts/ (gitignored) for CI to keep.

Chromium is Debian's (`/usr/bin/chromium`, which `.ci/run` installs as root with
apt-get), driven by Playwright (`pip install -e '.[test]'`) through
`executable_path`: Playwright downloads no browser. Without either the test skips
with one line saying which is missing. The lab serves a temporary copy of the
notebook with autosave off, so nothing is written into the repository; the
kernel (and so the ranks) and the server are stopped by PID at the end, and the
test checks that no process it started is left.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
WALKTHROUGH = ROOT / "tests" / "browser" / "lab_walkthrough.py"
ARTIFACTS = ROOT / "tests" / "browser" / "artifacts"
NOTEBOOK = "notebooks/00_setup.ipynb"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Seconds: the lab's start, the page's first load (JupyterLab's bundle), one cell.
LAB_START_S, PAGE_S, CELL_S = 60, 90, 90


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _skip_without_browser():
    missing = [what for what, there in (("chromium (`apt-get install chromium`, as .ci/run does)", _chromium()),
                                        ("playwright (`pip install -e '.[test]'`)",
                                         importlib.util.find_spec("playwright"))) if not there]
    if missing:
        pytest.skip(f"no browser to drive: {' and '.join(missing)} not installed")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _walkthrough():
    spec = importlib.util.spec_from_file_location("lab_walkthrough", WALKTHROUGH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _start_lab(tmp: pathlib.Path, port: int, token: str) -> subprocess.Popen:
    """JupyterLab from this venv, serving a copy of lesson 00, with autosave and the news question off."""
    served = tmp / "root"
    (served / "notebooks").mkdir(parents=True)
    shutil.copy(ROOT / NOTEBOOK, served / NOTEBOOK)
    settings = tmp / "settings" / "@jupyterlab"
    for plugin, content in (("docmanager-extension/plugin", '{"autosave": false}'),
                            ("apputils-extension/notification", '{"fetchNews": "false"}')):
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    env = dict(os.environ, HF_HUB_OFFLINE="1", JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"), JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
               JUPYTER_CONFIG_DIR=str(tmp / "config"))
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
               "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={served}"]
    if os.geteuid() == 0:
        command.append("--allow-root")
    log = open(tmp / "lab.log", "wb")  # noqa: SIM115 - the server writes it until the end of the test
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=served)


def _wait_for_lab(lab: subprocess.Popen, base: str, token: str, log: pathlib.Path) -> None:
    deadline = time.monotonic() + LAB_START_S
    while time.monotonic() < deadline:
        if lab.poll() is not None:
            pytest.fail(f"JupyterLab exited with {lab.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"JupyterLab did not answer within {LAB_START_S} s:\n{log.read_text()[-3000:]}")


def _stop(pids: set[int], lab: subprocess.Popen) -> list[str]:
    """SIGTERM the server (it shuts its kernels down), then kill by PID whatever is left; what was left."""
    lab.terminate()
    try:
        lab.wait(timeout=20)
    except subprocess.TimeoutExpired:
        lab.kill()
        lab.wait(timeout=10)
    left = []
    for pid in sorted(pids):
        try:
            process = psutil.Process(pid)
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            left.append(f"{pid} {process.name()}")
            process.kill()
        except psutil.NoSuchProcess:
            pass
    return left


def _run_cell(page, walk, index: int) -> str:
    """Click into cell `index`, Shift+Enter, wait until it has run and the kernel is idle; its output text."""
    cell = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell").nth(index)
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")
    return _wait_done(page, walk, cell)


def _wait_done(page, walk, cell) -> str:
    deadline = time.monotonic() + CELL_S
    page.wait_for_timeout(500)
    while time.monotonic() < deadline:
        prompt = (cell.locator(".jp-InputPrompt").text_content() or "").strip()
        if re.fullmatch(r"\[\d+\]:", prompt) and page.locator(walk.IDLE).count():
            page.wait_for_timeout(500)  # the last output lands with the idle message
            return "\n".join(cell.locator(".jp-OutputArea-output").all_text_contents())
        page.wait_for_timeout(250)
    pytest.fail(f"a cell did not finish within {CELL_S} s: {cell.text_content()[:300]!r}")


def test_without_chromium_the_test_skips_with_one_line(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(pytest.skip.Exception) as skipped:
        _skip_without_browser()
    message = str(skipped.value)
    assert "\n" not in message and message.startswith("no browser to drive: chromium") and "apt-get" in message


@pytest.mark.slow
def test_lesson_00_in_a_real_browser(tmp_path):
    _skip_without_browser()
    from playwright.sync_api import sync_playwright

    walk = _walkthrough()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "lesson00_in_chromium.png"
    shot.unlink(missing_ok=True)
    port, token = _free_port(), secrets.token_hex(16)
    base = f"http://127.0.0.1:{port}"
    clock, phases = time.monotonic(), {}

    def phase(name: str) -> None:
        nonlocal clock
        phases[name] = time.monotonic() - clock
        clock = time.monotonic()

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    lab = _start_lab(tmp_path, port, token)
    started: set[int] = {lab.pid}
    try:
        with sync_playwright() as playwright:  # chromium starts while the lab does
            browser = playwright.chromium.launch_persistent_context(
                str(tmp_path / "chromium-profile"), executable_path=_chromium(), headless=True,
                args=CHROMIUM_FLAGS, viewport={"width": 1280, "height": 900})
            started |= {p.pid for p in me.children(recursive=True)} - before
            page = browser.pages[0] if browser.pages else browser.new_page()
            phase("chromium started")
            _wait_for_lab(lab, base, token, tmp_path / "lab.log")
            phase("lab started")
            assert walk.lab_setting(base, token, "@jupyterlab/docmanager-extension:plugin", "autosave") is False
            page.set_default_timeout(PAGE_S * 1000)
            try:
                walk.open_from_file_browser(page, base, token, NOTEBOOK)
                started |= {p.pid for p in me.children(recursive=True)} - before  # the kernel
                walk.menu(page, "Edit", "Clear Outputs of All Cells")  # what appears next comes from this run
                phase("lesson 00 opened, kernel idle")

                _run_cell(page, walk, 1)  # %load_ext course_lib
                ranks = _run_cell(page, walk, 3)  # the first %%torchrun -n 2 cell
                started |= {p.pid for p in me.children(recursive=True)} - before
                phase("first multi-rank cell")
                assert "[torchrun] 2 ranks, backend gloo on cpu" in ranks, ranks
                for rank in (0, 1):
                    assert re.search(rf"\[rank {rank}\] rank {rank} of 2: after\s+all_reduce 3\.0", ranks), ranks

                _run_cell(page, walk, 5)  # the check against one process
                figure_cell = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell").nth(7)
                drawn = _run_cell(page, walk, 7)  # cl.show_collective: a matplotlib figure
                assert "reduction found in the values: sum" in drawn, drawn
                image = figure_cell.locator(".jp-OutputArea-output img").first
                image.wait_for(state="visible")
                assert image.evaluate("img => img.complete && img.naturalWidth > 100"), "the figure did not render"
                phase("figure")

                # An ipywidgets control: a new cell below, typed as a learner would.
                page.keyboard.press("Escape")
                page.keyboard.press("b")
                page.keyboard.press("Enter")
                page.keyboard.type('import ipywidgets; ipywidgets.IntSlider(value=3, max=8, description="ranks")')
                new_cell = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell",
                                        has_text="ipywidgets.IntSlider").first
                page.keyboard.press("Shift+Enter")
                text = _wait_done(page, walk, new_cell)
                assert "Error displaying widget" not in text and "model not found" not in text, text
                slider = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output .widget-slider")
                slider.first.wait_for(state="visible")
                assert slider.first.locator(".widget-readout").inner_text().strip() == "3"
                slider.first.scroll_into_view_if_needed()
                phase("widget")
            finally:
                page.screenshot(path=str(shot))
                walk.shut_down_kernels(base, token, NOTEBOOK)
                browser.close()
        started |= {p.pid for p in me.children(recursive=True)} - before
    finally:
        started |= {p.pid for p in me.children(recursive=True)} - before
        left = _stop(started, lab)
        phase("stopped")
        print("browser test, seconds per step:", ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    assert shot.stat().st_size > 10_000
    assert not left, f"still running after the test stopped them: {left}"
