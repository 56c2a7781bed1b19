#!/usr/bin/env bash
# Run it: set up, build and install amqp_outbox, start a private PostgreSQL cluster with the
# extension preloaded, publish a few messages in committed and rolled-back transactions, and
# watch the worker deliver the committed ones to the local RabbitMQ.
#
# Running it again restarts the cluster (so a freshly built library is loaded) and publishes
# another round. scripts/stop.sh stops it.
#
# Environment:
#   AMQP_OUTBOX_PGPORT   port of the private cluster (default 54329)
#   PG_CONFIG            pg_config of the PostgreSQL to use (default: the one on PATH)
#   AMQP_OUTBOX_NO_BUILD =1 skips setup and make install (use what is installed)
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PGPORT="${AMQP_OUTBOX_PGPORT:-54329}"
DB=amqp_demo
CONSUMER_DB=amqp_demo_billing
ORDERS_EXCHANGE=amqp_demo_orders
ORDERS_QUEUE=amqp_demo_billing_orders
RECEIPTS=amqp_demo_receipts   # the receipts exchange (consumers answer there) and queue
EXCHANGE=amqp_outbox_demo     # fanout exchange, declared through amqp.exchange_declare()
QUEUE=amqp_outbox_demo        # bound to it by demo_queue (below), when that can be done
RUN_DIR="$(run_dir)"
PGDATA="$RUN_DIR/pgdata"
LOG="$RUN_DIR/postgresql.log"

# --- 1. toolchain, build, install -----------------------------------------------------------------
if [ "${AMQP_OUTBOX_NO_BUILD:-}" != 1 ]; then
    mkdir -p "$RUN_DIR"
    # setup.sh writes this file only if it is the one that starts RabbitMQ; stop.sh reads it.
    AMQP_OUTBOX_RABBITMQ_STARTED_FILE="$RUN_DIR/rabbitmq-started-by-run" "$ROOT/scripts/setup.sh"
    say "Building and installing amqp_outbox (release)"
    make -C "$ROOT" --no-print-directory install
fi
PG_CONFIG_REAL="$(real_pg_config)"
BINDIR="$("$PG_CONFIG_REAL" --bindir)"
[ -f "$("$PG_CONFIG_REAL" --pkglibdir)/amqp_outbox.so" ] || die "amqp_outbox is not installed (run make install)"

# --- 2. the private cluster -------------------------------------------------------------------------
say "Private PostgreSQL cluster in $PGDATA (port $PGPORT)"
mkdir -p "$RUN_DIR"
if is_root; then chown postgres: "$RUN_DIR"; fi
if [ ! -f "$PGDATA/PG_VERSION" ]; then
    note "initdb"
    # trust: a private development cluster, reachable only through 127.0.0.1 and a socket in
    # the run directory.
    as_pg "$BINDIR/initdb" -D "$PGDATA" --auth=trust --encoding=UTF8 --no-locale >"$RUN_DIR/initdb.log" 2>&1 \
        || { cat "$RUN_DIR/initdb.log"; die "initdb failed"; }
    echo "include_if_exists = 'amqp_outbox_run.conf'" >>"$PGDATA/postgresql.conf"
fi
# Rewritten on every run, so a changed port takes effect with the restart below.
cat >"$PGDATA/amqp_outbox_run.conf" <<EOF
# Written by scripts/run.sh on each run.
port = $PGPORT
listen_addresses = '127.0.0.1'
unix_socket_directories = '$RUN_DIR'
shared_preload_libraries = 'amqp_outbox'
# Subscriptions answer every message with a receipt there (reconciliation, below).
amqp_outbox.receipts_exchange = '$RECEIPTS'
EOF
if is_root; then chown postgres: "$PGDATA/amqp_outbox_run.conf"; fi

if as_pg "$BINDIR/pg_ctl" -D "$PGDATA" status >/dev/null 2>&1; then
    note "running: restarting it so that the installed library is loaded"
    action=restart
else
    action=start
fi
if ! as_pg "$BINDIR/pg_ctl" -D "$PGDATA" -l "$LOG" -w -t 60 -m fast "$action" >/dev/null; then
    echo "---- last lines of $LOG ----"
    tail -n 30 "$LOG" || true
    die "pg_ctl $action failed"
fi
note "up; log: $LOG"

PGUSER_NAME="$(pg_superuser)"
psql_() { "$BINDIR/psql" -X -q -v ON_ERROR_STOP=1 -h "$RUN_DIR" -p "$PGPORT" -U "$PGUSER_NAME" "$@"; }
sql()   { psql_ -d "$DB" "$@"; }
value() { psql_ -d "$DB" -At -c "$1"; }

# --- 3. database, extension, broker, exchange --------------------------------------------------------
say "Database $DB with the extension"
# A fresh demo database each run, so it always has the extension as just built.
psql_ -d postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)"
psql_ -d postgres -c "CREATE DATABASE $DB"
note "created database $DB (anew on every run)"
sql -c "SET client_min_messages = warning; CREATE EXTENSION IF NOT EXISTS amqp_outbox"
sql <<'EOF'
INSERT INTO amqp.broker (host, port, vhost, username, password)
SELECT '127.0.0.1', 5672, '/', 'guest', 'guest'
 WHERE NOT EXISTS (SELECT FROM amqp.broker WHERE host = '127.0.0.1' AND port = 5672);
EOF
BROKER_ID="$(value "SELECT min(broker_id) FROM amqp.broker WHERE host = '127.0.0.1' AND port = 5672")"
note "broker_id $BROKER_ID = 127.0.0.1:5672 (guest/guest)"
value "SELECT amqp.exchange_declare($BROKER_ID, '$EXCHANGE', 'fanout', false, true)" >/dev/null
note "exchange $EXCHANGE (fanout) recorded; the worker declares it when it connects"

# ---------------------------------------------------------------------------------------------------
# The demo queue: declared through the extension (amqp.queue_declare / amqp.queue_bind record it,
# the worker declares it on its connection); what arrived is read back with rabbitmqctl and
# scripts/amqp_demo.py (python3 standard library only).
# ---------------------------------------------------------------------------------------------------
rabbitmqctl_() {
    if is_root; then rabbitmqctl "$@"; elif command -v sudo >/dev/null 2>&1; then sudo -n rabbitmqctl "$@"; else return 1; fi
}
demo_queue() {
    local py="$ROOT/scripts/amqp_demo.py"
    case "$1" in
    declare)
        value "SELECT amqp.queue_declare($BROKER_ID, '$QUEUE')" >/dev/null
        value "SELECT amqp.queue_bind($BROKER_ID, '$QUEUE', '$EXCHANGE')" >/dev/null
        note "queue $QUEUE bound to $EXCHANGE, recorded; the worker declares both when it connects"
        ;;
    show)
        local depth
        depth="$(rabbitmqctl_ -q list_queues name messages 2>/dev/null | awk -v q="$QUEUE" '$1 == q {print $2}')" || true
        if [ -n "$depth" ]; then
            note "rabbitmqctl list_queues: $QUEUE holds $depth message(s)"
        else
            note "queue $QUEUE not found by rabbitmqctl (not declared, or rabbitmqctl not usable)"
        fi
        if command -v python3 >/dev/null 2>&1; then
            note "consuming them:"
            python3 "$py" drain "$QUEUE" | sed 's/^/      /' || warn "could not read queue $QUEUE"
        fi
        ;;
    esac
}

say "Demo queue"
demo_queue declare

