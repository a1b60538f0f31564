# The README's two commands: `make train` (the main job on the real corpus) and `make test`.
PY := .venv/bin/python
TORCHRUN := .venv/bin/torchrun
NPROC ?= 4
ARGS ?=

.PHONY: setup train test
setup:
	@./scripts/setup.sh

# The main job: a small GPT on the shipped Shakespeare corpus, tp 2 x pp 2 on 4 CPU processes (gloo).
train: setup
	OMP_NUM_THREADS=1 $(TORCHRUN) --standalone --nproc_per_node=$(NPROC) train.py experiment=shakespeare_cpu $(ARGS)

test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests
