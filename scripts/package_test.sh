#!/usr/bin/env bash
# The Debian package end to end (`make test-package`): builds it (`make package`), installs it
# with apt-get into this machine's PostgreSQL, checks what dpkg installed, runs the SQL contract
# (scripts/installcheck.sh) against the installed files, then removes and purges it and checks
# that none of its files is left.
#
# The package installs into the paths `make install-test` uses, and the other tiers need that test
# build: the amqp_outbox files found there are saved first and put back at the end, also on
# failure. While this runs, the installed build is the package's, so run no other tier meanwhile;
# files another install writes during the test are kept (not replaced by older saved copies).
# A .so that a running server may have loaded is never overwritten in place: dpkg renames new
# files into place, and the restore copies to a temporary name in the same directory and renames.
#
# Every pg_regress file runs: none needs the fault-injection build (settings.sql leaves the
# amqp_outbox.test_* settings out), so the suite passes on a user's build.
#
# Root rights (apt-get, dpkg, the restore) come from sudo when not run as root.
# Environment: PG_CONFIG (default: pg_config on the PATH).
#
# For a PostgreSQL this machine has no Debian package of (16-18 from scripts/pg_versions.sh:
# PG_CONFIG names a private install, not Debian's postgresql-<major>), the package cannot be
# installed with apt: scripts/package_test_private.sh checks the archive and runs its files in a
# copy of that install instead.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

package_layout
debian_postgresql_installed() {
    dpkg-query -W -f='${Status}' "postgresql-$PG_MAJOR" 2>/dev/null | grep -q 'install ok installed'
}
if [ "$BUILD_PKGLIBDIR" != "$PKGLIBDIR" ] || [ "$BUILD_EXTDIR" != "$EXTDIR" ] || ! debian_postgresql_installed; then
    note "PostgreSQL $PG_MAJOR at $PG_CONFIG_REAL is not Debian's postgresql-$PG_MAJOR: the package is checked without apt"
    exec "$ROOT/scripts/package_test_private.sh"
fi
DOCDIR="/usr/share/doc/$PKG"
export DEBIAN_FRONTEND=noninteractive

failures=()
check() { # check DESCRIPTION COMMAND...: record a failure instead of stopping at the first one
    local what=$1
    shift
    if "$@"; then note "ok: $what"; else note "FAILED: $what"; failures+=("$what"); fi
}
# The package's state as dpkg knows it ("ii" installed, "rc" removed with its configuration left,
# "un"/"pn" or nothing: not installed), and whether dpkg still holds anything of it.
pkg_state() { dpkg-query -W -f='${db:Status-Abbrev}' "$PKG" 2>/dev/null | tr -d ' ' || true; }
pkg_known() { local s; s=$(pkg_state); [ -n "$s" ] && [ "${s:1:1}" != n ]; }
# The amqp_outbox files in PostgreSQL's directories, whoever installed them.
installed_files() {
    local f
    for f in "$PKGLIBDIR/amqp_outbox.so" "$EXTDIR/amqp_outbox.control" "$EXTDIR"/amqp_outbox--*.sql; do
        if [ -e "$f" ]; then echo "$f"; fi
    done
}

if pkg_known; then
    die "$PKG is installed ($(pkg_state)): this test installs and removes it; remove it first (apt-get purge $PKG)"
fi

times=()
step_start=0
step() { step_start=$(date +%s); say "$*"; }
step_done() { times+=("$1 $(($(date +%s) - step_start))s"); }

# --- 1. build ------------------------------------------------------------------------------------
step "make package"
make -C "$ROOT" --no-print-directory package PG_CONFIG="$PG_CONFIG_REAL"
VERSION="$(sed -nE "s/^default_version *= *'([^']+)'.*/\1/p" \
    "$ROOT/target/release/amqp_outbox-pg$PG_MAJOR$BUILD_EXTDIR/amqp_outbox.control")"
DEB="target/package/${PKG}_${VERSION}_${ARCH}.deb"
[ -f "$ROOT/$DEB" ] || die "make package made no $DEB"
step_done build

# --- 2. save what is installed, and put it back on exit ---------------------------------------
SAVE="$(mktemp -d /tmp/amqp_outbox-package-test.XXXXXX)"
mkdir "$SAVE/saved" "$SAVE/kept"
mapfile -t saved < <(installed_files)
for f in "${saved[@]}"; do cp -p "$f" "$SAVE/saved/"; done
note "saved ${#saved[@]} installed amqp_outbox file(s) to put back afterwards"

