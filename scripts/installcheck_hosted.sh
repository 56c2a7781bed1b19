#!/usr/bin/env bash
# pg_regress against the plain-SQL install (sql/hosted/, for hosted PostgreSQL): a temporary
# instance with nothing preloaded and no extension created, the install script run by a role
# that is not a superuser, then the shared SQL contract tests (pg_regress/sql, the same expected
# output as the extension's, less their CREATE EXTENSION line) and the hosted-only ones
# (pg_regress/hosted).
#
#   HOSTED_REGRESS   the shared tests to run (default below)
#   PG_CONFIG        the PostgreSQL to use
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# The shared tests that hold for both installs, in order.
HOSTED_REGRESS="${HOSTED_REGRESS:-surface publish rollback bad_input broker broker_lookup exchange_declare topology parked views privileges publish_later}"
# The hosted-only tests: the install first.
HOSTED_ONLY="hosted_install hosted_publish"

PG_CONFIG_REAL="$(real_pg_config)"

python3 "$ROOT/scripts/hosted_sql.py"
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -1)"
SCRIPT="$ROOT/sql/hosted/amqp_outbox_hosted--$VERSION.sql"

OUT="$ROOT/pg_regress/hosted"
rm -rf "$OUT/results" "$OUT/regression.diffs" "$OUT/regression.out" "$OUT/log"
WORK="$(mktemp -d /tmp/amqp_outbox-hosted-regress.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/sql" "$WORK/expected"
# pg_regress feeds psql on stdin from $WORK: \ir finds it there.
cp "$SCRIPT" "$WORK/amqp_outbox_hosted.sql"
cp "$OUT"/sql/*.sql "$WORK/sql/"
cp "$OUT"/expected/*.out "$WORK/expected/"
# A shared test runs as written, without its CREATE EXTENSION (the schema is there already).
for t in $HOSTED_REGRESS; do
    grep -vx 'CREATE EXTENSION IF NOT EXISTS amqp_outbox;' "$ROOT/pg_regress/sql/$t.sql" > "$WORK/sql/$t.sql"
    grep -vx 'CREATE EXTENSION IF NOT EXISTS amqp_outbox;' "$ROOT/pg_regress/expected/$t.out" > "$WORK/expected/$t.out"
done
# The extension's test settings, without the library: custom settings exist without it.
grep -v '^shared_preload_libraries' "$ROOT/pg_regress/regress.conf" > "$WORK/regress.conf"
if is_root; then chown -R postgres: "$WORK"; fi

# shellcheck disable=SC2086 # lists of test names
run_pg_regress "$WORK" "$OUT" "hosted installcheck" $HOSTED_ONLY $HOSTED_REGRESS
