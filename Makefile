# amqp_outbox — one entry point for building, installing and testing.
#
#   make                 build the extension (release)
#   make install         install it into the PostgreSQL that PG_CONFIG names
#   make install-test    install a test build (with the fault-injection settings the e2e tests set)
#   make installcheck    SQL contract tests (pg_regress, private temporary instance)
#   make installcheck-hosted  the same contract against the plain-SQL install (sql/hosted/)
#   make test            make lint, then every tier: install-test, installcheck, broker unit
#                        tests, end-to-end tests (including the fast fault-injection cases of
#                        tests/tests/faults/), then test-package and test-package-relay
#   make test PG=17      the same against another PostgreSQL major (15 to 18; 16-18 are private
#                        installs under .pg/ that scripts/pg_versions.sh fetches)
#   make test-versions   on each of PostgreSQL 15-18 (PG_VERSIONS): install-test, installcheck and
#                        a representative end-to-end subset (E2E_SUBSET); test-pg-upgrade when 18
#                        is among them; then a table
#   make test-pg-upgrade pg_upgrade of a cluster with the extension and messages waiting, from
#                        UPGRADE_FROM (default 15-wheel) to UPGRADE_TO (default 18)
#   make package         the Debian package target/package/postgresql-15-amqp-outbox_<version>_<arch>.deb
#                        (a user's release build, no fault-injection; sources in packaging/debian/);
#                        make package PG=17: postgresql-17-amqp-outbox_…, in Debian's layout for 17;
#                        and the relay's, amqp-outbox-relay_<version>_<arch>.deb (packaging/relay/)
#   make test-package    builds the package, installs it with apt-get, checks its files, runs
#                        installcheck against it, removes and purges it; puts back the build that
#                        was installed before (needs root or sudo). With PG=16..18 (no Debian
#                        package of that PostgreSQL here): checks the archive, installs its files
#                        into a copy of .pg/<major>, installcheck and a delivery there
#   make test-package-relay  builds the relay's package, checks its files, runs the packaged
#                        relay against a scratch database of this machine's PostgreSQL
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
# PG=16 (15, 16, 17 or 18) selects a PostgreSQL major instead: 15 is the system's (Debian's
# packages, scripts/setup.sh), 16-18 private installs under .pg/ that scripts/pg_versions.sh
# fetches (checksum-verified) the first time. `make test PG=17` runs every tier against it with
# private clusters; without PG, PG_CONFIG decides as before.
PG ?=
ifneq ($(PG),)
override PG_CONFIG := $(shell scripts/pg_versions.sh pg-config $(PG))
ifeq ($(PG_CONFIG),)
$(error scripts/pg_versions.sh found no pg_config for PG=$(PG) (supported: 15 16 17 18))
endif
endif
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
.PHONY: sql all build install install-test installcheck installcheck-hosted test test-unit test-broker test-e2e test-e2e-subset test-versions test-pg-upgrade fmt lint run stop clean package test-package test-package-relay

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
GENERATED_UPDATES := sql/amqp_outbox--0.12.0--0.13.0.sql
sql: $(GENERATED_UPDATES)
	python3 scripts/hosted_sql.py
sql/amqp_outbox--0.12.0--0.13.0.sql: sql/upgrade/0.12.0--0.13.0.head.sql sql/monitor_pass.sql sql/monitor_open.sql sql/monitor_summary.sql
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

# The plain-SQL install for hosted PostgreSQL (sql/hosted/): pg_regress in a temporary instance
# with nothing preloaded, the shared contract tests and the hosted-only ones. Needs no build.
installcheck-hosted:
	PG_CONFIG=$(PG_CONFIG_REAL) scripts/installcheck_hosted.sh

# The extension's pure-Rust logic (no server needed).
# (With PG=NN, the extension's unit tests are built with that version's pgrx feature.)
test-unit:
	$(CARGO) test -p amqp_outbox --lib $(if $(PG),--no-default-features --features pg$(PG))
	$(CARGO) test -p amqp_outbox_engine
	$(CARGO) test -p amqp_outbox_relay --lib --test cli
	$(CARGO) test -p amqp_outbox_bench

test-broker:
	$(CARGO) test -p amqp_outbox_broker

# The PostgreSQL that PG_CONFIG (or PG) names, as every other tier.
test-e2e:
	PG_CONFIG=$(PG_CONFIG_REAL) $(CARGO) test -p amqp_outbox_e2e

# The Debian package for the PostgreSQL that PG_CONFIG names (scripts/package.sh says what it holds).
package:
	PG_CONFIG=$(PG_CONFIG_REAL) CARGO="$(CARGO)" scripts/package.sh
	CARGO="$(CARGO)" scripts/package_relay.sh

# Installs over the files install-test put there; scripts/package_test.sh saves and restores them.
test-package:
	PG_CONFIG=$(PG_CONFIG_REAL) CARGO="$(CARGO)" scripts/package_test.sh

