"""`make install` turns on JupyterLab's saving of widget state and turns off its news toast
(course_lib/doctor/lab_settings.py), as JupyterLab reads them.

The install recipe's own command lines, taken from the Makefile, run against a
temporary venv folder; jupyterlab_server, which serves JupyterLab its settings,
must then report `saveState` on for the widget manager (off without the file)
and `fetchNews` "false" for the notifications (without the file "none": ask, with a toast).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

from course_lib.doctor.lab_settings import NEWS_PLUGIN, PLUGIN

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAKEFILE = (ROOT / "Makefile").read_text()


def _run_install_recipe(venv: pathlib.Path) -> None:
    """The `install` rule's command lines, with $(VENV) a temporary folder and $(BIN)/python this Python."""
    match = re.search(r"^install:.*\n((?:\t.*\n)+)", MAKEFILE, re.M)
    assert match, "the install rule has no recipe: nothing writes overrides.json"
    recipe = match.group(1).splitlines()
    variables = {"LAB_OVERRIDES": re.search(r"^LAB_OVERRIDES := (.*)$", MAKEFILE, re.M).group(1)}
    for line in recipe:
        line = line.strip().replace("$(LAB_OVERRIDES)", variables["LAB_OVERRIDES"])
        line = line.replace("$(BIN)/python", sys.executable).replace("$(VENV)", str(venv))
        assert "$(" not in line, line  # a variable this test does not know: teach it
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        subprocess.run(shlex.split(line), cwd=ROOT, env=env, check=True, capture_output=True)


def _save_state_default(settings_dir: pathlib.Path) -> bool:
    """What JupyterLab's settings API gives the widget manager as `saveState`'s default, given its app settings dir."""
    from jupyterlab_server.settings_utils import get_settings

    labextensions = os.path.join(sys.prefix, "share", "jupyter", "labextensions")
    found, _ = get_settings(str(settings_dir), str(settings_dir / "no-schemas"), str(settings_dir / "no-user"),
                            schema_name=PLUGIN, labextensions_path=[labextensions])
    return found["schema"]["properties"]["saveState"]["default"]


def _fetch_news_default(settings_dir: pathlib.Path) -> str:
    """`fetchNews`'s default as JupyterLab's settings API serves it, from JupyterLab's own schema folder."""
    from jupyterlab.labapp import LabApp
    from jupyterlab_server.settings_utils import get_settings

    schemas = LabApp().schemas_dir  # <venv>/share/jupyter/lab/schemas: the installed JupyterLab's
    found, _ = get_settings(str(settings_dir), schemas, str(settings_dir / "no-user"), schema_name=NEWS_PLUGIN)
    return found["schema"]["properties"]["fetchNews"]["default"]


def test_make_install_turns_on_saving_widget_state_and_keeps_other_overrides(tmp_path):
    settings = tmp_path / "share" / "jupyter" / "lab" / "settings"
    assert _save_state_default(settings) is False  # jupyterlab_widgets' own default: state not saved
    assert _fetch_news_default(settings) == "none"  # JupyterLab's: ask, with a toast over the first lesson
    settings.mkdir(parents=True)
    theme = {"@jupyterlab/apputils-extension:themes": {"theme": "JupyterLab Dark"}}
    (settings / "overrides.json").write_text(json.dumps(theme))
    _run_install_recipe(tmp_path)
    assert json.loads((settings / "overrides.json").read_text()) == {
        **theme, PLUGIN: {"saveState": True}, NEWS_PLUGIN: {"fetchNews": "false"}}
    assert _save_state_default(settings) is True  # what JupyterLab will use
    assert _fetch_news_default(settings) == "false"  # never: no toast
    before = (settings / "overrides.json").stat().st_mtime_ns
    _run_install_recipe(tmp_path)  # every `make install` runs it: the second time changes nothing
    assert (settings / "overrides.json").stat().st_mtime_ns == before


def test_the_overrides_file_is_where_jupyterlab_looks_in_the_venv():
    from jupyterlab.labapp import LabApp

    path = re.search(r"^LAB_OVERRIDES := (.*)$", MAKEFILE, re.M).group(1).replace("$(VENV)", sys.prefix)
    if os.environ.get("JUPYTERLAB_DIR"):  # an app dir moved elsewhere on purpose: nothing to compare
        return
    assert pathlib.Path(path) == pathlib.Path(LabApp().app_settings_dir) / "overrides.json"


def test_notebooks_target_keeps_the_widget_state_nbconvert_stores():
    from nbclient import NotebookClient

    recipe = re.search(r"^notebooks:.*\n((?:\t.*\n)+)", MAKEFILE, re.M).group(1)
    assert "nbconvert" in recipe and "store_widget_state" not in recipe
    assert NotebookClient.store_widget_state.default_value is True  # nbconvert's ExecutePreprocessor is one


def test_notebooks_target_drops_widget_state_only_from_a_notebook_that_shows_no_widget(tmp_path):
    """The recipe's clean-up (after nbconvert) keeps a shown widget's state and drops state nothing shows."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook, new_output

    recipe = re.search(r"^notebooks:.*\n((?:\t.*\n)+)", MAKEFILE, re.M).group(1)
    code = re.search(r'python -c "(.*?)" "\$\$nb"', recipe.replace("\\\n\t", " "), re.S).group(1)
    state = {"application/vnd.jupyter.widget-state+json": {"state": {"m1": {}}, "version_major": 2}}
    view = new_output("display_data", data={"application/vnd.jupyter.widget-view+json": {"model_id": "m1"},
                                            "text/plain": "w"})
    for name, outputs, kept in (("shows.ipynb", [view], True), ("none.ipynb", [], False)):
        path = tmp_path / name
        nbformat.write(new_notebook(cells=[new_code_cell("x", outputs=outputs)], metadata={"widgets": state}), path)
        subprocess.run([sys.executable, "-c", code.replace("$$", "$"), str(path)], check=True)
        assert ("widgets" in nbformat.read(path, as_version=4).metadata) is kept, name
