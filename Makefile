# epd-pipeline: everyday commands. `make help` lists them.
#
#   make install   .venv with PyTorch (TORCH_SPEC) and the project, editable, with test tools
#   make test      the full suite; services from tests/services.py (env, testcontainers or embedded)
#   make test-tansu  the Tansu pass: what the demo's light broker must do (e2e, faults, layer)
#   make demo      the end-to-end demo on local services
#   make bench     the side-by-side benchmarks
#   make soak      the pipeline under steady load, memory per minute (MINUTES=5 RPS=2)
#   make up/down   the production-like docker compose stack (Apache Kafka, Redis, services)
#   make tools     the pinned helm, promtool and the Kubernetes/KEDA schemas in .tools/ (TOOLS=helm ...)
#   make chart     the Helm chart: helm lint, helm template, schema validation (tests)
#   make vllm-side vLLM 0.33.0's Python code for the contract tests (tools/vllm-side.sh)
#
# Variables: PYTHON (>= 3.11, default python3), VENV (.venv), TORCH_SPEC (torch==2.13.0, the CPU
# wheel on the dev machines; e.g. TORCH_SPEC='torch==2.14.1' for a CUDA build), PYTEST_ARGS,
# TEST_WORKERS (3: the pytest-xdist workers of make test / test-tansu / test-unit; 1 runs serially).

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# Normal verbosity: the header says where the services come from (tests/services.py).
PYTEST_ARGS ?= -ra --durations=10
# Parallel tests (pytest-xdist): each worker is a pytest session with its own broker and Redis
# (tests/services.py), so a fault test's kill or freeze reaches only its own worker; test files
# go to the workers whole (module fixtures start once), the heaviest first (tests/scheduling.py:
# the durations of the last run, from .pytest_cache). TEST_WORKERS=1 runs in one process.
# Three on two cores: much of the suite waits on brokers and processes (README, Development).
TEST_WORKERS ?= 3
XDIST := $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
DEMO_ARGS ?=
BENCH_ARGS ?=
MINUTES ?= 5
RPS ?= 2
SOAK_ARGS ?=
# What `make tools` installs (tools/install-tools.sh names them; the chart and rules tests
# need them).
TOOLS ?= helm k8s-schemas promtool
STATE_DIR ?= .epd

VPY := $(VENV)/bin/python
EPD := $(VENV)/bin/epd
STAMP := $(VENV)/.epd-installed
COMPOSE ?= $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" || echo docker-compose)

.PHONY: help install host-deps test test-tansu test-unit demo bench soak up down services services-down \
	dockerd dockerd-stop lint imports fmt clean tools chart vllm-side

help:
	@sed -n 's/^#   make /  make /p' $(MAKEFILE_LIST)

install: $(STAMP)

# Re-runs only when pyproject.toml changes (or the stamp is deleted).
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || \
		{ echo "make: $(PYTHON) is missing or older than 3.11; run e.g. make PYTHON=python3.11" >&2; exit 1; }
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip
	@# PyTorch first: a plain dependency resolve would fetch a multi-GB CUDA build.
	$(VPY) -m pip install '$(TORCH_SPEC)'
	$(VPY) -m pip install -e '.[test]'
	@touch $@

# redis-server, which the embedded services run, where it is missing: installed from Debian's
# package as root with apt-get; elsewhere a line says what to install (EPD_REDIS_URL may name a
# Redis of your own, so this is not an error).
host-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "make: installing redis-server (apt-get)" >&2; \
			export DEBIAN_FRONTEND=noninteractive; \
			apt-get install -y -qq redis-server >/dev/null 2>&1 || \
				{ apt-get update -qq && apt-get install -y -qq redis-server; }; \
		else \
			echo "make: redis-server not found; install it (Debian/Ubuntu: apt-get install redis-server, macOS: brew install redis) unless EPD_REDIS_URL names a Redis" >&2; \
		fi; }

