"""`make lab` serves the repository root (lessons link to exercises/ and solutions/) and opens lesson 00."""

from __future__ import annotations

import os
import pathlib
import re
import shlex

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_make_lab_serves_the_repository_root_and_opens_lesson_00():
    from jupyter_server.serverapp import ServerApp

    args = shlex.split(re.search(r"^LAB_ARGS := (.*)$", (ROOT / "Makefile").read_text(), re.M).group(1))
    cwd = os.getcwd()
    os.chdir(ROOT)  # make runs it from the repository root
    try:
        app = ServerApp()
        app.parse_command_line(args)
        root_dir, file_to_run = app.root_dir, app.file_to_run
    finally:
        os.chdir(cwd)
    assert pathlib.Path(root_dir) == ROOT
    assert (ROOT / file_to_run).resolve() == ROOT / "notebooks" / "00_setup.ipynb"
    for folder in ("notebooks", "exercises", "solutions"):
        assert (pathlib.Path(root_dir) / folder).is_dir()
