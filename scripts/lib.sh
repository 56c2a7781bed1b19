# shellcheck shell=bash
# Helpers shared by the scripts in this directory. Source it; do not run it.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

say()  { if [ -t 1 ]; then printf '\033[1m==> %s\033[0m\n' "$*"; else printf '==> %s\n' "$*"; fi; }
note() { printf '    %s\n' "$*"; }
warn() { printf 'WARNING: %s\n' "$*" >&2; }
die()  { printf 'ERROR: %s\n' "$*" >&2; exit 1; }

is_root() { [ "$(id -u)" -eq 0 ]; }

# Run a command with root rights: directly as root, else through sudo.
as_root() {
    if is_root; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "need root rights for: $* (install sudo or run as root)"
    fi
}

# initdb, pg_ctl and pg_regress refuse to run as root: as root, run them as `postgres`.
as_pg() {
    if is_root; then
        # (from a directory postgres can enter: initdb and pg_ctl complain about others)
        (runuser -u postgres -- test -x "$PWD" || cd /; runuser -u postgres -- "$@")
    else
        "$@"
    fi
}

# The real pg_config (Debian's /usr/bin/pg_config is a wrapper script).
real_pg_config() {
    local pgc="${PG_CONFIG:-pg_config}"
    command -v "$pgc" >/dev/null 2>&1 || die "pg_config not found (run scripts/setup.sh, or set PG_CONFIG)"
    local bindir
    bindir="$("$pgc" --bindir)"
    if [ -x "$bindir/pg_config" ]; then echo "$bindir/pg_config"; else command -v "$pgc"; fi
}

# The Debian package's name and the paths it installs to, for the PostgreSQL that PG_CONFIG
# names: sets PG_CONFIG_REAL, PG_MAJOR, PKGLIBDIR, EXTDIR, PKG and ARCH, and BUILD_PKGLIBDIR,
# BUILD_EXTDIR (package.sh and package_test.sh must agree on them).
#
# PKGLIBDIR and EXTDIR are where Debian's postgresql-<major> keeps extensions (Debian's own 15,
# or apt.postgresql.org's 16, 17, 18: the same layout), whichever PostgreSQL built the package;
# BUILD_PKGLIBDIR and BUILD_EXTDIR are that PostgreSQL's own directories, where the build puts
# the files (the same for the system's 15; a private install's for 16-18 from
# scripts/pg_versions.sh).
package_layout() {
    PG_CONFIG_REAL="$(real_pg_config)"
    PG_MAJOR="$("$PG_CONFIG_REAL" --version | sed -E 's/^PostgreSQL ([0-9]+).*/\1/')"
    BUILD_PKGLIBDIR="$("$PG_CONFIG_REAL" --pkglibdir)"
    BUILD_EXTDIR="$("$PG_CONFIG_REAL" --sharedir)/extension"
    PKGLIBDIR="/usr/lib/postgresql/$PG_MAJOR/lib"
    EXTDIR="/usr/share/postgresql/$PG_MAJOR/extension"
    PKG="postgresql-$PG_MAJOR-amqp-outbox"
    ARCH="$(dpkg --print-architecture)"
}

# Does something accept TCP connections on host:port?
port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

# The private demo cluster's directory: .run inside the checkout, unless (as root) the
# `postgres` user cannot reach it, or the path is too long for a unix socket (107 bytes).
run_dir() {
    local dir="$ROOT/.run"
    if { is_root && ! runuser -u postgres -- test -x "$ROOT"; } || [ "${#dir}" -gt 80 ]; then
        dir="/tmp/amqp_outbox-run-$(printf '%s' "$ROOT" | sha256sum | cut -c1-12)"
    fi
    echo "$dir"
}

# The database superuser of the private cluster: initdb names it after the OS user.
pg_superuser() { if is_root; then echo postgres; else id -un; fi; }

# Is a cargo subcommand wanted version? `cargo pgrx --version` prints "cargo-pgrx 0.18.0".
PGRX_VERSION="0.18.0"
have_cargo_pgrx() { cargo pgrx --version 2>/dev/null | grep -qw "$PGRX_VERSION"; }

