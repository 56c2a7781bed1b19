#!/usr/bin/env bash
# The relay's Debian package (`make test-package` runs it after the extension's): builds it
# (scripts/package_relay.sh), checks what it holds, then runs the packaged program from the
# unpacked archive against a database of this machine's PostgreSQL where the packaged plain-SQL
# install script ran (a scratch database, dropped at the end) and this machine's RabbitMQ: three
# committed messages must leave the outbox, and SIGTERM must stop it with status 0.
#
# Nothing is installed on the system (dpkg -x into a temporary directory). Environment: PGHOST,
# PGPORT, PGUSER as libpq takes them (default: 127.0.0.1, 5432, postgres); AMQP_HOST (default
# 127.0.0.1, port 5672, guest/guest).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

"$ROOT/scripts/package_relay.sh"
VERSION="$(dpkg-parsechangelog -l "$ROOT/packaging/debian/changelog" -S Version)"
DEB="$ROOT/target/package/amqp-outbox-relay_${VERSION}_$(dpkg --print-architecture).deb"
[ -f "$DEB" ] || die "no $DEB"

failures=()
check() {
    local what=$1
    shift
    if "$@"; then note "ok: $what"; else note "FAILED: $what"; failures+=("$what"); fi
}

say "The archive"
contents="$(dpkg-deb --contents "$DEB")"
for f in ./usr/bin/amqp-outbox-relay ./lib/systemd/system/amqp-outbox-relay.service \
    ./etc/amqp-outbox-relay/relay.toml "./usr/share/amqp-outbox-relay/amqp_outbox_hosted--$VERSION.sql" \
    ./usr/share/doc/amqp-outbox-relay/copyright ./usr/share/doc/amqp-outbox-relay/changelog.gz \
    ./usr/share/doc/amqp-outbox-relay/relay.md.gz; do
    check "holds $f" grep -q " $f\$" <<<"$contents"
done
check "every file is root's" bash -c '! grep -v " root/root " <<<"$1" | grep -q .' _ "$contents"
check "the configuration is a conffile" bash -c 'dpkg-deb --info "$1" conffiles | grep -qx /etc/amqp-outbox-relay/relay.toml' _ "$DEB"

UNPACKED="$(mktemp -d)"
DB="amqp_outbox_relay_pkg_$$"
export PGHOST="${PGHOST:-127.0.0.1}" PGPORT="${PGPORT:-5432}" PGUSER="${PGUSER:-postgres}"
RELAY_PID=
cleanup() {
    if [ -n "$RELAY_PID" ]; then kill -9 "$RELAY_PID" 2>/dev/null || true; fi
    psql -qX -d postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true
    if command -v rabbitmqctl >/dev/null 2>&1; then
        for q in ${QUEUE:-} ${ACK_QUEUE:-}; do rabbitmqctl -q delete_queue "$q" >/dev/null 2>&1 || true; done
    fi
    rm -rf "$UNPACKED"
}
trap cleanup EXIT
dpkg -x "$DEB" "$UNPACKED"
BIN="$UNPACKED/usr/bin/amqp-outbox-relay"
check "--version says $VERSION" bash -c '"$1" --version | grep -qx "amqp-outbox-relay $2"' _ "$BIN" "$VERSION"
check "the SQL script is the repository's" cmp -s "$UNPACKED/usr/share/amqp-outbox-relay/amqp_outbox_hosted--$VERSION.sql" \
    "$ROOT/sql/hosted/amqp_outbox_hosted--$VERSION.sql"
for update in "$ROOT"/sql/hosted/amqp_outbox_hosted--*--*.sql; do
    [ -f "$update" ] || continue
    check "the update script $(basename "$update") is the repository's" \
        cmp -s "$UNPACKED/usr/share/amqp-outbox-relay/$(basename "$update")" "$update"
done
check "the example configuration is valid (it serves the database given)" \
    "$BIN" --config "$UNPACKED/etc/amqp-outbox-relay/relay.toml" --database postgresql://x@127.0.0.1/y --check
if command -v systemd-analyze >/dev/null 2>&1; then
    check "the unit passes systemd-analyze verify" bash -c \
        'systemd-analyze verify "$1" 2>&1 | grep -v "amqp-outbox-relay: No such file\|Command /usr/bin" | grep -q . && exit 1 || exit 0' \
        _ "$UNPACKED/lib/systemd/system/amqp-outbox-relay.service"
else
    note "systemd-analyze not found: the unit is not verified"
fi

say "The packaged relay delivers"
psql -qX -v ON_ERROR_STOP=1 -d postgres -c "CREATE DATABASE $DB" >/dev/null
PGOPTIONS="-c client_min_messages=warning" psql -qX -v ON_ERROR_STOP=1 -d "$DB" -f "$UNPACKED/usr/share/amqp-outbox-relay/amqp_outbox_hosted--$VERSION.sql" >/dev/null
# A queue of its own (not durable), declared by the relay; both it and the relay's
# acknowledgement queue are deleted at the end when rabbitmqctl is at hand.
QUEUE="amqp_outbox_relay_pkg_$$"
psql -qX -v ON_ERROR_STOP=1 -d "$DB" >/dev/null <<SQL
INSERT INTO amqp.broker (broker_id, host) VALUES (1, '${AMQP_HOST:-127.0.0.1}');
SELECT amqp.queue_declare(1, '$QUEUE', durable => false);
SELECT amqp.publish(1, '', '$QUEUE', 'package test ' || g) FROM generate_series(1, 3) g;
SQL
ACK_QUEUE="$(psql -qXAt -d "$DB" -c 'SELECT ack_queue FROM amqp.worker_status')"
LOG="$UNPACKED/relay.log"
"$BIN" --database "postgresql://$PGUSER@$PGHOST:$PGPORT/$DB" 2>"$LOG" &
RELAY_PID=$!
left=3
for _ in $(seq 1 100); do
    left="$(psql -qXAt -d "$DB" -c 'SELECT count(*) FROM amqp.message')"
    [ "$left" = 0 ] && break
    sleep 0.2
done
check "three committed messages delivered and deleted (left: $left)" test "$left" = 0
kill -TERM "$RELAY_PID"
status=0
wait "$RELAY_PID" || status=$?
RELAY_PID=
check "SIGTERM: exit status 0 (got $status)" test "$status" = 0
if [ ${#failures[@]} -gt 0 ]; then
    sed 's/^/    relay: /' "$LOG"
    die "the relay's package: ${#failures[@]} check(s) failed: ${failures[*]}"
fi
say "The relay's package: all checks passed"
