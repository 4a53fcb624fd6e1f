# The two commands of the README: `make demo` and `make test`. Both set everything up first.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-unit lint up down status

setup:
	@bash ops/scripts/bootstrap.sh

demo: setup
	$(BIN)/gpusched demo

# The whole suite: unit tests, then integration tests against the real local stack.
# pytest exits 5 when no test ran, which fails this target (and CI) too. The tests also
# need promtool (for the alerting rules), which the stack does not.
test: setup
	@bash ops/scripts/install-promtool.sh
	$(BIN)/python -m pytest

test-unit: setup
	@bash ops/scripts/install-promtool.sh
	$(BIN)/python -m pytest tests/unit

lint: setup
	$(BIN)/ruff check .

up: setup
	$(BIN)/gpusched up

down:
	$(BIN)/gpusched down

status:
	$(BIN)/gpusched status
