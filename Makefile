# One-command set-up on a fresh clone: every target creates .venv when needed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Where the demo keeps its corpus, tokenizer, dataset and checkpoints.
DEMO_DIR ?= runs/demo

.PHONY: setup test test-fast test-next demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of PyTorch first, so the extras' torch range installs nothing more.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# Test files run in TEST_WORKERS processes (pytest-xdist; one file per worker, so module
# fixtures are built once): most of a case's time is single-threaded XLA compilation. Files
# go out heaviest first (tests/durations.json, ordered by tests/conftest.py; xdist's own
# reorder by test count is turned off).
TEST_WORKERS ?= 2

# The whole suite, slow cases included (CI runs exactly this).
test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# Everything but the cases marked slow.
test-fast: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests -m "not slow"

# A subset on Python >= 3.12 and a newer JAX (default: Python 3.13, the newest JAX; JAX_NEXT=0.11.2
# PYTHON_NEXT=3.12 is the GPU image's pair): .ci/test-next, its venvs under build/.
test-next:
	bash .ci/test-next

demo: $(STAMP)
	$(PY) -m jmegatron.tools.demo --workdir $(DEMO_DIR)

clean:
	rm -rf $(VENV) runs build