# The files dpkg installed that no longer match the package: another install wrote them meanwhile.
changed_since_install() { dpkg --verify "$PKG" 2>/dev/null | awk '$1 ~ /^..5/ { print $NF }'; }

# Copy to a temporary name in the same directory, then rename: never write into a loaded .so.
put_back() { # put_back SAVED_COPY DESTINATION
    local tmp
    tmp="$(dirname "$2")/.$(basename "$2").restore.$$"
    as_root cp -p "$1" "$tmp" && as_root mv -f "$tmp" "$2" && cmp -s "$1" "$2"
}

# Puts back what was installed before, unless another install (make install-test in another
# shell) wrote newer files during the test: those are kept, not replaced by older saved copies.
restore() {
    local rc=$? ok=1 f name kept=() put=0 listed_now=() changed=()
    trap - EXIT INT TERM
    say "Putting back the amqp_outbox files found before the test"
    # Not the package's: every file if it is no longer installed, else those dpkg did not write
    # or that changed since. Those equal to their saved copy need no keeping.
    if pkg_known; then
        mapfile -t listed_now < <(dpkg -L "$PKG" 2>/dev/null)
        mapfile -t changed < <(changed_since_install)
    fi
    while IFS= read -r f; do
        if cmp -s "$SAVE/saved/$(basename "$f")" "$f" 2>/dev/null; then continue; fi
        # Here-strings, not pipes: grep -q exits at the first match, and a writer still
        # writing would die of SIGPIPE, which pipefail reports as a failure.
        if ! pkg_known || grep -Fxq -- "$f" <<<"$(printf '%s\n' "${changed[@]}")" ||
            ! grep -Fxq -- "$f" <<<"$(printf '%s\n' "${listed_now[@]}")"; then kept+=("$f"); fi
    done < <(installed_files)
    for f in "${kept[@]}"; do cp -p "$f" "$SAVE/kept/" || ok=; done
    if pkg_known; then as_root apt-get purge -y -q "$PKG" >/dev/null || ok=; fi
    for f in "${kept[@]}"; do
        if ! cmp -s "$SAVE/kept/$(basename "$f")" "$f" 2>/dev/null; then
            put_back "$SAVE/kept/$(basename "$f")" "$f" || { warn "could not put back $f"; ok=; }
        fi
    done
    for f in "${saved[@]}"; do
        name=$(basename "$f")
        if [ -e "$SAVE/kept/$name" ] || cmp -s "$SAVE/saved/$name" "$f" 2>/dev/null; then continue; fi
        if put_back "$SAVE/saved/$name" "$f"; then
            put=$((put + 1))
        else
            warn "could not put back $f (saved copy: $SAVE/saved/$name)"
            ok=
        fi
    done
    note "put back $put of ${#saved[@]} saved file(s)"
    if [ ${#kept[@]} -gt 0 ]; then
        note "kept ${#kept[@]} file(s) written by another install during the test: ${kept[*]}"
    fi
    # The copies stay when something could not be put back, for doing it by hand.
    if [ -n "$ok" ]; then rm -rf "$SAVE"; elif [ "$rc" -eq 0 ]; then rc=1; fi
    exit "$rc"
}
trap restore EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- 3. install ---------------------------------------------------------------------------------
step "apt-get install ./$DEB"
(cd "$ROOT" && as_root apt-get install -y -q "./$DEB")
step_done install

# --- 4. what dpkg installed ---------------------------------------------------------------------
step "Checking the installed package"
mapfile -t listed < <(dpkg -L "$PKG")
listed_has() { grep -Fxq -- "$1" <<<"$(printf '%s\n' "${listed[@]}")"; }
check "dpkg -L lists the library $PKGLIBDIR/amqp_outbox.so" listed_has "$PKGLIBDIR/amqp_outbox.so"
check "dpkg -L lists the control file" listed_has "$EXTDIR/amqp_outbox.control"
check "dpkg -L lists the full script of $VERSION" listed_has "$EXTDIR/amqp_outbox--$VERSION.sql"
for f in "$ROOT"/sql/amqp_outbox--*.sql; do
    check "dpkg -L lists $(basename "$f")" listed_has "$EXTDIR/$(basename "$f")"
done
check "dpkg -L lists the README" listed_has "$DOCDIR/README.md.gz"
readme_whole() { zcat "$DOCDIR/README.md.gz" | cmp -s - "$ROOT/README.md"; }
check "the installed README is this checkout's README.md" readme_whole
for f in "$ROOT"/docs/*.md; do
    check "dpkg -L lists docs/$(basename "$f")" listed_has "$DOCDIR/docs/$(basename "$f").gz"
done
check "dpkg -L lists CHANGELOG.md" listed_has "$DOCDIR/CHANGELOG.md.gz"
check "dpkg -L lists the copyright file" listed_has "$DOCDIR/copyright"
check "dpkg -L lists the changelog" listed_has "$DOCDIR/changelog.gz"
# Only the package's own files: the installed files match its md5sums.
verified() {
    local out rc=0
    out=$(dpkg --verify "$PKG" 2>&1) || rc=$?
    if [ "$rc" -eq 0 ] && [ -z "$out" ]; then return 0; fi
    printf '%s\n' "$out"
    return 1
}
check "dpkg --verify finds every file as packaged" verified
users_build() { ! grep -aq 'amqp_outbox\.test_' "$PKGLIBDIR/amqp_outbox.so"; }
check "the installed library is a user's build (no amqp_outbox.test_* settings)" users_build
depends="$(dpkg-query -W -f='${Depends}' "$PKG")"
depends_ok() { [[ ", $depends," == *", postgresql-$PG_MAJOR,"* && "$depends" == *libc6* ]]; }
check "it depends on postgresql-$PG_MAJOR and libc6 ($depends)" depends_ok
# dpkg-deb --contents: "perms owner/group size date time path"
bad_entries="$(dpkg-deb --contents "$ROOT/$DEB" | awk '$2 != "root/root" || ($1 != "drwxr-xr-x" && $1 != "-rw-r--r--")')"
check "every entry of the archive is root/root, 755 or 644" test -z "$bad_entries"
if [ -n "$bad_entries" ]; then printf '%s\n' "$bad_entries"; fi
if command -v lintian >/dev/null 2>&1; then
    check "lintian finds no error or warning" lintian --fail-on error,warning "$ROOT/$DEB"
fi
step_done checks
if [ ${#failures[@]} -gt 0 ]; then die "package checks failed: $(printf "[%s] " "${failures[@]}")"; fi

# --- 5. the SQL contract against the installed files ------------------------------------------
step "installcheck against the package's files"
PG_CONFIG="$PG_CONFIG_REAL" "$ROOT/scripts/installcheck.sh"
step_done installcheck

# --- 6. remove and purge -------------------------------------------------------------------------
# The package's files and directories (not the directories it shares with postgresql-NN).
mapfile -t own < <(printf '%s\n' "${listed[@]}" | while IFS= read -r p; do
    if [ -f "$p" ] || [ "$p" = "$DOCDIR" ]; then echo "$p"; fi
done)
left_behind() { local p; for p in "${own[@]}"; do if [ -e "$p" ]; then echo "$p"; fi; done; }

step "apt-get remove, then purge"
# The suite ran against the package's files only if no other install replaced them meanwhile.
unchanged() { [ -z "$(changed_since_install)" ]; }
check "the package's files are still as installed" unchanged
if [ ${#failures[@]} -gt 0 ]; then die "another install replaced the package's files during the test: its result means nothing"; fi
as_root apt-get remove -y -q "$PKG"
left="$(left_behind)"
check "apt-get remove leaves none of the package's ${#own[@]} files" test -z "$left"
if [ -n "$left" ]; then printf 'left behind: %s\n' "$left"; fi
# A package without configuration files is forgotten by dpkg on removal: nothing left to purge.
if pkg_known; then as_root apt-get purge -y -q "$PKG"; else note "dpkg no longer knows $PKG: nothing to purge"; fi
left="$(left_behind)"
check "apt-get purge leaves none of them" test -z "$left"
if [ -n "$left" ]; then printf 'left behind: %s\n' "$left"; fi
forgotten() { ! pkg_known; }
check "dpkg keeps nothing of the package" forgotten
step_done remove
if [ ${#failures[@]} -gt 0 ]; then die "package checks failed: $(printf "[%s] " "${failures[@]}")"; fi

say "Package test passed: ${times[*]}"