# Runs PGXS's pg_regress (of PG_CONFIG_REAL's PostgreSQL) on TESTS from WORK (sql/, expected/,
# regress.conf) in a temporary instance, copies results, diffs and log to OUT, and on a failure
# shows the diffs and the instance's last log lines and dies naming WHAT.
#   run_pg_regress WORK OUT WHAT TEST...
run_pg_regress() {
    local work="$1" out="$2" what="$3"
    shift 3
    local bindir pkglibdir libdir status=0
    bindir="$("$PG_CONFIG_REAL" --bindir)"
    pkglibdir="$("$PG_CONFIG_REAL" --pkglibdir)"
    libdir="$("$PG_CONFIG_REAL" --libdir)"
    local pg_regress="$pkglibdir/pgxs/src/test/regress/pg_regress"
    [ -x "$pg_regress" ] || die "pg_regress not found at $pg_regress (PostgreSQL 15: install postgresql-server-dev-15; 16-18: scripts/pg_versions.sh)"
    # The server's own libraries first: the private installs of scripts/pg_versions.sh were
    # built for /opt/postgresql, so their contrib modules (dblink) would otherwise load the
    # system's older libpq (PostgreSQL 17's dblink: undefined PQcancelStart).
    # RUST_BACKTRACE=1 in the server's environment (as a developer's shell often has): errors
    # must still reach clients without Rust backtraces (bad_input checks their DETAIL).
    (cd "$work" && as_pg env RUST_BACKTRACE=1 LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$pg_regress" \
        --bindir="$bindir" \
        --inputdir="$work" \
        --outputdir="$work" \
        --temp-instance="$work/tmp_check" \
        --temp-config="$work/regress.conf" \
        --dbname=contrib_regression \
        --encoding=UTF8 --no-locale \
        "$@") || status=$?
    if [ "$work" != "$out" ]; then
        local f
        for f in results regression.diffs regression.out log; do
            if [ -e "$work/$f" ]; then cp -r "$work/$f" "$out/"; fi
        done
    fi
    if [ "$status" -ne 0 ]; then
        if [ -s "$out/regression.diffs" ]; then
            echo "---- ${out#"$ROOT"/}/regression.diffs ----"
            cat "$out/regression.diffs"
        fi
        if [ -f "$out/log/postmaster.log" ]; then
            echo "---- last lines of the temporary instance's log ----"
            tail -n 40 "$out/log/postmaster.log"
        fi
        die "$what failed (pg_regress exit $status); results in ${out#"$ROOT"/}/results"
    fi
    rm -rf "$work/tmp_check"
}

# write_copyright DEST CARGO_TREE_ARGS...: packaging/debian/copyright.in with the Rust crates the
# packaged binary links, as `cargo tree CARGO_TREE_ARGS...` resolves them (name, version: license;
# cargo tree's "(*)" marks repeats; the workspace's own crates are covered by "Files: *").
write_copyright() {
    local dest=$1 crates line
    shift
    crates="$(cd "$ROOT" && "${CARGO:-cargo}" tree "$@" -e normal,no-proc-macro --prefix none --format '{p}|{l}' |
        sed -E 's/ \(\*\)$//' | grep -v '^amqp_outbox' |
        awk -F'|' '{ split($1, p, " "); printf " %s %s: %s\n", p[1], substr(p[2], 2), ($2 == "" ? "(none declared)" : $2) }' |
        LC_ALL=C sort -u)"
    [ -n "$crates" ] || die "cargo tree listed no crates for the copyright file"
    while IFS= read -r line; do
        if [ "$line" = "@BUNDLED_CRATES@" ]; then printf '%s\n' "$crates"; else printf '%s\n' "$line"; fi
    done <"$ROOT/packaging/debian/copyright.in" >"$dest"
    chmod 644 "$dest"
}

# finish_stage STAGE [EXECUTABLE...]: DEBIAN/md5sums of the staged tree, modes 755/644 whatever the
# umask (755 for the EXECUTABLEs, paths inside STAGE), times clamped to SOURCE_DATE_EPOCH for a
# reproducible archive.
finish_stage() {
    local stage=$1 f
    shift
    (cd "$stage" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | LC_ALL=C sort -z |
        xargs -0 md5sum) >"$stage/DEBIAN/md5sums"
    find "$stage" -type d -exec chmod 755 {} +
    find "$stage" -type f -exec chmod 644 {} +
    for f in "$@"; do chmod 755 "$stage$f"; done
    find "$stage" -newermt "@$SOURCE_DATE_EPOCH" -print0 | xargs -0r touch --no-dereference --date="@$SOURCE_DATE_EPOCH"
}
