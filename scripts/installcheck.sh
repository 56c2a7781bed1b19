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
BINDIR="$("$PG_CONFIG_REAL" --bindir)"
PKGLIBDIR="$("$PG_CONFIG_REAL" --pkglibdir)"
PG_REGRESS="$PKGLIBDIR/pgxs/src/test/regress/pg_regress"
SRC="$ROOT/pg_regress"

[ -x "$PG_REGRESS" ] || die "pg_regress not found at $PG_REGRESS (PostgreSQL 15: install postgresql-server-dev-15; 16-18: scripts/pg_versions.sh)"
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

# The server's own libraries first: the private installs of scripts/pg_versions.sh were built
# for /opt/postgresql, so their contrib modules (dblink, which broker_lookup uses) would
# otherwise load the system's older libpq (PostgreSQL 17's dblink: undefined PQcancelStart).
LIBDIR="$("$PG_CONFIG_REAL" --libdir)"

status=0
# shellcheck disable=SC2086 # REGRESS is a list of test names
# RUST_BACKTRACE=1 in the server's environment (as a developer's shell often has): errors must
# still reach clients without Rust backtraces (bad_input checks their DETAIL).
(cd "$WORK" && as_pg env RUST_BACKTRACE=1 LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$PG_REGRESS" \
    --bindir="$BINDIR" \
    --inputdir="$WORK" \
    --outputdir="$WORK" \
    --temp-instance="$WORK/tmp_check" \
    --temp-config="$WORK/regress.conf" \
    --dbname=contrib_regression \
    --encoding=UTF8 --no-locale \
    $REGRESS) || status=$?

if [ "$WORK" != "$SRC" ]; then
    for f in results regression.diffs regression.out log; do
        if [ -e "$WORK/$f" ]; then cp -r "$WORK/$f" "$SRC/"; fi
    done
fi
if [ "$status" -ne 0 ]; then
    if [ -s "$SRC/regression.diffs" ]; then
        echo "---- pg_regress/regression.diffs ----"
        cat "$SRC/regression.diffs"
    fi
    log="$SRC/log/postmaster.log"
    if [ -f "$log" ]; then
        echo "---- last lines of the temporary instance's log ----"
        tail -n 40 "$log"
    fi
    die "installcheck failed (pg_regress exit $status); results in pg_regress/results"
fi
rm -rf "$WORK/tmp_check"
