# pdserve developer entry points. Quickstart: `make run`, `make test`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= Once upon a time
MAX_TOKENS ?= 32

.PHONY: install run test lint unit bench lock clean proto

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; install Python 3.11 or run 'make PYTHON=python3 ...'"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

run: install
	$(VENV)/bin/pdserve generate "$(PROMPT)" --max-tokens $(MAX_TOKENS)
	@echo
	@echo "pdserve is installed in $(VENV). Try:"
	@echo "  $(VENV)/bin/pdserve generate 'your prompt' --max-tokens 64"
	@echo "  $(VENV)/bin/pdserve generate 'hello' --chat --temperature 0.8 --seed 1"
	@echo "  $(VENV)/bin/pdserve generate 'hello' --model /path/to/hf-llama-dir"

# Regenerate pdserve/v1/ (stubs and .pyi) from proto/; tests/unit/test_proto.py fails when stale.
proto: install
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) -m grpc_tools.protoc -Iproto --python_out=. \
	  --grpc_python_out=. --mypy_out=. --mypy_grpc_out=. proto/pdserve/v1/*.proto

lint: install
	$(VENV)/bin/ruff check pdserve services tests benchmarks
	$(VENV)/bin/ruff format --check pdserve services tests benchmarks
	$(VENV)/bin/mypy --strict pdserve services

unit: install
	$(VENV)/bin/pytest tests/unit -q

test: lint
	$(VENV)/bin/pytest -q

bench: install
	$(PY) benchmarks/kvcache_ops.py
	$(PY) benchmarks/engine_throughput.py

lock: install
	{ echo "# Exact versions installed by 'make install' (pip constraints). Regenerate with 'make lock'."; \
	  $(PY) -m pip freeze --exclude-editable | sed 's/^torch==\([0-9.]*\)+.*/torch==\1/'; } > constraints.txt

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
