# Both targets create .venv from pyproject.toml when it is missing (only python3 is needed).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo demo-local lint typecheck pytest bench schema nats-config clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

test: $(STAMP) lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# Two workers (pytest-xdist): most of the suite waits on real servers (NATS elections, lease
# and ack timeouts), so two halve its wall time on a 2-core machine (docs/testing.md).
TEST_WORKERS ?= 2
pytest: $(STAMP)
	$(BIN)/pytest -n $(TEST_WORKERS) --dist worksteal

demo: $(STAMP)
	$(BIN)/python -m load.demo

demo-local: $(STAMP)
	$(BIN)/python -m load.demo_local

schema: $(STAMP)
	$(BIN)/python -m schemas.jsonschema

# The NATS users and permissions deploy/ ships, from the broker ConfigMap (docs/security.md).
nats-config: $(STAMP)
	$(BIN)/muster nats-config deploy/broker/configmap.yaml --cluster east --cluster west \
		> deploy/nats/accounts.conf

bench: $(STAMP)
	$(BIN)/python -m load.bench_core

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
