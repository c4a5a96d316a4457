# Everything a fresh machine needs, in a virtual environment under .venv.
# torch is installed FIRST and pinned: an unpinned resolve on a machine without torch pulls
# several GB of CUDA packages. Override the pin: make test TORCH_SPEC="torch==2.5.1"
# (or TORCH_SPEC= to keep whatever torch the venv already has).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?= -q
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean

setup: $(VENV)/.probe-installed

$(VENV)/.probe-installed: setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/python -m pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/python -m pip install -q -e '.[test,examples]'
	touch $@

demo: setup
	$(BIN)/python examples/quickstart/run.py

# pytest exit code 5 means "no tests were collected": that is a failure here, not a pass.
test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

bench: setup
	$(BIN)/python bench/dump_overhead.py
	$(BIN)/python bench/compare_speed.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
