# Two commands on a fresh machine: `make serve` and `make test` (see README.md).
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first and pinned: its CPU build installs from the local index; an unpinned torch pulls CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install serve test lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/shoal serve $(SERVE_ARGS)

test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check runtime kernels tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