# The relay's package (one for every PostgreSQL): its files, and the packaged program delivering
# from a scratch database of this machine's PostgreSQL.
test-package-relay:
	CARGO="$(CARGO)" scripts/package_relay_test.sh

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
TEST_TIERS := test-unit installcheck installcheck-hosted test-broker test-e2e test-package test-package-relay
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

# Every supported major (PG_VERSIONS): install a test build into it, pg_regress, a representative
# end-to-end subset (E2E_SUBSET: publish and rollback, a killed worker, a broker stopped
# mid-stream, a poison message, a subscription, consume_once, the launcher, dump and restore, the
# updates from 0.1.0 and to 0.8.0, the wait events), each against private clusters of that
# version, then the package test
# (test-package: for 16-18 without apt, see scripts/package_test_private.sh); then
# test-pg-upgrade when UPGRADE_TO is among them. A table of tier, version and duration at the
# end; a failed install skips that version's other tiers.
# (For 15 the install goes into the system's PostgreSQL, and its package test installs the
# package with apt, as `make test` does.)
PG_VERSIONS ?= 15 16 17 18
E2E_SUBSET_TESTS := --test worker --test inbox --test launcher --test lifecycle --test wait_events
E2E_SUBSET := committed_message_arrives_once_with_properties_and_headers rollback_publishes_nothing \
	worker_killed_mid_stream_comes_back_and_nothing_is_lost broker_stop_app_mid_stream_loses_nothing \
	unroutable_message_is_parked_while_later_messages_arrive effects_are_exactly_once_with_duplicates \
	consume_once_race_gives_exactly_one_true every_database_with_the_extension_is_served_and_dropping_one_is_not_blocked \
	dump_and_restore_keep_every_message_its_id_and_the_configuration update_from_the_previous_version_keeps_every_message_and_its_id \
	update_to_0_8_0_keeps_each_handler_by_name each_process_shows_its_own_wait_event_from_postgresql_17
test-e2e-subset:
	PG_CONFIG=$(PG_CONFIG_REAL) $(CARGO) test -p amqp_outbox_e2e $(E2E_SUBSET_TESTS) -- $(E2E_SUBSET)

test-versions:
	@results=; rc=0; \
	for v in $(PG_VERSIONS); do \
		for t in install-test installcheck installcheck-hosted test-e2e-subset test-package; do \
			echo "==> PostgreSQL $$v: make $$t"; start=$$(date +%s); \
			if $(MAKE) --no-print-directory $$t PG=$$v; then st=ok; else st=FAILED; rc=1; fi; \
			results="$$results$$v $$t $$st $$(( $$(date +%s) - start ))s\n"; \
			if [ "$$st" != ok ] && [ "$$t" = install-test ]; then results="$$results$$v (rest skipped)\n"; break; fi; \
		done; \
	done; \
	if echo " $(PG_VERSIONS) " | grep -q " $(UPGRADE_TO) "; then \
		echo "==> pg_upgrade from PostgreSQL $(UPGRADE_FROM) to $(UPGRADE_TO): make test-pg-upgrade"; start=$$(date +%s); \
		if $(MAKE) --no-print-directory test-pg-upgrade; then st=ok; else st=FAILED; rc=1; fi; \
		results="$${results}$(UPGRADE_FROM)->$(UPGRADE_TO) test-pg-upgrade $$st $$(( $$(date +%s) - start ))s\n"; \
	fi; \
	echo; echo "make test-versions:"; printf "$$results" | awk '{ printf "  PostgreSQL %-12s %-17s %-7s %s\n", $$1, $$2, $$3, $$4 }'; \
	exit $$rc

# pg_upgrade from PostgreSQL UPGRADE_FROM to UPGRADE_TO (tests/tests/pg_upgrade.rs): installs a
# test build into both, then upgrades a cluster with the extension, a subscription and messages
# waiting, and checks that every message arrives with its message_id and that the workers run.
# `make test-versions` runs it when UPGRADE_TO is among PG_VERSIONS. UPGRADE_FROM defaults to
# 15-wheel, PostgreSQL 15.19 from the same wheels as 16-18 (scripts/pg_versions.sh): pg_upgrade
# cannot read the system's Debian 15.20 (an attribute option no later version here knows; see
# docs/install.md). UPGRADE_FROM=15 takes the system's, and installs into it.
UPGRADE_FROM ?= 15-wheel
UPGRADE_TO ?= 18
test-pg-upgrade:
	$(MAKE) --no-print-directory install-test PG=$(UPGRADE_FROM)
	$(MAKE) --no-print-directory install-test PG=$(UPGRADE_TO)
	PG_CONFIG="$$(scripts/pg_versions.sh pg-config $(UPGRADE_FROM))" \
	AMQP_OUTBOX_E2E_UPGRADE_TO="$$(scripts/pg_versions.sh pg-config $(UPGRADE_TO))" \
		$(CARGO) test -p amqp_outbox_e2e --test pg_upgrade -- --ignored

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
