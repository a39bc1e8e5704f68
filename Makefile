# Two entry points (see README.md):  make lab   and   make test
# Both create ./.venv on first use (and again whenever pyproject.toml changes).
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
BIN := $(VENV)/bin

.PHONY: setup lab train test bench doctor student lab-student clean-venv

setup: $(VENV)/.installed

# setuptools prints a boxed "Editable installation" warning for every `pip install -e`: about
# folders named like the package shadowing it, which this checkout's layout never has.
QUIET_EDITABLE := PYTHONWARNINGS="ignore:Editable installation"

# torch is pinned first so pip does not pick an arbitrary (possibly multi-GB) build;
# the rest comes from pyproject.toml, with the test tools of the `dev` extra, notebook 19's
# jax (the `tpu` extra) and notebook 22's torchft (the `ft` extra).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)"
	$(QUIET_EDITABLE) $(BIN)/python -m pip install -q -e ".[dev,tpu,ft]"
	touch $@

# Jupyter refuses to run as root unless told; containers and lab machines often are root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)

# On its first start JupyterLab asks in a pop-up whether to fetch Jupyter news, right over the
# notebook's plots. configs/jupyterlab/overrides.json answers "no" (fetchNews "false", no update
# checks) as a default the learner can still change under Settings. LAB_ARGS passes more options:
#   make lab LAB_ARGS="--ip 0.0.0.0 --port 8888"     (a lab node, reached from your browser)
LAB_ARGS ?=

# The workbook is a working copy of notebooks/ (solutions in) that git ignores: running and editing
# notebooks never touches a tracked file, and `git pull` never meets a learner's outputs. Each
# `make lab` adds new notebooks and updates the ones not edited there; an edited one is kept.
WORKBOOK ?= workbook

lab: setup  ## the workbook: (re)write workbook/ from notebooks/, then JupyterLab on it
	$(BIN)/python -m titanlite.tools.course.editions --workbook notebooks $(WORKBOOK)
	$(BIN)/jupyter lab $(ROOT_FLAG) "--LabApp.app_settings_dir=$(CURDIR)/configs/jupyterlab" $(LAB_ARGS) $(WORKBOOK)/

train: setup  ## the quick training run, headless
	$(BIN)/titanlite train --config configs/debug.toml

# nbgrader (the `course` extra) for the tests only: tests/test_nbgrader.py generates and autogrades
# a lab with it. `make lab` stays without it: its menus and server warnings are for instructors.
$(VENV)/.course: $(VENV)/.installed
	$(QUIET_EDITABLE) $(BIN)/python -m pip install -q -e ".[dev,tpu,ft,course]"
	touch $@

test: setup $(VENV)/.course  ## the whole test suite (notebooks in smoke scale, the browser check included)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n 2 --dist worksteal  # two at a time: see README, "The suite's clock"

doctor: setup  ## self-check this machine's device: writes runs/doctor/report.md (attach it to bug reports)
	$(BIN)/titanlite doctor

# The student edition: solutions stripped (by nbgrader's ClearSolutions when installed, else by
# titanlite's stripper). Run again after a `git pull`: it adds new notebooks and updates the ones
# the student has not edited; an edited one is never replaced (it is listed, with how to get a
# fresh copy). It refuses, in one line, any folder but a new, empty or student-edition one.
STUDENT ?= student

student: setup  ## the student edition in student/ (your answers there are never overwritten)
	$(BIN)/python -m titanlite.tools.course.editions notebooks $(STUDENT)
	@echo "open it: make lab-student   (JupyterLab on $(STUDENT)/, with make lab's settings)"

lab-student: setup  ## the student edition: (re)write student/, then JupyterLab on it, as make lab
	$(BIN)/python -m titanlite.tools.course.editions notebooks $(STUDENT)
	$(BIN)/jupyter lab $(ROOT_FLAG) "--LabApp.app_settings_dir=$(CURDIR)/configs/jupyterlab" $(LAB_ARGS) $(STUDENT)/

bench: setup
	$(BIN)/python bench/bench_vs_hf.py

clean-venv:
	rm -rf $(VENV)
