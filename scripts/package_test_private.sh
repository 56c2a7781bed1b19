#!/usr/bin/env bash
# The Debian package for a PostgreSQL major this machine has no Debian package of (16, 17, 18
# from scripts/pg_versions.sh), end to end without apt (`make test-package PG=17`;
# scripts/package_test.sh comes here for such a PG_CONFIG):
#
#   1. make package: target/package/postgresql-<major>-amqp-outbox_<version>_<arch>.deb
#   2. the archive, not installed: its control fields (package, version, architecture, section,
#      maintainer, a description naming the major, Installed-Size, and Depends on
#      postgresql-<major> and libc6); exactly the expected files, in Debian's layout for that
#      major (/usr/lib/postgresql/<major>/lib, /usr/share/postgresql/<major>/extension,
#      /usr/share/doc/<package>) and nothing else (no path of the private install it was built
#      with); every entry root:root, 755/644; the files match its md5sums; the library is a
#      user's build; lintian finds no error or warning (when installed)
#   3. its files installed into a copy of that major's private install (hard links where the
#      filesystem allows: the install itself, where `make install-test PG=<major>` put the test
#      build, is not changed), in place of any amqp_outbox files there
#   4. make installcheck's suite (every pg_regress file) against the copy, the library preloaded
#   5. a real delivery: the end-to-end test committed_message_arrives_once_with_properties_and_headers
#      on a private cluster of the copy (CREATE EXTENSION, a broker row, two messages published
#      and received from the RabbitMQ on 127.0.0.1:5672 with their properties and headers)
#
# Never touches the system's PostgreSQL. Environment: PG_CONFIG (the private install's
# pg_config), CARGO (default: cargo).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CARGO=${CARGO:-cargo}
package_layout
DOCDIR="/usr/share/doc/$PKG"
[ "$BUILD_PKGLIBDIR" != "$PKGLIBDIR" ] ||
    die "$PG_CONFIG_REAL is Debian's layout for PostgreSQL $PG_MAJOR: use scripts/package_test.sh (apt)"
PREFIX="$(dirname "$("$PG_CONFIG_REAL" --bindir)")"
case "$BUILD_PKGLIBDIR/" in
    "$PREFIX"/*) ;;
    *) die "$PG_CONFIG_REAL's libraries ($BUILD_PKGLIBDIR) are not under its prefix $PREFIX: not a private install this test can copy" ;;
esac

failures=()
check() { # check DESCRIPTION COMMAND...: record a failure instead of stopping at the first one
    local what=$1
    shift
    if "$@"; then note "ok: $what"; else note "FAILED: $what"; failures+=("$what"); fi
}
fail_if_any() {
    if [ ${#failures[@]} -gt 0 ]; then die "package checks failed: $(printf "[%s] " "${failures[@]}")"; fi
}
times=()
step_start=0
step() { step_start=$(date +%s); say "$*"; }
step_done() { times+=("$1 $(($(date +%s) - step_start))s"); }

WORK="$(mktemp -d /tmp/amqp_outbox-package-test.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
# The copy is used by the postgres user (initdb, pg_regress, the test clusters).
chmod 755 "$WORK"

# --- 1. build ------------------------------------------------------------------------------------
step "make package (PostgreSQL $PG_MAJOR, $PG_CONFIG_REAL)"
make -C "$ROOT" --no-print-directory package PG_CONFIG="$PG_CONFIG_REAL"
VERSION="$(sed -nE "s/^default_version *= *'([^']+)'.*/\1/p" \
    "$ROOT/target/release/amqp_outbox-pg$PG_MAJOR$BUILD_EXTDIR/amqp_outbox.control")"
DEB="$ROOT/target/package/${PKG}_${VERSION}_${ARCH}.deb"
[ -f "$DEB" ] || die "make package made no ${DEB#"$ROOT"/}"
step_done build

# --- 2. the archive -------------------------------------------------------------------------------
step "Checking ${DEB#"$ROOT"/}"
field() { dpkg-deb --field "$DEB" "$1"; }
check "Package is $PKG" test "$(field Package)" = "$PKG"
check "Version is $VERSION" test "$(field Version)" = "$VERSION"
check "Architecture is $ARCH" test "$(field Architecture)" = "$ARCH"
check "Section is database" test "$(field Section)" = database
check "it names a Maintainer" test -n "$(field Maintainer)"
installed_size() { [[ "$(field Installed-Size)" =~ ^[1-9][0-9]*$ ]]; }
check "Installed-Size is a size in kB ($(field Installed-Size))" installed_size
# Not `field Description | grep -q`: grep -q exits at the first line that matches, dpkg-deb then
# dies of SIGPIPE writing the rest, and pipefail failed the check (seen once on 16 under load).
description_names_major() { grep -q "PostgreSQL $PG_MAJOR" <<<"$(field Description)"; }
check "the description names PostgreSQL $PG_MAJOR" description_names_major
depends="$(field Depends)"
depends_ok() { [[ ", $depends," == *", postgresql-$PG_MAJOR,"* && "$depends" == *libc6* ]]; }
check "it depends on postgresql-$PG_MAJOR and libc6 ($depends)" depends_ok
other_major() { ! grep -Eq "postgresql-(1[0-9]|[2-9][0-9])([^0-9]|$)" <<<"${depends//postgresql-$PG_MAJOR/}"; }
check "it depends on no other PostgreSQL major" other_major

