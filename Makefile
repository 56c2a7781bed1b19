# amqp_outbox — one entry point for building, installing and testing.
#
#   make                 build the extension (release)
#   make install         install it into the PostgreSQL that PG_CONFIG names
#   make install-test    install a test build (with the fault-injection settings the e2e tests set)
#   make installcheck    SQL contract tests (pg_regress, private temporary instance)
#   make test            make lint, then every tier: install-test, installcheck, broker unit
#                        tests, end-to-end tests (including the fast fault-injection cases of
#                        tests/tests/faults/), then test-package
#   make package         the Debian package target/package/postgresql-15-amqp-outbox_<version>_<arch>.deb
#                        (a user's release build, no fault-injection; sources in packaging/debian/)
#   make test-package    builds the package, installs it with apt-get, checks its files, runs
#                        installcheck against it, removes and purges it; puts back the build that
#                        was installed before (needs root or sudo)
#   make chaos           every fault-injection case (FAULTS.md), slow ones included, one at
#                        a time, larger volumes (AMQP_OUTBOX_CHAOS_SCALE, default 10), then a table
#   make fmt             cargo fmt --check
#   make lint            scripts/lint.sh: fmt, clippy -D warnings (SAFETY comments), no pgrx in the
#                        AMQP crate, #[pg_guard] on every C entry point, the docs' links and
#                        reference (scripts/docs_check.py)
#   make run / stop      demo: private cluster on port 54329 publishing to local RabbitMQ
#   make bench           benchmarks, quick sizes (under 20 minutes); bench/results/latest.{md,json}
#   make bench-full      benchmarks, full sizes (1,000,000-message backlog, longer runs)
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

# `make sql`: see GENERATED_UPDATES.
.PHONY: sql all build install install-test installcheck test test-unit test-broker test-e2e fmt lint run stop clean package test-package

all: build

build:
	$(CARGO) pgrx package --pg-config $(PG_CONFIG_REAL)

# cargo-pgrx installs the current version's script and the update scripts (A--B); the full
# scripts of earlier versions (kept so that `CREATE EXTENSION ... VERSION` and the update test
# can start from them) are copied here.
# Update scripts that repeat a file of the install script are assembled from it (`make sql`);
# `make lint` checks that the committed result is current.
# Once a version is released its update script is frozen: its rule and its parts in
# sql/upgrade/ go, and the script stays as it was (the install-script files change later).
GENERATED_UPDATES := sql/amqp_outbox--0.6.0--0.7.0.sql
sql: $(GENERATED_UPDATES)
sql/amqp_outbox--0.6.0--0.7.0.sql: sql/upgrade/0.6.0--0.7.0.head.sql sql/health.sql
	cat $^ > $@

OLD_VERSION_SCRIPTS := $(filter-out $(wildcard sql/amqp_outbox--*--*.sql),$(wildcard sql/amqp_outbox--*.sql))

# Cargo features of the installed build: none for a user's build; install-test adds the
# fault-injection settings (amqp_outbox.test_*), which exist in no other build.
CARGO_FEATURES ?=
install:
	$(CARGO) pgrx install --release --pg-config $(PG_CONFIG_REAL) $(if $(CARGO_FEATURES),--features "$(CARGO_FEATURES)") $(PGRX_SUDO)
	$(if $(PGRX_SUDO),sudo )install -m 644 $(OLD_VERSION_SCRIPTS) $(PG_SHAREDIR)/extension/

install-test:
	$(MAKE) --no-print-directory install CARGO_FEATURES=fault-injection

installcheck:
	PG_CONFIG=$(PG_CONFIG_REAL) scripts/installcheck.sh

# The extension's pure-Rust logic (no server needed).
test-unit:
	$(CARGO) test -p amqp_outbox --lib
	$(CARGO) test -p amqp_outbox_bench

test-broker:
	$(CARGO) test -p amqp_outbox_broker

test-e2e:
	$(CARGO) test -p amqp_outbox_e2e

# The Debian package for the PostgreSQL that PG_CONFIG names (scripts/package.sh says what it holds).
package:
	PG_CONFIG=$(PG_CONFIG_REAL) CARGO="$(CARGO)" scripts/package.sh

# Installs over the files install-test put there; scripts/package_test.sh saves and restores them.
test-package:
	PG_CONFIG=$(PG_CONFIG_REAL) CARGO="$(CARGO)" scripts/package_test.sh

