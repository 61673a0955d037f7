"""Walk through a course notebook in a real (headless) JupyterLab, as a learner would.

    python tests/browser/lab_walkthrough.py notebooks/00_setup.ipynb --shots /tmp/shots/00

Opens the notebook from the file browser, screenshots its stored outputs, runs
Run > Run All Cells, waits for the kernel to be idle (with a deadline),
screenshots every output again, and prints the cells whose output shows an error
and the code cells that did not run. With --sliders, it also moves every widget
slider one step and says whether the widget's image changed. Exit status 1 when
a cell errors, does not run, or the deadline passes.

It needs a running JupyterLab (see tests/browser/README.md) and Chromium. This
script is a tool, not a test (the file name does not start with `test_`);
tests/test_browser.py uses its helpers to walk through lesson 00 in `make test`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import time
import urllib.request

from playwright.sync_api import Page, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeout

# What an output must not contain after Run All (a cell run with --expect-failure
# shows a failure on purpose: the report lists it, the reader judges).
ERROR_PATTERNS = [re.compile(p, re.M) for p in (
    r"Traceback \(most recent call last\)", r"^\w*(Error|Exception)\b.*:", r"Error displaying widget",
    r"model not found")]
IDLE = ".jp-Notebook-ExecutionIndicator[data-status='idle']"


def open_from_file_browser(page: Page, base: str, token: str, notebook: str, ask_news: bool = False) -> None:
    """Load JupyterLab with a fresh workspace and double-click each part of the path in the file browser."""
    page.goto(f"{base}/lab?reset&token={token}")
    page.wait_for_selector(".jp-DirListing-item", timeout=60_000)
    for part in pathlib.PurePosixPath(notebook).parts:
        name = re.compile(f"^{re.escape(part)}$")
        page.locator(".jp-DirListing-itemText", has_text=name).first.dblclick()
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60_000)
    page.wait_for_selector(IDLE, timeout=120_000)  # the kernel has started
    if ask_news:
        dismiss_news(page)  # asked a few seconds after the start
    wait_rendered(page)


def wait_rendered(page: Page, quiet_ms: int = 2_000, deadline_ms: int = 60_000) -> None:
    """Wait until the number of outputs on the page stops changing (JupyterLab renders cells in batches)."""
    outputs = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output")
    last, stable_ms = -1, 0
    for _ in range(deadline_ms // 250):
        count = outputs.count()
        stable_ms = stable_ms + 250 if count == last else 0
        if stable_ms >= quiet_ms:
            return
        last = count
        page.wait_for_timeout(250)


def dismiss_news(page: Page) -> None:
    """Answer JupyterLab's first-start "news?" toast, which otherwise covers the bottom right corner."""
    button = page.locator("button.jp-toast-button[title='No']")
    try:
        button.first.click(timeout=10_000)
    except PlaywrightTimeout:
        pass  # not asked this time


def code_cells(page: Page):
    return page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell")


def screenshot_outputs(page: Page, shots: pathlib.Path, stage: str) -> None:
    """One PNG per code cell that has output (`<stage>_cell<NN>.png`, NN the cell's index among all cells)."""
    cells = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell")
    viewport = page.viewport_size
    for i in range(cells.count()):
        cell = cells.nth(i)
        if "jp-CodeCell" in (cell.get_attribute("class") or "") and cell.locator(".jp-OutputArea-output").count():
            cell.scroll_into_view_if_needed()
            # A cell taller than the notebook's scroll area would be cut: make the window taller for it.
            height = cell.bounding_box()["height"]
            if height > viewport["height"] - 200:
                page.set_viewport_size({"width": viewport["width"], "height": int(height) + 300})
                page.wait_for_timeout(500)  # JupyterLab lays itself out again
                cell.scroll_into_view_if_needed()
            cell.screenshot(path=str(shots / f"{stage}_cell{i:02d}.png"))
            page.set_viewport_size(viewport)