# dpkg-deb --contents: "perms owner/group size date time ./path"
contents="$(dpkg-deb --contents "$DEB")"
bad_entries="$(awk '$2 != "root/root" || ($1 != "drwxr-xr-x" && $1 != "-rw-r--r--")' <<<"$contents")"
check "every entry of the archive is root/root, 755 or 644" test -z "$bad_entries"
if [ -n "$bad_entries" ]; then printf '%s\n' "$bad_entries"; fi
# The files it must hold, exactly: those of package.sh, in Debian's layout for this major.
expected="$WORK/expected" actual="$WORK/actual"
{
    echo "$PKGLIBDIR/amqp_outbox.so"
    echo "$EXTDIR/amqp_outbox.control"
    echo "$EXTDIR/amqp_outbox--$VERSION.sql"
    for f in "$ROOT"/sql/amqp_outbox--*.sql; do echo "$EXTDIR/$(basename "$f")"; done
    echo "$DOCDIR/README.md.gz"
    for f in "$ROOT"/docs/*.md; do echo "$DOCDIR/docs/$(basename "$f").gz"; done
    echo "$DOCDIR/CHANGELOG.md.gz"
    echo "$DOCDIR/copyright"
    echo "$DOCDIR/changelog.gz"
} | LC_ALL=C sort -u >"$expected"
awk '$1 !~ /^d/ { sub(/^\./, "", $6); print $6 }' <<<"$contents" | LC_ALL=C sort >"$actual"
same_files() { diff -u "$expected" "$actual"; }
check "it holds exactly the expected $(wc -l <"$expected") files" same_files
private_paths() { grep -F "$PREFIX" "$actual"; }
check "no file under the private install it was built with ($PREFIX)" eval '! private_paths'
outside() { grep -Ev "^($PKGLIBDIR|$EXTDIR|$DOCDIR)/" "$actual"; }
check "every file under $PKGLIBDIR, $EXTDIR or $DOCDIR" eval '! outside'

ROOTFS="$WORK/root"
CONTROL_DIR="$WORK/control"
dpkg-deb -x "$DEB" "$ROOTFS"
dpkg-deb -e "$DEB" "$CONTROL_DIR"
md5_ok() { (cd "$ROOTFS" && md5sum --quiet --check "$CONTROL_DIR/md5sums"); }
check "every file matches DEBIAN/md5sums" md5_ok
md5_complete() { [ "$(wc -l <"$CONTROL_DIR/md5sums")" -eq "$(wc -l <"$actual")" ]; }
check "DEBIAN/md5sums lists every file" md5_complete
users_build() { ! grep -aq 'amqp_outbox\.test_' "$ROOTFS$PKGLIBDIR/amqp_outbox.so"; }
check "the library is a user's build (no amqp_outbox.test_* settings)" users_build
readme_whole() { zcat "$ROOTFS$DOCDIR/README.md.gz" | cmp -s - "$ROOT/README.md"; }
check "the README is this checkout's README.md" readme_whole
if command -v lintian >/dev/null 2>&1; then
    check "lintian finds no error or warning" lintian --fail-on error,warning "$DEB"
fi
step_done checks
fail_if_any

# --- 3. its files in a copy of the private install -------------------------------------------------
step "Installing its files into a copy of $PREFIX"
COPY="$WORK/pg$PG_MAJOR"
fingerprint() { # the amqp_outbox files of an install, with their checksums
    (cd "$1" && find . -name 'amqp_outbox*' -type f -print0 | LC_ALL=C sort -z | xargs -0r md5sum)
}
prefix_before="$(fingerprint "$PREFIX")"
# Hard links: quick, and the files the package replaces are unlinked first, never written into.
cp -al "$PREFIX" "$COPY" 2>/dev/null || { rm -rf "$COPY"; cp -a "$PREFIX" "$COPY"; }
COPY_PG_CONFIG="$COPY/bin/pg_config"
COPY_PKGLIBDIR="$("$COPY_PG_CONFIG" --pkglibdir)"
COPY_EXTDIR="$("$COPY_PG_CONFIG" --sharedir)/extension"
[ "$COPY_PKGLIBDIR" = "$COPY/${BUILD_PKGLIBDIR#"$PREFIX"/}" ] ||
    die "the copy's pg_config reports $COPY_PKGLIBDIR: the install is not relocatable"
rm -f "$COPY_PKGLIBDIR"/amqp_outbox.so "$COPY_EXTDIR"/amqp_outbox.control "$COPY_EXTDIR"/amqp_outbox--*.sql
install -m 644 "$ROOTFS$PKGLIBDIR"/* "$COPY_PKGLIBDIR/"
install -m 644 "$ROOTFS$EXTDIR"/* "$COPY_EXTDIR/"
the_packages_library() { cmp -s "$ROOTFS$PKGLIBDIR/amqp_outbox.so" "$COPY_PKGLIBDIR/amqp_outbox.so"; }
check "the copy has the package's library" the_packages_library
untouched() { [ "$(fingerprint "$PREFIX")" = "$prefix_before" ]; }
check "the private install's own amqp_outbox files are unchanged" untouched
step_done install
fail_if_any

# --- 4. the SQL contract --------------------------------------------------------------------------
step "installcheck against the package's files (PostgreSQL $PG_MAJOR)"
PG_CONFIG="$COPY_PG_CONFIG" "$ROOT/scripts/installcheck.sh"
step_done installcheck

# --- 5. a real delivery ---------------------------------------------------------------------------
step "CREATE EXTENSION and a delivery to RabbitMQ on a private cluster (PostgreSQL $PG_MAJOR)"
(cd "$ROOT" && PG_CONFIG="$COPY_PG_CONFIG" "$CARGO" test -p amqp_outbox_e2e --test worker -- \
    --exact committed_message_arrives_once_with_properties_and_headers)
step_done delivery

say "Package test passed (PostgreSQL $PG_MAJOR, ${DEB#"$ROOT"/}, without apt): ${times[*]}"
