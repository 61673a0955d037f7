# make lab   install (first time only) and open the course in JupyterLab
# make test  install (first time only) and run every test, notebooks included
# make test-quick  the tests without those marked slow (a loop while editing)
# make exercises  regenerate exercises/ from solutions/ (course authors)
#
# TORCH_SPEC picks the PyTorch build. The default is the version CI tests; another
# gets a venv of its own, so two versions never mix:
#   make test TORCH_SPEC=torch==2.15.0        -> .venv-torch__2.15.0
#   make test TORCH_SPEC=preinstalled         -> .venv-preinstalled, using the torch
#                                                PYTHON already has (a GPU node's build)
PYTHON        ?= python3
DEFAULT_TORCH := torch==2.13.0
TORCH_SPEC    ?= $(DEFAULT_TORCH)
VENV          ?= $(if $(filter $(DEFAULT_TORCH),$(TORCH_SPEC)),.venv,.venv-$(shell printf '%s' '$(TORCH_SPEC)' | tr -c 'A-Za-z0-9._-' '_'))
BIN           := $(VENV)/bin
ifeq ($(TORCH_SPEC),preinstalled)
VENV_FLAGS    := --system-site-packages
INSTALL_TORCH := $(BIN)/python -c "import torch; print('using the preinstalled torch', torch.__version__)"
else
VENV_FLAGS    :=
INSTALL_TORCH := $(BIN)/python -m pip install "$(TORCH_SPEC)"
endif

.PHONY: install lab test test-quick notebooks exercises clean

# Every install also turns on JupyterLab's saving of widget state (course_lib/doctor/lab_settings.py), so a
# notebook the learner saves reopens with its explorers drawn, not "model not found"; other keys of
# an existing overrides.json stay. Cheap and written only when it changes: it runs every time, so
# a venv made before this line gets it too.
LAB_OVERRIDES := $(VENV)/share/jupyter/lab/settings/overrides.json
# JupyterHub's proxy (launch/hub/, tests/test_hub.py), from npm into the venv: see its rule below.
PROXY_SPEC    := configurable-http-proxy@5.3.0
PROXY         := $(VENV)/node_modules/.bin/configurable-http-proxy
install: $(VENV)/.installed $(PROXY)
	$(BIN)/python -m course_lib.doctor.lab_settings $(LAB_OVERRIDES)

# The proxy comes from npm, into the venv ($(VENV)/node_modules): 3-6 s. Without npm, or offline, the
# course works as before: only the hub and its test need it (the test then skips, saying so; in CI it fails).
$(PROXY): | $(VENV)/.installed
	@if command -v npm >/dev/null 2>&1; then \
	  npm install --prefix $(VENV) --no-audit --no-fund --loglevel=error $(PROXY_SPEC) \
	    || echo "make: npm could not install $(PROXY_SPEC): launch/hub/ needs it, nothing else does"; \
	else echo "make: no npm: $(PROXY_SPEC) (launch/hub/'s proxy) not installed; nothing else needs it"; fi

# Torch is installed on its own first so that the package's range (pyproject.toml)
# is already met and pip does not fetch a different build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(INSTALL_TORCH)
	$(BIN)/python -m pip install -e ".[test]"
	touch $@

# As root (workshop containers, cloud notebooks) Jupyter refuses to start without --allow-root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

# The repository root is served (lessons link to exercises/ and solutions/); lesson 00 opens first.
# Without root_dir, Jupyter would serve only the folder of the file it opens.
LAB_ARGS := --ServerApp.root_dir=. notebooks/00_setup.ipynb
lab: install
	HF_HUB_OFFLINE=1 $(BIN)/jupyter lab $(ROOT_FLAG) $(LAB_ARGS)

# Two workers (TEST_WORKERS): the suite's many waits (deadlines, kernel round trips) overlap,
# 13 min -> 9.5 min on 2 cores. --dist loadfile keeps each file, and its module fixtures, on one worker.
TEST_WORKERS ?= 2
test: install
	COURSE_REHEARSE_GPU_NODE=1 HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# While editing: the tests/ folder without the tests marked slow (no notebooks, no benchmarks).
test-quick: install
	COURSE_REHEARSE_GPU_NODE=1 HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not slow" tests/

# Re-execute the lesson and solution notebooks and store their outputs (what nbval compares),
# dropping the per-cell execution timestamps so diffs show only real changes, and the saved widget
# state of a notebook that shows no widget (nbconvert keeps an old one: lessons 02-03 carried 01's). The widget state
# nbconvert stores (store_widget_state, on by default) stays in the notebook: from it JupyterLab
# draws the explorers of a reopened notebook before any cell runs (without it: "model not found").
# Each %reveal writes the answer it measured to tests/reveal_answers/lessonNN.json (tests/test_think_first.py
# checks that no stored output shows it before the learner has predicted).
NB ?= notebooks/*.ipynb solutions/*.ipynb
notebooks: install
	for nb in $(NB); do \
	  (cd "$$(dirname "$$nb")" && HF_HUB_OFFLINE=1 COURSE_REVEAL_ANSWERS=$(CURDIR)/tests/reveal_answers $(CURDIR)/$(BIN)/jupyter nbconvert --to notebook --execute \
	    --inplace --ExecutePreprocessor.timeout=600 "$$(basename "$$nb")") || exit 1; \
	  $(BIN)/python -c "import nbformat, sys; nb = nbformat.read(sys.argv[1], 4); \
	    [c.metadata.pop('execution', None) for c in nb.cells]; \
	    shown = any('application/vnd.jupyter.widget-view+json' in o.get('data', {}) for c in nb.cells for o in c.get('outputs', [])); \
	    shown or nb.metadata.pop('widgets', None); nbformat.write(nb, sys.argv[1])" "$$nb" || exit 1; \
	done

# Regenerate exercises/ from solutions/ (answers replaced by stubs). Never edit
# exercises/ by hand: a test fails when it differs from what this writes.
exercises: install
	$(BIN)/python -m course_lib.grading.authoring

clean:
	rm -rf $(VENV)
