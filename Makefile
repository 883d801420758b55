# `make demo` runs the main job, `make test` the tests, `make bench` the benchmarks.
# Each first sets up .venv on a fresh machine (python3.11 venv, torch, the package editable).

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Pinned, and installed first on its own: this version's CPU wheel is on local disk, while an
# unpinned torch (asked for by our own dependencies) pulls a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: install test demo bench

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet '$(TORCH)'
	$(PY) -m pip install --quiet -e '.[test,atari,mujoco,envpool]'
	touch $(STAMP)

# pytest exits with 5 when it collects no test: that is not a failure of the suite.
test: $(STAMP)
	$(PY) -m pytest -q tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$rc

demo: $(STAMP)
	$(PY) examples/ppo_cartpole.py --out ppo_cartpole.png

bench: $(STAMP)
	$(PY) -m bench
