# Every target that runs code first makes sure .venv exists and matches setup.cfg.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RECIPE ?= cifar
ARGS ?=

.PHONY: train test test-slow test-reliability bench lint lr-plot tensorboard clean

$(STAMP): setup.cfg pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

train: $(STAMP)
	$(PY) -m recipes $(RECIPE) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

test-reliability: $(STAMP)
	$(PY) -m pytest -q -m "reliability or not reliability" tests/reliability

# Writes docs/benchmarks.md; about 10-15 minutes on a quiet 2-core CPU, so not part of `make test`.
# Installs the bench extra (PyTorch Lightning, one of the compared arms) when it is missing.
bench: $(STAMP)
	@$(PY) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('pytorch_lightning') is None)" \
		|| $(PY) -m pip install -q -e '.[dev,bench]'
	$(PY) -m benchmarks --out docs/benchmarks.md

lr-plot: $(STAMP)
	$(PY) -m recipes.lr_plot --out runs/lr_schedules.png

# Serves runs/ on the loopback interface only; open http://127.0.0.1:$(TB_PORT)
TB_PORT ?= 6006
tensorboard: $(STAMP)
	$(VENV)/bin/tensorboard --logdir runs --host 127.0.0.1 --port $(TB_PORT)

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) *.egg-info