# --- 4. publish --------------------------------------------------------------------------------------
say "Publishing"
STAMP="$(date +%H:%M:%S)"
BEFORE="$(value "SELECT coalesce(max(id), 0) FROM amqp.message")"
WAITING_BEFORE="$(value "SELECT count(*) FROM amqp.message")"
sql -v b="$BROKER_ID" -v ex="$EXCHANGE" -v stamp="$STAMP" <<'EOF'
\set VERBOSITY terse
-- 3 messages in a committed transaction
BEGIN;
SELECT amqp.publish(:b, :'ex', '', :'stamp' || ' committed 1/3') \g /dev/null
SELECT amqp.publish(:b, :'ex', '', :'stamp' || ' committed 2/3') \g /dev/null
SELECT amqp.publish(:b, :'ex', '', :'stamp' || ' committed 3/3') \g /dev/null
COMMIT;
-- 2 messages in a rolled-back transaction
BEGIN;
SELECT amqp.publish(:b, :'ex', '', :'stamp' || ' ROLLED BACK 1/2 (must never arrive)') \g /dev/null
SELECT amqp.publish(:b, :'ex', '', :'stamp' || ' ROLLED BACK 2/2 (must never arrive)') \g /dev/null
ROLLBACK;
-- a committed transaction with 1 message kept and 1 in a rolled-back savepoint
BEGIN;
SELECT amqp.publish(:b, :'ex', '', :'stamp' || ' committed, beside a rolled-back savepoint') \g /dev/null
SAVEPOINT s;
SELECT amqp.publish(:b, :'ex', '', :'stamp' || ' ROLLED BACK savepoint (must never arrive)') \g /dev/null
ROLLBACK TO SAVEPOINT s;
COMMIT;
EOF
note "committed 4 messages (3 + 1), rolled back 3 (2 + 1 in a savepoint)"
if [ "$WAITING_BEFORE" != 0 ]; then
    note "($WAITING_BEFORE older message(s) were already waiting in amqp.message)"
fi

say "Waiting in amqp.message (the outbox)"
sql -c "SELECT id, exchange, convert_from(body, 'UTF8') AS body, attempts, last_error
          FROM amqp.message ORDER BY id"
if [ "$(value "SELECT count(*) FROM amqp.message WHERE id > $BEFORE")" = 0 ]; then
    note "(none left: the commits woke the worker, which delivered them already)"
fi

say "Waiting up to 10 s for the worker to deliver them"
left=""
for _ in $(seq 1 20); do
    left="$(value "SELECT count(*) FROM amqp.message WHERE id > $BEFORE")"
    [ "$left" = 0 ] && break
    sleep 0.5
done
if [ "$left" = 0 ]; then
    note "all 4 delivered: amqp.message holds none of them any more"
else
    warn "$left of this run's messages are still waiting; the worker's log lines are in $LOG"
    sql -c "SELECT id, attempts, last_error, parked_at FROM amqp.message WHERE id > $BEFORE ORDER BY id"
fi

say "Arrived in RabbitMQ"
demo_queue show

# --- 5. the consuming side: a subscription in a second database --------------------------------------
say "A subscription in database $CONSUMER_DB: each order handled exactly once"
psql_ -d postgres -c "DROP DATABASE IF EXISTS $CONSUMER_DB WITH (FORCE)"
psql_ -d postgres -c "CREATE DATABASE $CONSUMER_DB"
psql_ -d "$CONSUMER_DB" -v ex="$EXCHANGE" <<'EOF'
SET client_min_messages = warning;
CREATE EXTENSION amqp_outbox;
INSERT INTO amqp.broker (host) VALUES ('127.0.0.1');
CREATE TABLE invoice (order_id int PRIMARY KEY, total numeric, message_id text);
-- Where the handler publishes its own message (this database publishes too).
CREATE TABLE demo_target (exchange text);
INSERT INTO demo_target VALUES (:'ex');
CREATE FUNCTION bill(d amqp.delivery) RETURNS void LANGUAGE plpgsql AS $$
DECLARE o jsonb := amqp.body_text(d)::jsonb;
BEGIN
    INSERT INTO invoice VALUES ((o->>'id')::int, (o->>'total')::numeric, d.message_id);
    PERFORM amqp.publish(1, (SELECT exchange FROM demo_target), '',
                         format('invoice for order %s, published by the billing database', o->>'id'));
END $$;
EOF
value "SELECT amqp.exchange_declare($BROKER_ID, '$ORDERS_EXCHANGE', 'direct', false, true)" >/dev/null
value "SELECT amqp.queue_declare($BROKER_ID, '$ORDERS_QUEUE')" >/dev/null
value "SELECT amqp.queue_bind($BROKER_ID, '$ORDERS_QUEUE', '$ORDERS_EXCHANGE', 'order.created')" >/dev/null
psql_ -d "$CONSUMER_DB" -c "SELECT amqp.subscribe('billing', 1, '$ORDERS_QUEUE', 'bill(amqp.delivery)')" >/dev/null
note "database $CONSUMER_DB subscribes to queue $ORDERS_QUEUE with the handler bill(amqp.delivery)"
# Reconciliation: $DB collects the receipts and expects one from billing for each order.
value "SELECT amqp.collect_receipts($BROKER_ID, '$RECEIPTS', '$RECEIPTS')" >/dev/null
sql -c "INSERT INTO amqp.monitor_rule (business_type, consumers, late_after, lost_after, action)
        VALUES ('order.created', '{billing}', '3 s', '30 s', 'resend')
        ON CONFLICT (business_type) DO NOTHING" >/dev/null