def menu(page: Page, name: str, item: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{name}$")).click()
    page.locator(".lm-Menu-item:not(.lm-mod-hidden)", has_text=re.compile(f"^{item}")).first.click()


def run_all(page: Page, deadline_s: float) -> float | None:
    """Run > Run All Cells; seconds until every cell has run and the kernel is idle, or None at the deadline.

    The outputs are cleared first, which also clears the stored execution counts: a cell left
    without one afterwards did not run (Run All stops at an error).
    """
    menu(page, "Edit", "Clear Outputs of All Cells")
    menu(page, "Run", "Run All Cells")
    start = time.monotonic()
    page.wait_for_timeout(1_000)
    while time.monotonic() - start < deadline_s:
        busy = any(p.strip().startswith("[*]") for p in code_cells(page).locator(".jp-InputPrompt").all_text_contents())
        if not busy and page.locator(IDLE).count():
            return time.monotonic() - start
        page.wait_for_timeout(500)
    return None


def problems(page: Page, after_run: bool) -> tuple[list[str], list[str]]:
    """Code cells whose output matches ERROR_PATTERNS (or, after Run All, that have no execution
    count); and the cells that show an error on purpose (first line has --expect-failure)."""
    found, expected = [], []
    cells = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell")
    for i in range(cells.count()):
        cell = cells.nth(i)
        if "jp-CodeCell" not in (cell.get_attribute("class") or ""):
            continue
        prompt = (cell.locator(".jp-InputPrompt").text_content() or "").strip()
        if after_run and prompt in ("[ ]:", ""):
            found.append(f"cell {i}: not run")
        text = "\n".join(cell.locator(".jp-OutputArea-output").all_text_contents())
        hits = [m.group(0) for p in ERROR_PATTERNS for m in [p.search(text)] if m]
        if hits:
            first = (cell.locator(".jp-InputArea-editor .cm-line").first.text_content() or "").strip()
            (expected if "--expect-failure" in first else found).append(
                f"cell {i} ({first!r}): {', '.join(hits)} [{text.count(chr(10)) + 1} output lines]")
    return found, expected


def report(title: str, page: Page, after_run: bool) -> list[str]:
    """Print what `problems` finds; return the unexpected ones."""
    found, expected = problems(page, after_run)
    print(f"{title}:", *(found or ["no errors"]), *(f"expected: {e}" for e in expected), sep="\n  ")
    return found


def move_sliders(page: Page, shots: pathlib.Path) -> list[str]:
    """Press the right arrow on every widget slider; report whether the image in its widget changed."""
    lines = []
    sliders = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .widget-slider")
    for i in range(sliders.count()):
        box = sliders.nth(i).locator("xpath=ancestor::div[contains(@class,'jp-OutputArea-output')]")
        image = box.locator("img").first
        before = image.get_attribute("src")
        sliders.nth(i).locator(".noUi-handle").first.focus()
        page.keyboard.press("ArrowRight")
        page.wait_for_timeout(2_000)
        after = image.get_attribute("src")
        readout = sliders.nth(i).locator(".widget-readout").inner_text()
        box.screenshot(path=str(shots / f"slider{i}_moved.png"))
        lines.append(f"slider {i}: now {readout}, image {'changed' if after != before else 'DID NOT change'}")
    return lines


def api(base: str, token: str, path: str, method: str = "GET"):
    """One call to the Jupyter server's REST API; its JSON reply."""
    request = urllib.request.Request(f"{base}{path}?token={token}", method=method)
    with urllib.request.urlopen(request) as reply:
        return json.loads(reply.read() or b"null")


def lab_setting(base: str, token: str, plugin: str, key: str):
    """A JupyterLab setting as the lab sees it: the user's value, else the default (overrides.json included)."""
    reply = api(base, token, f"/lab/api/settings/{plugin}")
    return reply["settings"].get(key, reply["schema"]["properties"][key].get("default"))


def shut_down_kernels(base: str, token: str, notebook: str) -> None:
    """Stop the kernel of the notebook's session (and so any ranks it started)."""
    for session in api(base, token, "/api/sessions"):
        if session["path"] == notebook:
            api(base, token, f"/api/sessions/{session['id']}", "DELETE")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", help="path relative to the lab's root, e.g. notebooks/00_setup.ipynb")
    parser.add_argument("--shots", required=True, type=pathlib.Path, help="folder for the screenshots")
    parser.add_argument("--url", default="http://127.0.0.1:8899")
    parser.add_argument("--token", default="T")
    parser.add_argument("--deadline", type=float, default=600, help="seconds Run All may take")
    parser.add_argument("--no-run", action="store_true", help="only screenshot the stored outputs")
    parser.add_argument("--sliders", action="store_true", help="move every widget slider after the run")
    args = parser.parse_args()
    args.shots.mkdir(parents=True, exist_ok=True)
    if lab_setting(args.url, args.token, "@jupyterlab/docmanager-extension:plugin", "autosave"):
        # Run All changes every output; autosave would write them into the repository's notebook.
        sys.exit("JupyterLab's autosave is on: start the lab with the settings in tests/browser/README.md")
    print("widget state saved with the notebook:",
          lab_setting(args.url, args.token, "@jupyter-widgets/jupyterlab-manager:plugin", "saveState"))
    ask_news = lab_setting(args.url, args.token, "@jupyterlab/apputils-extension:notification", "fetchNews") == "none"

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        failed = False
        try:
            open_from_file_browser(page, args.url, args.token, args.notebook, ask_news)
            if page.locator(".lm-TabBar-tab.jp-mod-current.jp-mod-dirty").count():
                print("marked as changed as soon as it opened (closing it asks to save)")
            page.screenshot(path=str(args.shots / "opened.png"))
            trust = page.locator(".jp-StatusItem-trust, [title*='trusted']")
            print("trust:", trust.first.get_attribute("title") if trust.count() else "?",
                  "| live widgets:", page.locator(".jp-OutputArea-output > .jupyter-widgets").count())
            screenshot_outputs(page, args.shots, "stored")
            failed = bool(report("stored outputs", page, after_run=False))
            if not args.no_run:
                seconds = run_all(page, args.deadline)
                print(f"Run All: {'DEADLINE PASSED' if seconds is None else f'{seconds:.0f} s'}")
                screenshot_outputs(page, args.shots, "run")
                failed = bool(report("after Run All", page, after_run=True)) or seconds is None or failed
                for line in move_sliders(page, args.shots) if args.sliders else []:
                    print(line)
        finally:
            page.screenshot(path=str(args.shots / "last.png"))
            browser.close()
            shut_down_kernels(args.url, args.token, args.notebook)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
