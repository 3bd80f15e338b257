# Two commands on a fresh machine: `make serve` and `make test` (see README.md).
# `make serve` installs only what serving needs; `make test` adds the dev tools on top (CI: .ci/run).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
# torch first and pinned: its CPU build installs from the local index; an unpinned torch pulls CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
SERVE_STAMP := $(VENV)/.installed-serve
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: install serve test lint clean

# Serving: Shoal and its dependencies, plus the openai client the README's example uses.
$(SERVE_STAMP): pyproject.toml
	@echo "make: installing Shoal for serving into $(VENV) (torch CPU, transformers, ray, openai client; ~2.6 GB, 2-6 min, once)"
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PIP) "$(TORCH_SPEC)"
	@$(PIP) -e . openai
	@touch $@

# Tests and lint: the dev extras (pytest, ruff, hypothesis, playwright, matplotlib, ...) on top.
$(DEV_STAMP): $(SERVE_STAMP)
	@echo "make: installing the test tools into $(VENV) (pytest, ruff, hypothesis, playwright, matplotlib; ~0.3 GB, ~1-2 min, once)"
	@$(PIP) -e ".[dev]"
	@touch $@

install: $(DEV_STAMP)

serve: $(SERVE_STAMP)
	$(VENV)/bin/shoal serve $(SERVE_ARGS)

# Test files run on one worker per core (pytest-xdist; at most 4): most of the suite's time is waiting (Ray and
# server start-ups, streams, timeouts), not computing. A file stays on one worker (its module fixtures are built
# once). PYTEST_ARGS="-n 0" runs serially.
test: $(DEV_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto --maxprocesses=4 --dist loadfile $(PYTEST_ARGS)

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check runtime kernels tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
