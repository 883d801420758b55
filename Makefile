# `make demo` runs the main job, `make test` the tests (what CI runs), `make bench` the benchmarks.
# Each first sets up .venv on a fresh machine (python3.11 venv, torch, the package editable).
# `make test` runs the main suite in .venv (`make test-main`), then the torchrl interop tests in
# .venv-torchrl (`make test-torchrl`), where torchrl (the newest the registry offers for this
# torch) is installed first and rlcollect second, as a torchrl user would; `pip check` must be
# clean there.

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Pinned, and installed first on its own: this version's CPU wheel is on local disk, while an
# unpinned torch (asked for by our own dependencies) pulls a multi-GB CUDA build.
TORCH := torch==2.13.0

VENV_TORCHRL := .venv-torchrl
PY_TORCHRL := $(VENV_TORCHRL)/bin/python
STAMP_TORCHRL := $(VENV_TORCHRL)/.installed

.PHONY: install test test-main test-torchrl demo bench

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet '$(TORCH)'
	$(PY) -m pip install --quiet -e '.[test,atari,mujoco,envpool,tensorboard]'
	touch $(STAMP)

test: test-main test-torchrl

# pytest exits with 5 when it collects no test: that is not a failure of the suite.
test-main: $(STAMP)
	$(PY) -m pytest -q tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$rc

$(PY_TORCHRL):
	$(PYTHON) -m venv $(VENV_TORCHRL)

$(STAMP_TORCHRL): pyproject.toml | $(PY_TORCHRL)
	$(PY_TORCHRL) -m pip install --quiet '$(TORCH)'
	$(PY_TORCHRL) -m pip install --quiet torchrl
	$(PY_TORCHRL) -m pip install --quiet -e '.[test]'
	touch $(STAMP_TORCHRL)

test-torchrl: $(STAMP_TORCHRL)
	$(PY_TORCHRL) -m pip check
	$(PY_TORCHRL) -m pip list 2>/dev/null | grep -E '^(torch|torchrl|tensordict) '
	$(PY_TORCHRL) -m pytest -q tests/torchrl

demo: $(STAMP)
	$(PY) examples/ppo_cartpole.py --out ppo_cartpole.png

bench: $(STAMP)
	$(PY) -m bench
