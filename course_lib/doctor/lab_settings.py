"""Make JupyterLab store widget state when a notebook is saved, and not ask about news: settings overrides in the venv.

    .venv/bin/python -m course_lib.doctor.lab_settings .venv/share/jupyter/lab/settings/overrides.json   # make install

A notebook saved without its widgets' state shows "Error displaying widget:
model not found" for each explorer when it is reopened, until the cell runs
again. The widget manager (jupyterlab_widgets) stores that state on save only
when its `saveState` setting is on (default off); JupyterLab takes defaults
for any setting from `overrides.json` in its app settings directory,
`<venv>/share/jupyter/lab/settings/`. The learner can still turn it off in
Settings > Jupyter Widgets.

On a fresh machine JupyterLab also opens a "Would you like to get notified
about official Jupyter news?" toast over the first lesson while its
`fetchNews` setting is "none" (ask); the override makes it "false" (never),
which the learner can change in Settings > Notifications.
"""

from __future__ import annotations

import json
import pathlib
import sys

__all__ = ["NEWS_PLUGIN", "PLUGIN", "write_overrides"]

# The plugin's settings id: jupyterlab_widgets ships its schema as
# schemas/@jupyter-widgets/jupyterlab-manager/plugin.json (property "saveState").
PLUGIN = "@jupyter-widgets/jupyterlab-manager:plugin"
# JupyterLab's schemas/@jupyterlab/apputils-extension/notification.json: property "fetchNews",
# "true" (always), "false" (never) or "none" (the default: ask, with the toast).
NEWS_PLUGIN = "@jupyterlab/apputils-extension:notification"


def write_overrides(path: str | pathlib.Path) -> dict:
    """Turn `saveState` on and, unless the file already says, `fetchNews` off in the overrides file at `path`,
    keeping every other key; return its content.

    The file is written only when this changes it, so `make install` may run it every time.
    """
    path = pathlib.Path(path)
    current = json.loads(path.read_text()) if path.exists() else {}
    wanted = {**current, PLUGIN: {**current.get(PLUGIN, {}), "saveState": True},
              NEWS_PLUGIN: {"fetchNews": "false", **current.get(NEWS_PLUGIN, {})}}
    if wanted != current:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(wanted, indent=2) + "\n")
        print(f"{path}: JupyterLab saves widget state with each notebook and does not ask about Jupyter news")
    return wanted


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m course_lib.doctor.lab_settings <venv>/share/jupyter/lab/settings/overrides.json")
    write_overrides(sys.argv[1])
