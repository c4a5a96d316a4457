# Everything a fresh machine needs, in a virtual environment under .venv.
# The extras hf and lightning (trainer integrations) are installed like models, torch held.
# torch is installed FIRST and pinned: an unpinned resolve on a machine without torch pulls
# several GB of CUDA packages. Override the pin: make test TORCH_SPEC="torch==2.5.1"
# (or TORCH_SPEC= to keep whatever torch the venv already has). The extras are installed with
# torch held at the installed version (scripts/torch_pins.py), so nothing replaces it.
# Supported: torch 2.4 to 2.15 (docs/torch-versions.md); `make test-matrix` tests the range.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?= -q
# pytest-xdist: one test process per core (PYTEST_XDIST_AUTO_NUM_WORKERS=N to choose), each
# test module whole in one process, in file order (tests/conftest.py resets what a module can
# leave behind), the longest modules handed out first (tests/suite_schedule.py; xdist's
# own reorder, most tests first, is turned off). PYTEST_PARALLEL= runs the suite in one process.
PYTEST_PARALLEL ?= -n auto --dist loadfile --no-loadscope-reorder
# torch versions `make test-matrix` runs the suite on, each in its own venv, deleted after use
MATRIX ?= 2.4.1 2.8.0 2.12.0 2.15.0
BIN := $(VENV)/bin
# Bytecode caches (__pycache__, ignored by git) are written even where the environment sets
# PYTHONDONTWRITEBYTECODE: each test process collects every test file, and compiling them and
# rewriting their asserts again in every process costs seconds each time.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup demo test test-matrix bench clean

setup: $(VENV)/.probe-installed

$(VENV)/.probe-installed: setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/python -m pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/python -m pip install -q -e '.[test,examples,models,hf,lightning,trl,rl]' $$($(BIN)/python scripts/torch_pins.py)
	$(MAKE) --no-print-directory litgpt-into-venv
	touch $@

# litgpt (tests with its tiny GPT) pins an old huggingface-hub; transformers 5 needs a newer
# one. Install litgpt with torch held, then put back the hub version that was there before.
# Only on torch >= 2.7: below it pip finds an older litgpt (0.5.4 on torch 2.4.1) that
# downgrades numpy under pandas and lightning under the lightning tests; its tests skip there.
.PHONY: litgpt-into-venv
litgpt-into-venv:
	@if ! $(BIN)/python -c "import sys, torch; sys.exit(tuple(int(p) for p in torch.__version__.split('+')[0].split('.')[:2]) < (2, 7))"; then \
	  echo "litgpt not installed with torch < 2.7: its tests skip" >&2; exit 0; fi; \
	hub=$$($(BIN)/python -c "from importlib.metadata import version; print(version('huggingface-hub'))"); \
	$(BIN)/python -m pip install -q 'litgpt>=0.5' $$($(BIN)/python scripts/torch_pins.py) \
	  || echo "litgpt not installed with this torch: its tests skip" >&2; \
	$(BIN)/python -m pip install -q "huggingface-hub==$$hub" $$($(BIN)/python scripts/torch_pins.py)

demo: setup
	$(BIN)/python examples/quickstart/run.py

# pytest exit code 5 means "no tests were collected": that is a failure here, not a pass.
# The capture tests also run on the device path (PROBE_DEVICE_PATH=1: CPU tensors take the
# accelerator's path), as modules of their own: tests/capture/*_on_the_device_path.py.
test: setup
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; \
	exit $$rc

# The suite on each torch version of MATRIX, one after another, each in a fresh .venv-<version>
# removed after its run (a CUDA build from PyPI: 5-7 GB; it runs on CPU). Runs them all, then
# fails if any failed.
test-matrix:
	@failed=""; for version in $(MATRIX); do \
	  echo "== torch $$version: make test TORCH_SPEC=torch==$$version VENV=.venv-$$version" >&2; \
	  start=$$(date +%s); \
	  $(MAKE) --no-print-directory test TORCH_SPEC=torch==$$version VENV=.venv-$$version; \
	  rc=$$?; rm -rf .venv-$$version; \
	  echo "== torch $$version: exit $$rc after $$(( $$(date +%s) - start )) s" >&2; \
	  if [ $$rc -ne 0 ]; then failed="$$failed $$version"; fi; \
	done; \
	if [ -n "$$failed" ]; then echo "test-matrix failed on torch$$failed" >&2; exit 1; fi

# The bench extra (mindstudio-probe, for the msprobe columns) with torch held; where it cannot be
# installed the benchmark prints "-" in those columns.
bench: setup
	$(BIN)/python -m pip install -q -e '.[bench]' $$($(BIN)/python scripts/torch_pins.py) \
	  || echo "mindstudio-probe not installed: no msprobe columns" >&2
	$(BIN)/python bench/dump_overhead.py
	$(BIN)/python bench/compare_speed.py

clean:
	rm -rf $(VENV) .venv-* build dist *.egg-info .pytest_cache
