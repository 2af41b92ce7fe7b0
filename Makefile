# Two commands for a fresh machine (Python 3.11, nothing installed):
#   make demo   -> creates .venv, installs lossscale with the demo extra, runs the quick demo
#   make test   -> creates .venv, installs lossscale with the dev, demo, lightning, accelerate and transformers
#                  extras, runs the test suite (the integration tests run the real frameworks)
#   make check  -> the same .venv; the type checker (mypy, on src/) and ruff's lint and format check
#   make docs   -> .venv with the docs extra (and the frameworks, for the integrations' pages); builds the site in
#                  docs/_build/html with every warning an error, then checks its pages, links and API entries
#   make wheel  -> builds the sdist and wheel (copies in dist/), installs the wheel into a fresh venv in a temporary
#                  folder with its declared dependencies only, and checks it there (.ci/wheel_check.sh)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is pinned for the set-up: on these machines 2.13.0 is a CPU build on local disk,
# any other version downloads a multi-GB CUDA build. The package itself asks for torch>=2.6.
# --no-compile: pip would byte-compile all of torch's thousands of modules at install; Python compiles the
# few a run imports on first use instead, and caches them: PYTHONDONTWRITEBYTECODE, if the environment sets
# it, is unset for these commands, or every process (demo workers, test subprocesses) would compile torch
# again. pip is used as the venv ships it (no upgrade: one download less).
TORCH  ?= torch==2.13.0
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test check docs wheel venv bench clean

$(VENV)/.installed-%: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile "$(TORCH)"
	$(PY) -m pip install --quiet --no-compile -e ".[$*]" "$(TORCH)"
	touch $@

demo: $(VENV)/.installed-demo
	$(PY) -m lossscale demo --quick --out demo-out

test: $(VENV)/.installed-dev,demo,lightning,accelerate,transformers
	$(PY) -m pytest

# the same extras as test (one .venv): mypy reads the optional frameworks' own types where they are installed
check: $(VENV)/.installed-dev,demo,lightning,accelerate,transformers
	$(PY) -m mypy
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m ruff format --check src tests benchmarks examples

# a fresh build every time (-E: every page read again), so that no warning hides in a cached page
docs: $(VENV)/.installed-docs,lightning,accelerate,transformers
	rm -rf docs/_build
	$(PY) -m sphinx -E -W --keep-going -n -q -b html docs docs/_build/html
	$(PY) tests/docs_site_check.py docs/_build/html

wheel:
	PYTHON="$(PYTHON)" TORCH="$(TORCH)" bash .ci/wheel_check.sh

bench: $(VENV)/.installed-dev,demo,lightning,accelerate,transformers
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) demo-out docs/_build dist
