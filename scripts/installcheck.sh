#!/usr/bin/env bash
# The SQL contract tests: pg_regress/sql/*.sql against pg_regress/expected/*.out, run by PGXS's
# pg_regress in a private temporary instance (--temp-instance), which is what makes
# shared_preload_libraries = 'amqp_outbox' possible (pg_regress/regress.conf). The extension must
# be installed first (make install).
#
# As root, initdb and pg_regress refuse to run: the suite is copied into a directory the
# `postgres` user owns and runs as that user; results come back into pg_regress/.
#
# Environment: PG_CONFIG (pg_config to use), REGRESS (tests to run, default: all, in order).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

REGRESS="${REGRESS:-surface publish outbox_row rollback bad_input broker broker_lookup exchange_declare topology parked views privileges runs_as settings standbys claim_plan delete_plan inbox reconcile dump publish_later drop}"

PG_CONFIG_REAL="$(real_pg_config)"
PKGLIBDIR="$("$PG_CONFIG_REAL" --pkglibdir)"
SRC="$ROOT/pg_regress"

[ -f "$PKGLIBDIR/amqp_outbox.so" ] || die "amqp_outbox is not installed in $PKGLIBDIR: run make install"

# Where pg_regress works: the checkout itself, or (as root) a copy owned by postgres.
rm -rf "$SRC/results" "$SRC/regression.diffs" "$SRC/regression.out" "$SRC/log"
if is_root; then
    WORK="$(mktemp -d /tmp/amqp_outbox-regress.XXXXXX)"
    trap 'rm -rf "$WORK"' EXIT
    cp -r "$SRC/sql" "$SRC/expected" "$SRC/regress.conf" "$WORK/"
    chown -R postgres: "$WORK"
else
    WORK="$SRC"
fi

# shellcheck disable=SC2086 # REGRESS is a list of test names
run_pg_regress "$WORK" "$SRC" installcheck $REGRESS
