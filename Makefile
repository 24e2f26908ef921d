# Entry points for a fresh machine with Python 3.11, in the order a newcomer runs them:
#   make survey  — the main job: create .venv (torch 2.13.0 CPU and the project), run the quick comparative
#                  survey and write its report
#   make test-fast — the fast tier: single-process tests and a few multi-rank cases (tests/README.md)
#   make test    — the whole suite, what CI runs: the venv plus Horovod; lint (ruff, mypy); the docs site
#                  (mkdocs --strict); every test
#   make docs    — the documentation site from docs/ into site/ (--strict: a broken link or stale reference fails)
#   make gpu-check — on a machine with a GPU: CUDA tests, GPU benchmarks and a short training run, one report under
#                  docs/results/ (scripts/gpu_check.py; a CUDA build of torch, cu128, when nvidia-smi is present;
#                  with a CUDA torch already installed: `python scripts/gpu_check.py`)
# Every package is pinned by constraints.txt (build tools included), so a release upstream cannot break a fresh
# machine. torch's build is chosen explicitly: TORCH=cpu (default) or a CUDA tag, e.g. `make TORCH=cu128 test`.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= cpu
TORCH_VERSION := 2.13.0
TORCH_INDEX   ?= https://download.pytorch.org/whl/$(TORCH)
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1

$(VENV)/.installed: pyproject.toml constraints.txt
	$(shell command -v $(PYTHON) || echo python3) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	@# the wheel your pip configuration offers, else PyTorch's own index for that build
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)+$(TORCH)" 2>/dev/null \
	  || $(PY) -m pip install -q "torch==$(TORCH_VERSION)+$(TORCH)" --extra-index-url $(TORCH_INDEX)
	$(PY) -m pip install -q --no-build-isolation -e '.[test,survey,lint,docs]'
	touch $@
	@echo "venv ready: '. $(VENV)/bin/activate' puts grace-dgc, torchrun and pytest on PATH"

venv: $(VENV)/.installed

horovod: venv
	scripts/install-horovod.sh $(PY)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# the whole suite: on TEST_WORKERS processes, a test file per worker (pytest-xdist: a multi-rank case mostly waits on
# its ranks, so two share 2 cores well), then the cases marked `alone` (they time a fault or measure the machine's
# load) with nothing beside them; prints the slowest tests and each folder's time against its budget
# (docs/development.md)
TEST_WORKERS ?= 2
test: venv horovod lint docs
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not alone" --durations=25
	$(PY) -m pytest -q -m alone --durations=5

# every single-process test and the multi-rank cases marked fast (each part, each way in): minutes, for
# the edit-test loop; `make test` stays the suite that guards main
test-fast: venv
	GRACE_PROPERTY_EXAMPLES=$${GRACE_PROPERTY_EXAMPLES:-20} $(PY) -m pytest -q --fast --durations=10

# one-line mutations of the data path and the parts; each must make the fast tier fail (scripts/mutate.py)
mutate: venv
	$(PY) scripts/mutate.py

docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

docs-serve: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

gpu-check: TORCH = $(if $(shell command -v nvidia-smi),cu128,cpu)
gpu-check: venv
	$(PY) scripts/gpu_check.py

survey: venv
	$(VENV)/bin/grace-dgc list
	$(VENV)/bin/grace-dgc survey --preset quick --out runs/quick
	@echo "report: runs/quick/report.md (plots: runs/quick/*.png)"

.PHONY: venv horovod lint test test-fast mutate docs docs-serve survey gpu-check
