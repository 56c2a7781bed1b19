#!/usr/bin/env bash
# Stop what scripts/run.sh started: the private PostgreSQL cluster, and RabbitMQ only if run.sh
# (through setup.sh) was the one that started it. A RabbitMQ that was already running is left alone.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

RUN_DIR="$(run_dir)"
PGDATA="$RUN_DIR/pgdata"

if [ ! -f "$PGDATA/PG_VERSION" ]; then
    say "No private cluster in $PGDATA: nothing to stop"
else
    BINDIR="$("$(real_pg_config)" --bindir)"
    if as_pg "$BINDIR/pg_ctl" -D "$PGDATA" status >/dev/null 2>&1; then
        as_pg "$BINDIR/pg_ctl" -D "$PGDATA" -m fast -w -t 60 stop >/dev/null
        say "Stopped the private PostgreSQL cluster ($PGDATA)"
    else
        say "The private PostgreSQL cluster ($PGDATA) is not running"
    fi
fi

marker="$RUN_DIR/rabbitmq-started-by-run"
if [ -f "$marker" ]; then
    if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
        as_root systemctl stop rabbitmq-server
    else
        as_root rabbitmqctl -q stop
    fi
    rm -f "$marker"
    say "Stopped RabbitMQ (run.sh had started it)"
else
    note "RabbitMQ left running (run.sh did not start it)"
fi
