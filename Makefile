# The commands of the README: `make example` (DP training on the digits), `make lora-example`
# (DP LoRA fine-tuning through Hugging Face's Trainer), `make sft-example` and `make dpo-example`
# (DP SFT and DP DPO through TRL) and `make test`.
# All work from a fresh clone with nothing but python3 (3.10+): the first run makes a virtual
# environment in .venv and installs into it torch pinned to the CPU wheel (an open range could
# pull a multi-GB CUDA build), then dpfx in editable mode with its test, example, Hugging Face
# and TRL extras. `make PY=python3.12` picks the interpreter; `make VENV=/path` another
# environment.
PY ?= python3
VENV ?= .venv
PYTHON := $(VENV)/bin/python
# pytest worker processes for `make test` (pytest-xdist; each test file stays in one worker)
JOBS ?= 2

.PHONY: install example lora-example sft-example dpo-example test test-all bench bench-realistic

install: $(VENV)/.stamp-install

$(VENV)/.stamp-install: pyproject.toml Makefile
	@test -x $(PYTHON) || { echo "creating $(VENV) with $(PY)"; $(PY) -m venv $(VENV); }
	@echo "installing torch 2.13.0 (CPU) and dpfx into $(VENV) (first time: a few minutes)"
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet "torch==2.13.0"
	$(PYTHON) -m pip install --quiet -e ".[test,examples,hf,trl]"
	touch $@

example: install
	$(PYTHON) examples/train_digits.py

lora-example: install
	$(PYTHON) examples/dp_lora_trainer.py

sft-example: install
	$(PYTHON) examples/dp_sft.py

dpo-example: install
	$(PYTHON) examples/dp_dpo.py

test: install
	$(PYTHON) -m pytest -q -m "not slow" -n $(JOBS) --dist loadfile --durations=15

# the slow tests too, every example of each hypothesis sweep and both loss reductions for every
# idiom of the loss corpora (tests/support/sweep.py)
test-all: install
	DPFX_TEST_SWEEP=full $(PYTHON) -m pytest -q -n $(JOBS) --dist loadfile

bench: install
	$(PYTHON) -m pip install --quiet -e ".[bench]"
	$(PYTHON) benchmarks/run.py

# the rows at the sizes DP users train at, short form (benchmarks/README.md)
bench-realistic: install
	$(PYTHON) -m pip install --quiet -e ".[bench]"
	$(PYTHON) benchmarks/run.py --realistic --quick
