# `make demo` runs the main job, `make test` the tests (what CI runs), `make bench` the benchmarks,
# `make docs` the documentation site. Each first sets up .venv on a fresh machine (python3.11
# venv, torch, the package editable) with what it needs: `make demo` only the demo's matplotlib
# (the `[examples]` extra), the others every extra (`make install`).
# `make test` runs the main suite in .venv (`make test-main`), then the torchrl interop tests in
# .venv-torchrl (`make test-torchrl`), where torchrl (the newest the registry offers for this
# torch) is installed first and rlcollect second, as a torchrl user would; `pip check` must be
# clean there.

PYTHON ?= python3.11
# Another interpreter gets a venv of its own (`make demo PYTHON=python3.12`: .venv-python3.12), so
# that it never silently reuses the 3.11 one.
VENV := $(if $(filter python3.11,$(PYTHON)),.venv,.venv-$(notdir $(PYTHON)))
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The venv with pip and torch (no rlcollect yet): what `make demo` and `make install` build on; each
# then installs the package editable once, with the extras it needs.
STAMP_BASE := $(VENV)/.base
STAMP_DEMO := $(VENV)/.demo
# Pinned, and installed first on its own: this version's CPU wheel is on local disk, while an
# unpinned torch (asked for by our own dependencies) pulls a multi-GB CUDA build.
TORCH := torch==2.13.0
# Where pip looks for torch besides its configured index: e.g. TORCH_INDEX=https://download.pytorch.org/whl/cpu
# for the CPU build on a machine without the local wheel (a Python other than 3.11, for one).
TORCH_INDEX ?=
TORCH_FLAGS := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))

VENV_TORCHRL := .venv-torchrl
PY_TORCHRL := $(VENV_TORCHRL)/bin/python
STAMP_TORCHRL := $(VENV_TORCHRL)/.installed

.PHONY: install test test-loaded lint docs docs-serve test-main test-fast test-doctest test-torchrl demo bench dist release

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# pip 25.1 or newer: `pip show` prints the license (License-Expression, tests/test_packaging.py).
PIP_MIN := pip>=25.1

# pip runs quietly; each step says what it installs first (the torch wheel alone is ~190 MB).
# pip byte-compiles what it installs (its default; torch: ~29 s against 8.5 s without, quiet). Not
# --no-compile: where PYTHONDONTWRITEBYTECODE is set (it is in this project's sandbox and CI),
# Python then never writes a .pyc, and every process that imports torch compiles it from source
# again: 10.2 CPU-s to import torch, tensordict and gymnasium against 3.9 s with .pyc files
# (2026-12-07, 14:40 UTC, load 9-30), paid by every worker and node the tests and the demo start.
# That took the CI run from 27 to 58 min (stop 31 against 2942a65, where --no-compile came in).
PIP_INSTALL = -m pip install --quiet
$(STAMP_BASE): pyproject.toml | $(PY)
	@echo "[$(VENV)] pip: upgrading pip ($(PIP_MIN))"
	$(PY) $(PIP_INSTALL) --upgrade '$(PIP_MIN)'
	@echo "[$(VENV)] pip: installing $(TORCH) (its CPU wheel, 190 MB, where pip finds one: on local disk or at TORCH_INDEX; else PyPI's multi-GB CUDA build)"
	$(PY) $(PIP_INSTALL) $(TORCH_FLAGS) '$(TORCH)'
	touch $(STAMP_BASE)

$(STAMP_DEMO): $(STAMP_BASE)
	@echo "[$(VENV)] pip: installing rlcollect (editable) with its dependencies and matplotlib (the [examples] extra)"
	$(PY) $(PIP_INSTALL) -e '.[examples]'
	touch $(STAMP_DEMO)

$(STAMP): $(STAMP_BASE)
	@echo "[$(VENV)] pip: installing rlcollect (editable) with every extra (tests, docs, envs, ray, loggers, ...)"
	$(PY) $(PIP_INSTALL) -e '.[test,docs,slurm,examples,atari,mujoco,envpool,tensorboard,bench,ray,wandb,mlflow,hydra,marl]'
	touch $(STAMP) $(STAMP_DEMO)

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
DOCTEST_PATHS := rlcollect --ignore=rlcollect/distributed/launch/job_bootstrap.py

