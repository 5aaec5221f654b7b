# The two commands of the README: `make example` (DP training on the digits) and `make test`.
# Both install what they need first: torch pinned to the CPU wheel (an open range could pull a
# multi-GB CUDA build), then dpfx in editable mode with its test, example and Hugging Face extras.
PY ?= python3

.PHONY: install example test test-all bench

install: .stamp-install

.stamp-install: pyproject.toml Makefile
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test,examples,hf]"
	touch $@

example: install
	$(PY) examples/train_digits.py

test: install
	$(PY) -m pytest -q -m "not slow"

test-all: install
	$(PY) -m pytest -q

bench: install
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) benchmarks/run.py
