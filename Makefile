# amqp_outbox — one entry point for building, installing and testing.
#
#   make                 build the extension (release)
#   make install         install it into the PostgreSQL that PG_CONFIG names
#   make installcheck    SQL contract tests (pg_regress, private temporary instance)
#   make test            every tier: install, installcheck, broker unit tests, end-to-end tests
#   make fmt lint        cargo fmt --check, cargo clippy -D warnings
#   make run / stop      demo: private cluster on port 54329 publishing to local RabbitMQ
#
# PGXS habits: PG_CONFIG selects the PostgreSQL (make install PG_CONFIG=/path/to/pg_config).

PG_CONFIG ?= pg_config
# Debian's pg_config on the PATH is a wrapper; the real one lives in --bindir.
PG_BINDIR      := $(shell $(PG_CONFIG) --bindir 2>/dev/null)
ifeq ($(PG_BINDIR),)
$(warning $(PG_CONFIG) not found: run scripts/setup.sh, or set PG_CONFIG=/path/to/pg_config)
endif
PG_CONFIG_REAL := $(or $(wildcard $(PG_BINDIR)/pg_config),$(PG_CONFIG))
PG_PKGLIBDIR   := $(shell $(PG_CONFIG_REAL) --pkglibdir 2>/dev/null)

CARGO ?= cargo
# Install as the current user; when that cannot write into PostgreSQL's directories, let
# cargo-pgrx copy the files with sudo (it unlinks the old .so first, which is safe for running
# servers — never `cp` over a loaded .so).
PGRX_SUDO := $(if $(filter 0,$(shell id -u)),,$(if $(shell test -w $(PG_PKGLIBDIR) && echo yes),,--sudo))

.PHONY: all build install installcheck test test-unit test-broker test-e2e fmt lint run stop clean

all: build

build:
	$(CARGO) pgrx package --pg-config $(PG_CONFIG_REAL)

install:
	$(CARGO) pgrx install --release --pg-config $(PG_CONFIG_REAL) $(PGRX_SUDO)

installcheck:
	PG_CONFIG=$(PG_CONFIG_REAL) scripts/installcheck.sh

# The extension's pure-Rust logic (no server needed).
test-unit:
	$(CARGO) test -p amqp_outbox --lib

test-broker:
	$(CARGO) test -p amqp_outbox_broker

test-e2e:
	$(CARGO) test -p amqp_outbox_e2e

# Runs every tier and reports each (with its duration); a failed install skips the rest.
TEST_TIERS := test-unit installcheck test-broker test-e2e
test:
	@passed=; failed=; skipped=; installed=; \
	for t in install $(TEST_TIERS); do \
		if [ "$$t" != install ] && [ -z "$$installed" ]; then skipped="$$skipped $$t"; continue; fi; \
		echo "==> make $$t"; start=$$(date +%s); \
		if $(MAKE) --no-print-directory $$t; then ok=1; else ok=; fi; \
		r="$$t($$(( $$(date +%s) - start ))s)"; \
		if [ -n "$$ok" ]; then passed="$$passed $$r"; else failed="$$failed $$r"; fi; \
		if [ -n "$$ok" ] && [ "$$t" = install ]; then installed=1; fi; \
	done; \
	echo; \
	if [ -n "$$failed" ]; then \
		echo "make test: FAILED:$$failed | passed:$${passed:- none} | skipped:$${skipped:- none}"; exit 1; \
	fi; \
	echo "make test: all passed:$$passed"

fmt:
	$(CARGO) fmt --all -- --check

lint:
	$(CARGO) clippy --workspace --all-targets -- -D warnings

run:
	PG_CONFIG=$(PG_CONFIG_REAL) scripts/run.sh

stop:
	PG_CONFIG=$(PG_CONFIG_REAL) scripts/stop.sh

clean:
	$(CARGO) clean
	rm -rf pg_regress/results pg_regress/regression.diffs pg_regress/regression.out pg_regress/tmp_check pg_regress/log