# The fault-injection suite (FAULTS.md): every case, slow ones included, one at a time, with
# AMQP_OUTBOX_CHAOS_SCALE times the volumes (case 10: 100k x scale backlog). Each test appends a
# row to target/chaos/results.tsv; the table is printed even when a case fails.
AMQP_OUTBOX_CHAOS_SCALE ?= 10
CHAOS_RESULTS := target/chaos/results.tsv
chaos:
	@mkdir -p $(dir $(CHAOS_RESULTS)); rm -f $(CHAOS_RESULTS); start=$$(date +%s); \
	AMQP_OUTBOX_CHAOS_SCALE=$(AMQP_OUTBOX_CHAOS_SCALE) AMQP_OUTBOX_CHAOS_RESULTS=$(CURDIR)/$(CHAOS_RESULTS) \
		$(CARGO) test -p amqp_outbox_e2e --no-fail-fast --test faults --test ha --test failover -- --include-ignored --test-threads=1; rc=$$?; \
	$(MAKE) --no-print-directory chaos-table; \
	echo "make chaos: $$(( $$(date +%s) - start ))s, scale $(AMQP_OUTBOX_CHAOS_SCALE), exit $$rc"; exit $$rc

chaos-table:
	@echo; echo "Fault-injection results ($(CHAOS_RESULTS)):"; \
	fmt='%-30s %9s %9s %5s %7s %6s %6s %7s %9s %5s %-8s %s\n'; \
	printf "$$fmt" case messages committed lost phantom dups order heal peak-mem left status note; \
	if [ -f $(CHAOS_RESULTS) ]; then \
		awk -F'\t' -v fmt="$$fmt" '{ printf fmt, $$1, $$2, $$3, $$4, $$5, $$6, $$7, $$8, $$9, $$10, $$11, substr($$12, 1, 240) }' $(CHAOS_RESULTS); \
	else echo "(no results)"; fi

# Runs every tier and reports each (with its duration); a failed install skips the rest.
# test-package comes last: it replaces the installed test build for a while (then restores it).
TEST_TIERS := test-unit installcheck test-broker test-e2e test-package
test: lint
	@passed=; failed=; skipped=; installed=; \
	for t in install-test $(TEST_TIERS); do \
		if [ "$$t" != install-test ] && [ -z "$$installed" ]; then skipped="$$skipped $$t"; continue; fi; \
		echo "==> make $$t"; start=$$(date +%s); \
		if $(MAKE) --no-print-directory $$t; then ok=1; else ok=; fi; \
		r="$$t($$(( $$(date +%s) - start ))s)"; \
		if [ -n "$$ok" ]; then passed="$$passed $$r"; else failed="$$failed $$r"; fi; \
		if [ -n "$$ok" ] && [ "$$t" = install-test ]; then installed=1; fi; \
	done; \
	echo; \
	if [ -n "$$failed" ]; then \
		echo "make test: FAILED:$$failed | passed:$${passed:- none} | skipped:$${skipped:- none}"; exit 1; \
	fi; \
	echo "make test: all passed:$$passed"

fmt:
	$(CARGO) fmt --all -- --check

lint:
	CARGO="$(CARGO)" scripts/lint.sh

# Benchmarks (bench/): a private PostgreSQL cluster with the library preloaded and the local
# RabbitMQ at 127.0.0.1:5672. PgQ is the baseline of the publish cost: installed if missing.
PG_MAJOR := $(shell $(PG_CONFIG_REAL) --version 2>/dev/null | sed -E 's/^PostgreSQL ([0-9]+).*/\1/')
PG_SHAREDIR := $(shell $(PG_CONFIG_REAL) --sharedir 2>/dev/null)
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

bench-deps:
	@if [ ! -f "$(PG_SHAREDIR)/extension/pgq.control" ]; then \
		echo "==> installing PgQ (postgresql-$(PG_MAJOR)-pgq3) for the publish-cost baseline"; \
		$(SUDO) apt-get install -y postgresql-$(PG_MAJOR)-pgq3 || \
		{ $(SUDO) apt-get update && $(SUDO) apt-get install -y postgresql-$(PG_MAJOR)-pgq3; }; \
	fi
	@command -v perf >/dev/null || echo "note: perf not found: the profile section is skipped"

bench: install bench-deps
	$(CARGO) build --release -p amqp_outbox_bench
	BENCH_QUICK=$${BENCH_QUICK:-1} PG_CONFIG=$(PG_CONFIG_REAL) $(CARGO) run --release -q -p amqp_outbox_bench

bench-full: install bench-deps
	$(CARGO) build --release -p amqp_outbox_bench
	BENCH_QUICK=0 PG_CONFIG=$(PG_CONFIG_REAL) $(CARGO) run --release -q -p amqp_outbox_bench

run:
	PG_CONFIG=$(PG_CONFIG_REAL) scripts/run.sh

stop:
	PG_CONFIG=$(PG_CONFIG_REAL) scripts/stop.sh

clean:
	$(CARGO) clean
	rm -rf pg_regress/results pg_regress/regression.diffs pg_regress/regression.out pg_regress/tmp_check pg_regress/log
