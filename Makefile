# Two entry points (see README.md):  make lab   and   make test
# Both create ./.venv on first use (and again whenever pyproject.toml changes).
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
BIN := $(VENV)/bin

.PHONY: setup lab train test bench doctor student clean-venv

setup: $(VENV)/.installed

# torch is pinned first so pip does not pick an arbitrary (possibly multi-GB) build;
# the rest comes from pyproject.toml, with the test tools of the `dev` extra.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

# Jupyter refuses to run as root unless told; containers and lab machines often are root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)

# On its first start JupyterLab asks in a pop-up whether to fetch Jupyter news, right over the
# notebook's plots. configs/jupyterlab/overrides.json answers "no" (fetchNews "false", no update
# checks) as a default the learner can still change under Settings. LAB_ARGS passes more options:
#   make lab LAB_ARGS="--ip 0.0.0.0 --port 8888"     (a lab node, reached from your browser)
LAB_ARGS ?=

lab: setup  ## the workbook: JupyterLab on notebooks/
	$(BIN)/jupyter lab $(ROOT_FLAG) "--LabApp.app_settings_dir=$(CURDIR)/configs/jupyterlab" $(LAB_ARGS) notebooks/

train: setup  ## the quick training run, headless
	$(BIN)/titanlite train --config configs/debug.toml

test: setup  ## the whole test suite (notebooks in smoke scale, the browser check included)
	$(BIN)/python -m pytest

doctor: setup  ## self-check this machine's device: writes runs/doctor/report.md (attach it to bug reports)
	$(BIN)/titanlite doctor

student: setup  ## the student edition in student/: solutions stripped by nbgrader (ClearSolutions) if installed, else by titanlite
	$(BIN)/python -m titanlite.course notebooks student

bench: setup
	$(BIN)/python bench/bench_vs_hf.py

clean-venv:
	rm -rf $(VENV)
