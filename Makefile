# Two entry points for a fresh machine with Python 3.11:
#   make test    — create .venv, install torch 2.13.0 (CPU), the project, Horovod; lint (ruff, mypy); run the tests
#   make survey  — the main job: the quick comparative survey and its report
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	$(shell command -v $(PYTHON) || echo python3) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,survey,lint]'
	touch $@

venv: $(VENV)/.installed

horovod: venv
	scripts/install-horovod.sh $(PY)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: venv horovod lint
	$(PY) -m pytest -q

survey: venv
	$(VENV)/bin/grace-dgc list
	$(VENV)/bin/grace-dgc survey --preset quick --out runs/quick
	@echo "report: runs/quick/report.md (plots: runs/quick/*.png)"

.PHONY: venv horovod lint test survey
