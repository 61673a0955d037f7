"""Make JupyterLab store widget state when a notebook is saved: a settings override in the venv.

    .venv/bin/python -m course_lib.doctor.lab_settings .venv/share/jupyter/lab/settings/overrides.json   # make install

A notebook saved without its widgets' state shows "Error displaying widget:
model not found" for each explorer when it is reopened, until the cell runs
again. The widget manager (jupyterlab_widgets) stores that state on save only
when its `saveState` setting is on (default off); JupyterLab takes defaults
for any setting from `overrides.json` in its app settings directory,
`<venv>/share/jupyter/lab/settings/`. The learner can still turn it off in
Settings > Jupyter Widgets.
"""

from __future__ import annotations

import json
import pathlib
import sys

__all__ = ["PLUGIN", "write_overrides"]

# The plugin's settings id: jupyterlab_widgets ships its schema as
# schemas/@jupyter-widgets/jupyterlab-manager/plugin.json (property "saveState").
PLUGIN = "@jupyter-widgets/jupyterlab-manager:plugin"


def write_overrides(path: str | pathlib.Path) -> dict:
    """Turn `saveState` on in the overrides file at `path`, keeping every other key; return its content.

    The file is written only when this changes it, so `make install` may run it every time.
    """
    path = pathlib.Path(path)
    current = json.loads(path.read_text()) if path.exists() else {}
    wanted = {**current, PLUGIN: {**current.get(PLUGIN, {}), "saveState": True}}
    if wanted != current:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(wanted, indent=2) + "\n")
        print(f"{path}: JupyterLab saves widget state with each notebook")
    return wanted


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m course_lib.doctor.lab_settings <venv>/share/jupyter/lab/settings/overrides.json")
    write_overrides(sys.argv[1])
