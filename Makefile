# Every target that runs code first makes sure .venv exists and matches setup.cfg, with the
# tested versions of constraints.txt (setup.cfg states the ranges the project supports).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RECIPE ?= cifar
ARGS ?=
REV ?= HEAD

.PHONY: train test test-slow test-reliability bench bench-gpu bench-tracker bench-instructions bench-versus bench-extra mutate mutate-extra lint lr-plot tensorboard clean

PIP_INSTALL := $(PY) -m pip install -q -c constraints.txt

$(STAMP): setup.cfg pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP_INSTALL) -e '.[dev]'
	@touch $(STAMP)

# A run stopped by Ctrl-C, SIGTERM or SIGUSR1 (exit 130, 143 or 138) has saved its step and
# printed the command that continues it: not a make error. The trap keeps the shell waiting for the run when the
# signal reaches the whole process group (Ctrl-C does), instead of ending before it. Make gets
# that Ctrl-C too and, once the run has ended, exits by it (130): no makefile can stop that.
train: $(STAMP)
	$(info $(PY) -m recipes $(RECIPE) $(ARGS))
	@trap : INT TERM; $(PY) -m recipes $(RECIPE) $(ARGS) || { code=$$?; \
		[ $$code -eq 130 ] || [ $$code -eq 143 ] || [ $$code -eq 138 ] || exit $$code; }

# The fast suite, on two workers (pytest-xdist: one a core); the kill/corrupt/signal suite
# (tests/reliability) is test-reliability's, so that CI, which runs both, runs each test once.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "not slow and not reliability"

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# Every recipe's core, and for cifar every variant (tests/reliability/conftest.py says which),
# on two workers: each child process trains on one thread.
test-reliability: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "not (slow and other_recipes)" tests/reliability

# Installs the bench extra (PyTorch Lightning and airbench, compared arms) and the mlflow extra
# (the tracker's cost) when one is missing.
bench-extra: $(STAMP)
	@$(PY) -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ('pytorch_lightning', 'airbench', 'mlflow')))" \
		|| $(PIP_INSTALL) -e '.[dev,bench,mlflow]'

# Writes docs/benchmarks.md; about 10-15 minutes on a quiet 2-core CPU, so not part of `make test`.
# On a CUDA machine it includes the GPU section: the CIFAR recipe against airbench94.
bench: bench-extra
	$(PY) -m benchmarks --out docs/benchmarks.md

# One table on a CUDA machine in under 8 minutes (benchmarks/tools/gpu_table.py), also written
# into docs/performance.md. On a bare GPU machine without .venv, with the interpreter there:
# `source .gpu/env.sh && make bench-gpu PY=python3` (no install: PY is not the venv's).
# BENCH_GPU_ARGS=--dry-run runs its CPU parts at toy sizes instead; COMMIT=<hash> names the
# commit where git is absent (the GPU machine receives the tree, not its history).
BENCH_GPU_ARGS ?=
COMMIT ?=
bench-gpu: $(if $(filter $(VENV)/bin/python,$(PY)),bench-extra)
	$(PY) -m benchmarks.tools.gpu_table --doc docs/performance.md $(if $(COMMIT),--commit $(COMMIT)) $(BENCH_GPU_ARGS)

# The MLflow tracker's per-iteration cost alone (section 1, tiny model; no Lightning needed),
# into runs/benchmarks-tracker.md.
bench-tracker: $(STAMP)
	@$(PY) -c "import importlib.util as u, sys; sys.exit(u.find_spec('mlflow') is None)" \
		|| $(PIP_INSTALL) -e '.[dev,mlflow]'
	$(PY) -m benchmarks --only tracker

# Instructions per iteration of the tiny-model arms under valgrind's callgrind (needs valgrind
# and cc): the overhead figures that load on a shared machine does not move; about 8 minutes.
bench-instructions: $(STAMP)
	$(PY) -m benchmarks.tools.instructions

# Before/after: the trainer arms of REV (default HEAD) against the working tree's, side by side
# in one process on the tiny model (about a minute).
bench-versus: $(STAMP)
	$(PY) -m benchmarks.tools.versus $(REV)

# Installs the mutate extra (mutmut) when it is missing.
mutate-extra: $(STAMP)
	@$(PY) -c "import importlib.util as u, sys; sys.exit(u.find_spec('mutmut') is None)" \
		|| $(PIP_INSTALL) -e '.[dev,mutate]'

# Mutation testing of the engine, the checkpoint and resume code and the data order with the
# tests that cover them ([mutmut] in setup.cfg, docs/mutation.md); tens of minutes on 2 cores,
# so not part of `make test`. From scratch each time: mutmut keeps a surviving mutant's verdict
# even after a new test would kill it. Then `mutmut results` lists the survivors and
# `mutmut show NAME` prints one as a diff.
MUTATE_JOBS ?= 2
mutate: mutate-extra
	rm -rf mutants
	nice -n 10 $(VENV)/bin/mutmut run --max-children $(MUTATE_JOBS)
	$(VENV)/bin/mutmut results

lr-plot: $(STAMP)
	$(PY) -m recipes.tools.lr_plot --out runs/lr_schedules.png

# Serves runs/ on the loopback interface only; open http://127.0.0.1:$(TB_PORT)
TB_PORT ?= 6006
tensorboard: $(STAMP)
	$(VENV)/bin/tensorboard --logdir runs --host 127.0.0.1 --port $(TB_PORT)

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) *.egg-info
