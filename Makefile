# The README's two commands: `make train` (the main job on the real corpus) and `make test` (every test;
# `make test-unit`: the unit tier alone, no process launch and no training job, tests/conftest.py).
PY := .venv/bin/python
NPROC ?= 4
TEST_WORKERS ?= 2
ARGS ?=

.PHONY: setup train test test-unit lint
setup:
	@./scripts/setup.sh

# The main job: a small GPT on the shipped Shakespeare corpus, tp 2 x pp 2 on 4 CPU processes (gloo),
# through mptrain.launch (torchrun without its failure report: an error is the workers' one line).
# ARGS come first: Hydra reads its flags (-m, --cfg job) only before the overrides, and an override in
# ARGS (a key or a group such as parallel=tp1pp4) beats the experiment's wherever it stands.
# Ctrl-C: the workers finish the step, save, print one line; the shell's trap keeps sh from dying of
# the SIGINT itself and `|| [ $? -eq 130 ]` keeps make from adding its own line: make then ends by
# the SIGINT it received, so the shell reports 130.
train: setup
	@trap : INT; OMP_NUM_THREADS=1 MPTRAIN_WORLD_SIZE_FLAG=NPROC $(PY) -m mptrain.launch --standalone --nproc_per_node=$(NPROC) \
		-m mptrain.train $(ARGS) experiment=shakespeare_cpu || [ $$? -eq 130 ]

# .venv/fp8-site: torchao for precision=fp8's tests, kept out of the venv itself (scripts/setup.sh says why)
# TEST_WORKERS: pytest-xdist workers, one test file at a time each (most tests run one process; two workers keep both
# of a 2-core machine busy); TEST_WORKERS=0 runs the suite in this one process. PYTHONDONTWRITEBYTECODE cleared: the
# suite's fresh interpreters (launchers, the wheel's commands) then read mptrain's cached bytecode, not its sources.
PYTEST = PYTHONDONTWRITEBYTECODE= PYTHONPATH=.venv/fp8-site OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: setup
	$(PYTEST) tests

test-unit: setup
	$(PYTEST) -m "not integration" tests

# ruff, configured in pyproject.toml
lint: setup
	.venv/bin/ruff check .