note "$DB collects receipts (queue $RECEIPTS) and expects billing to answer each order.created"
for _ in $(seq 1 40); do
    [ "$(value "SELECT count(*) FROM amqp.subscription_status WHERE state = 'consuming'")" = 1 ] && break
    sleep 0.5
done
sql -v b="$BROKER_ID" -v ex="$ORDERS_EXCHANGE" <<'EOF'
BEGIN;
SELECT amqp.publish(:b, :'ex', 'order.created', '{"id": 1, "total": 10.00}') \g /dev/null
SELECT amqp.publish(:b, :'ex', 'order.created', '{"id": 2, "total": 25.50}') \g /dev/null
SELECT amqp.publish(:b, :'ex', 'order.created', '{"id": 3, "total": 7.25}') \g /dev/null
COMMIT;
EOF
note "$DB published 3 orders in one transaction"
handled=""
for _ in $(seq 1 40); do
    handled="$(psql_ -d "$CONSUMER_DB" -At -c "SELECT count(*) FROM invoice")"
    [ "$handled" = 3 ] && break
    sleep 0.5
done
psql_ -d "$CONSUMER_DB" -c "SELECT order_id, total, message_id FROM invoice ORDER BY order_id"
psql_ -d "$CONSUMER_DB" -c "SELECT subscription, state, delivered, handled, duplicates, failed, lag
                              FROM amqp.subscription_status"
if [ "$handled" = 3 ]; then
    note "all 3 handled in $CONSUMER_DB, each once"
else
    warn "$CONSUMER_DB handled $handled of 3; the log is in $LOG"
fi

say "Published from the second database: the handler's invoices, in RabbitMQ"
for _ in $(seq 1 20); do
    [ "$(psql_ -d "$CONSUMER_DB" -At -c "SELECT count(*) FROM amqp.message")" = 0 ] && break
    sleep 0.5
done
demo_queue show
note "each database has its own workers, started by the launcher (no setting names them):"
sql -c "SELECT database, state, worker_pid, subscription_worker_pid, published FROM amqp.worker_status"

# --- 6. reconciliation ---------------------------------------------------------------------------------
say "Reconciliation in $DB: every order answered by billing?"
for _ in $(seq 1 30); do
    [ "$(value "SELECT count(*) FROM amqp.reconciliation WHERE business_type = 'order.created'")" = 0 ] && break
    sleep 0.5
done
sql -c "SELECT business_type, status, messages, oldest_age FROM amqp.reconciliation_summary"
if [ "$(value "SELECT count(*) FROM amqp.reconciliation")" = 0 ]; then
    note "nothing unfinished: every message delivered, every monitored one answered"
fi
sql -c "SELECT day, business_type, produced, delivered, consumed, late, lost, resent, compensated, parked, failed
          FROM amqp.daily_stats ORDER BY day, business_type"
note "the life of the last order (amqp.trace):"
sql -c "SELECT at::time(3) AS at, event, detail FROM amqp.trace(
          (SELECT message_id FROM amqp.produced WHERE business_type = 'order.created' ORDER BY created_at DESC, seq DESC LIMIT 1))"
sql -c "SELECT component, status, detail FROM amqp.health()"

sockdir_hint="$RUN_DIR"
user_hint=""
if is_root; then user_hint=" -U postgres"; fi
cat <<EOF

Connect:   psql -h $sockdir_hint -p $PGPORT$user_hint $DB     (or -h 127.0.0.1; the consumer: $CONSUMER_DB)
Publish:   SELECT amqp.publish($BROKER_ID, '$EXCHANGE', '', 'hello');
Log:       $LOG
Stop:      scripts/stop.sh   (or make stop)
EOF