# How a long run shows where it is: a line naming each tier as it starts, then one line per test
# file (its name, a dot per test, and [tests done/total] at the end of the line).
PROGRESS := -o console_output_style=count

# The tests, then the docstring examples (run even when a test failed; either fails the target).
# pytest exits with 5 when it collects no test: that is not a failure of the suite.
test-main: $(STAMP)
	@echo "== make test-main [1/2]: the main suite, tests/ in $(VENV) (about 25 min on a quiet 2-core machine) =="
	$(PY) -m pytest $(PROGRESS) tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; rc=0; fi; \
	echo "== make test-main [2/2]: the docstring examples of rlcollect/ =="; \
	$(PY) -m pytest -q --doctest-modules $(DOCTEST_PATHS) || rc=$$?; exit $$rc

# The edit-run loop: the tests that start no process (tests/tiers.py marks the others
# "processes"; in this tier a test that starts one fails), in under two minutes. CI runs all.
test-fast: $(STAMP)
	@echo "== make test-fast: the tests that start no process (-m 'not processes') =="
	$(PY) -m pytest $(PROGRESS) -m "not processes" tests

test-doctest: $(STAMP)
	$(PY) -m pytest -q --doctest-modules $(DOCTEST_PATHS)

$(PY_TORCHRL):
	$(PYTHON) -m venv $(VENV_TORCHRL)

$(STAMP_TORCHRL): pyproject.toml | $(PY_TORCHRL)
	$(PY_TORCHRL) $(PIP_INSTALL) '$(TORCH)'
	$(PY_TORCHRL) $(PIP_INSTALL) torchrl
	$(PY_TORCHRL) $(PIP_INSTALL) -e '.[test,examples,hydra,marl]'  # examples: tests/torchrl runs one; hydra: its configs; marl: bench.marl's torchrl side (VmasEnv, PettingZooWrapper) and the guide's envs
	touch $(STAMP_TORCHRL)

test-torchrl: $(STAMP_TORCHRL)
	$(PY_TORCHRL) -m pip check
	$(PY_TORCHRL) -m pip list 2>/dev/null | grep -E '^(torch|torchrl|tensordict) '
	@echo "== make test-torchrl: the torchrl interop tests, tests/torchrl/ in $(VENV_TORCHRL) (about 3 min) =="
	$(PY_TORCHRL) -m pytest $(PROGRESS) tests/torchrl

demo: $(STAMP_DEMO)
	@echo "[demo] examples/ppo_cartpole.py: importing torch, then 2 workers x 8 envs (a line per batch)"
	$(PY) examples/ppo_cartpole.py --out ppo_cartpole.png

bench: $(STAMP)
	$(PY) -m bench

# `make dist`: the package's sdist and wheel into dist/ (python -m build: the wheel is built from
# the sdist, so a file the sdist lacks fails here), checked by `twine check --strict` (the
# metadata and the README as PyPI would render it). build and twine are in the [test] extra.
VERSION = $(shell sed -n 's/^__version__ = "\(.*\)"$$/\1/p' rlcollect/__init__.py)

dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .
	$(PY) -m twine check --strict dist/*

# `make release`: `make dist`, then tag the commit checked out as v$(VERSION) (rlcollect.__version__).
# Refused when the work tree has uncommitted changes, when CHANGELOG.md has no section for
# the version, or when the tag exists (bump __version__ first). It publishes nothing: push the tag
# (`git push origin v$(VERSION)`) and upload dist/ (`twine upload dist/*`) yourself. Run `make test`
# (CI) on the commit first.
release: $(STAMP)
	@test -z "$$(git status --porcelain --untracked-files=no)" || \
		{ echo "make release: the work tree has uncommitted changes (git status); commit them first"; exit 1; }
	@grep -q '^## \[$(VERSION)\]' CHANGELOG.md || \
		{ echo "make release: CHANGELOG.md has no '## [$(VERSION)]' section; write it first"; exit 1; }
	@! git rev-parse -q --verify "refs/tags/v$(VERSION)" >/dev/null || \
		{ echo "make release: tag v$(VERSION) exists; bump __version__ in rlcollect/__init__.py first"; exit 1; }
	$(MAKE) dist
	git tag -a "v$(VERSION)" -m "rlcollect $(VERSION)"
	@echo "Tagged v$(VERSION) ($$(git rev-parse --short HEAD)). Publish: git push origin v$(VERSION); $(PY) -m twine upload dist/*"
