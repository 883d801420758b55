# `make demo` runs the main job, `make test` the tests (what CI runs), `make bench` the benchmarks,
# `make docs` the documentation site. Each first sets up .venv on a fresh machine (python3.11
# venv, torch, the package editable) with what it needs: `make demo` only the demo's matplotlib
# (the `[examples]` extra), the others every extra (`make install`).
# `make test` runs the main suite in .venv (`make test-main`), then the torchrl interop tests in
# .venv-torchrl (`make test-torchrl`), where torchrl (the newest the registry offers for this
# torch) is installed first and rlcollect second, as a torchrl user would; `pip check` must be
# clean there.

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The venv with torch and the package alone (no extra): what `make demo` builds on.
STAMP_BASE := $(VENV)/.base
STAMP_DEMO := $(VENV)/.demo
# Pinned, and installed first on its own: this version's CPU wheel is on local disk, while an
# unpinned torch (asked for by our own dependencies) pulls a multi-GB CUDA build.
TORCH := torch==2.13.0

VENV_TORCHRL := .venv-torchrl
PY_TORCHRL := $(VENV_TORCHRL)/bin/python
STAMP_TORCHRL := $(VENV_TORCHRL)/.installed

.PHONY: install test test-loaded lint docs docs-serve test-main test-fast test-doctest test-torchrl demo bench

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# pip 25.1 or newer: `pip show` prints the license (License-Expression, tests/test_packaging.py).
PIP_MIN := pip>=25.1

$(STAMP_BASE): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade '$(PIP_MIN)'
	$(PY) -m pip install --quiet '$(TORCH)'
	$(PY) -m pip install --quiet -e .
	touch $(STAMP_BASE)

$(STAMP_DEMO): $(STAMP_BASE)
	$(PY) -m pip install --quiet -e '.[examples]'
	touch $(STAMP_DEMO)

$(STAMP): $(STAMP_BASE)
	$(PY) -m pip install --quiet -e '.[test,docs,slurm,examples,atari,mujoco,envpool,tensorboard,bench,ray,wandb,mlflow,hydra]'
	touch $(STAMP)

test: lint docs test-main test-torchrl

# `make test` on a loaded machine: 6 CPU-burning processes beside it (load >= 6 on 2 cores), as
# on a shared CI machine with other jobs running. BURN_PROCS=N changes the count.
BURN_PROCS ?= 6
test-loaded:
	$(PYTHON) scripts/burn.py --procs $(BURN_PROCS) -- $(MAKE) test

# ruff, configured in pyproject.toml ([tool.ruff]): the package, tests, benchmarks and examples.
lint: $(STAMP)
	$(PY) -m ruff check .

# The documentation site (mkdocs.yml): the guides of docs/ and an API reference generated from the
# docstrings, into site/. --strict: any warning (a broken link, a docstring mkdocstrings cannot
# read) fails the build. A few seconds; part of `make test`.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

# Every docstring example of the package runs (pytest --doctest-modules); job_bootstrap.py is a
# script run by path, not a module.
DOCTEST_PATHS := rlcollect --ignore=rlcollect/distributed/job_bootstrap.py

# The tests, then the docstring examples (run even when a test failed; either fails the target).
# pytest exits with 5 when it collects no test: that is not a failure of the suite.
test-main: $(STAMP)
	$(PY) -m pytest -q tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; rc=0; fi; \
	$(PY) -m pytest -q --doctest-modules $(DOCTEST_PATHS) || rc=$$?; exit $$rc

# The edit-run loop: the tests that start no process (tests/tiers.py marks the others
# "processes"; in this tier a test that starts one fails), in under two minutes. CI runs all.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not processes" tests

test-doctest: $(STAMP)
	$(PY) -m pytest -q --doctest-modules $(DOCTEST_PATHS)

$(PY_TORCHRL):
	$(PYTHON) -m venv $(VENV_TORCHRL)

$(STAMP_TORCHRL): pyproject.toml | $(PY_TORCHRL)
	$(PY_TORCHRL) -m pip install --quiet '$(TORCH)'
	$(PY_TORCHRL) -m pip install --quiet torchrl
	$(PY_TORCHRL) -m pip install --quiet -e '.[test,examples]'  # examples: tests/torchrl runs one
	touch $(STAMP_TORCHRL)

test-torchrl: $(STAMP_TORCHRL)
	$(PY_TORCHRL) -m pip check
	$(PY_TORCHRL) -m pip list 2>/dev/null | grep -E '^(torch|torchrl|tensordict) '
	$(PY_TORCHRL) -m pytest -q tests/torchrl

demo: $(STAMP_DEMO)
	$(PY) examples/ppo_cartpole.py --out ppo_cartpole.png

bench: $(STAMP)
	$(PY) -m bench