# Services come from tests/services.py: EPD_KAFKA_BOOTSTRAP/EPD_REDIS_URL if set, else
# testcontainers when a Docker daemon answers (one is started when possible: root + dockerd, and
# left running for the next run; `make dockerd-stop` ends it), else embedded Tansu + redis-server
# processes. EPD_TEST_SERVICES=env|containers|embedded forces one. Pytest's exit code 5 (no
# tests collected) is an error.
# The broker: EPD_TEST_BROKER=apache|tansu|auto (auto, the default: Apache Kafka 4.4 where Java
# 17+ and its jars, or mvn to fetch them once, are at hand; else Tansu). The header says which.
test: install imports host-deps vllm-side
	@docker/ensure-dockerd.sh --pidfile $(STATE_DIR)/dockerd.pid --log $(STATE_DIR)/dockerd.log || \
		echo "make: no Docker daemon; tests run on embedded services (EPD_TEST_SERVICES=containers would fail)" >&2
	@rc=0; $(VPY) -m pytest $(XDIST) $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make: pytest collected no tests" >&2; fi; exit $$rc

# The tests marked `tansu` on the Tansu broker, as processes (what `epd up` runs without Java).
test-tansu: install host-deps
	@rc=0; EPD_TEST_BROKER=tansu EPD_TEST_SERVICES=$${EPD_TEST_TANSU_SERVICES:-embedded} \
		$(VPY) -m pytest $(XDIST) $(PYTEST_ARGS) -m tansu || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make: pytest collected no tests" >&2; fi; exit $$rc

test-unit: install vllm-side
	$(VPY) -m pytest $(XDIST) $(PYTEST_ARGS) tests/unit

demo: install host-deps
	$(EPD) services run -- $(EPD) demo $(DEMO_ARGS)

# The benchmarks measure Apache Kafka with its production JVM (C2, G1), not the fast-start one.
bench: install host-deps
	EPD_KAFKA_JVM_PROFILE=production $(EPD) services run -- $(VPY) -m bench $(BENCH_ARGS)

# Summary JSON on stdout, one line per interval on stderr (see bench/soak.py).
soak: install host-deps
	EPD_KAFKA_JVM_PROFILE=production $(EPD) services run -- $(VPY) -m bench.soak --minutes $(MINUTES) --rps $(RPS) $(SOAK_ARGS)

# Local services only (Tansu + Redis), left running: eval "$$(.venv/bin/epd env)" to use them.
services: install host-deps
	$(EPD) up

services-down:
	@test -x $(EPD) && $(EPD) down || true

dockerd:
	docker/ensure-dockerd.sh --install --pidfile $(STATE_DIR)/dockerd.pid --log $(STATE_DIR)/dockerd.log

dockerd-stop:
	@if [ -f $(STATE_DIR)/dockerd.pid ]; then kill "$$(cat $(STATE_DIR)/dockerd.pid)" 2>/dev/null || true; \
		rm -f $(STATE_DIR)/dockerd.pid; echo "make: dockerd stopped"; fi

# Built or fetched once from the Go module proxy at pinned versions into .tools/; later runs
# find them there. The tests that run them skip without them, except under CI=true. Not a
# prerequisite of `make test`: the first promtool build takes minutes.
tools:
	tools/install-tools.sh $(TOOLS)

# vLLM 0.33.0's own Python code for the contract tests (tools/vllm-side.sh: one download, then
# cached); where it cannot be had, those tests skip saying why (CI runs the script itself and
# fails without it).
vllm-side: install
	@PYTHON=$(VPY) tools/vllm-side.sh >/dev/null || \
		echo "make: vLLM $(shell sed -n 's/^VLLM_VERSION=//p' tools/vllm-side.sh) not assembled; its contract tests skip" >&2

chart: install tools
	$(VPY) -m pytest $(PYTEST_ARGS) tests/unit/test_helm_chart.py

up:
	$(COMPOSE) up -d --build

down:
	$(COMPOSE) down

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# The floors contract (pyproject.toml [tool.importlinter]): every import points down.
imports: install
	$(VENV)/bin/lint-imports

fmt: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean: services-down
	rm -rf $(STATE_DIR) $(STAMP) .pytest_cache .ruff_cache .mypy_cache build
