# The two commands of the README. Each creates .venv and installs what it needs
# when it is missing or older than pyproject.toml / constraints.txt, then runs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint format bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# constraints.txt pins torch to the local CPU wheel so pip never pulls the CUDA build
$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e ".[lightning,keras,dev,mlflow,tensorboard,report]" tensorflow-cpu
	# DeepSpeed, for the tests of Lightning's DeepSpeedStrategy: built against the torch
	# above (no build isolation, which would pull another torch) and with no compiled op
	DS_BUILD_OPS=0 $(BIN)/pip install --quiet --no-build-isolation -c constraints.txt deepspeed
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/lightning_digits.py --fault lr --record runs/demo

test: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/ruff format --check src tests examples benchmarks
	# two processes, a test file each at a time (its module fixtures built once): most tests
	# wait on Python, not on the cores (on 2 cores: 9.7 minutes at 2026-12-03, 3298 tests, the
	# machine otherwise idle; 13.9 with a one-thread benchmark beside it)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

lint format: $(STAMP)
	$(BIN)/ruff check --fix src tests examples benchmarks
	$(BIN)/ruff format src tests examples benchmarks

bench: $(STAMP)
	$(BIN)/python -m benchmarks.overhead
	$(BIN)/python -m benchmarks.keras_overhead

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
