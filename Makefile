# streamdata: the README's two commands are `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo lint test test-slow test-all bench clean

# torch is pinned and installed first: an unpinned torch pulls gigabytes of CUDA wheels.
# constraints.txt pins the versions the suite was last run with: reproducible, and pip
# does not spend minutes backtracking through boto3/botocore releases.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test,bench]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m streamdata demo

lint: $(STAMP)
	$(BIN)/ruff check streamdata tests benchmarks
	$(BIN)/mypy

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m 'slow or not slow'

bench: $(STAMP)
	$(BIN)/python -m benchmarks.latency --quick

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
