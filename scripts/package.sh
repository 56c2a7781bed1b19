#!/usr/bin/env bash
# Builds the Debian package postgresql-<major>-amqp-outbox_<version>_<arch>.deb into
# target/package/ (`make package`, `make package PG=16`), for the PostgreSQL that PG_CONFIG
# names. The package installs into Debian's layout for that major (/usr/lib/postgresql/<major>/lib,
# /usr/share/postgresql/<major>/extension: Debian's postgresql-15, apt.postgresql.org's 16-18),
# also when the build's PostgreSQL is a private install (16-18 from scripts/pg_versions.sh), and
# depends on postgresql-<major>.
#
# What goes in: a release build made by `cargo pgrx package` (a user's build: no fault-injection
# feature), stripped as dh_strip would; the control file, the generated full script of this
# version, every update script, and the full scripts of earlier versions kept in sql/ (what
# `make install` copies); the README, a machine-readable copyright file and the Debian changelog
# under /usr/share/doc/<package>/ (README.md.gz, docs/*.md.gz, CHANGELOG.md.gz, copyright,
# changelog.gz).
#
# The Debian tools do the Debian parts: dpkg-shlibdeps computes the library dependencies (libc6,
# libgcc-s1), dpkg-gencontrol writes DEBIAN/control from packaging/debian/control.in (the major
# version filled in, as pg_buildext does) and packaging/debian/changelog, and dpkg-deb builds the
# archive with every file owned by root:root.
#
# Environment: PG_CONFIG (default: pg_config on the PATH), CARGO (default: cargo),
# SOURCE_DATE_EPOCH (default: the changelog's date; file times are clamped to it).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CARGO=${CARGO:-cargo}
DEBIAN_SRC="$ROOT/packaging/debian"

for cmd in dpkg dpkg-deb dpkg-shlibdeps dpkg-gencontrol dpkg-parsechangelog strip gzip; do
    command -v "$cmd" >/dev/null 2>&1 || die "$cmd not found: install dpkg-dev (scripts/setup.sh does)"
done

package_layout

# --- 1. the release build ----------------------------------------------------------------------
# The output directory is named explicitly (pgrx's default place, whatever CARGO_TARGET_DIR says)
# and emptied first, so no file of an earlier build or version can slip into the package.
OUT="$ROOT/target/release/amqp_outbox-pg$PG_MAJOR"
say "Release build for PostgreSQL $PG_MAJOR ($PG_CONFIG_REAL)"
rm -rf "$OUT"
(cd "$ROOT" && "$CARGO" pgrx package --pg-config "$PG_CONFIG_REAL" --out-dir "$OUT")

SO="$OUT$BUILD_PKGLIBDIR/amqp_outbox.so"
CONTROL="$OUT$BUILD_EXTDIR/amqp_outbox.control"
[ -f "$SO" ] || die "cargo pgrx package made no $SO"
[ -f "$CONTROL" ] || die "cargo pgrx package made no $CONTROL"
# The fault-injection settings must not reach users (a build with them would also pass the tests).
if grep -aq 'amqp_outbox\.test_' "$SO"; then
    die "$SO has the amqp_outbox.test_* settings: it is a fault-injection build, not a user's"
fi
VERSION="$(sed -nE "s/^default_version *= *'([^']+)'.*/\1/p" "$CONTROL")"
[ -n "$VERSION" ] || die "no default_version in $CONTROL"
[ -f "$OUT$BUILD_EXTDIR/amqp_outbox--$VERSION.sql" ] || die "no full script amqp_outbox--$VERSION.sql in $OUT$BUILD_EXTDIR"
CHANGELOG_VERSION="$(dpkg-parsechangelog -l "$DEBIAN_SRC/changelog" -S Version)"
if [ "$CHANGELOG_VERSION" != "$VERSION" ]; then
    die "packaging/debian/changelog's last entry is $CHANGELOG_VERSION but the extension is $VERSION: add an entry for $VERSION"
fi
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(dpkg-parsechangelog -l "$DEBIAN_SRC/changelog" -S Timestamp)}"

# --- 2. the staged tree --------------------------------------------------------------------------
# debian/<package>/ inside a work directory: the layout dpkg-shlibdeps and dpkg-gencontrol expect.
say "Staging $PKG $VERSION ($ARCH)"
WORK="$ROOT/target/package/work"
STAGE="$WORK/debian/$PKG"
DOCDIR="/usr/share/doc/$PKG"
rm -rf "$WORK"
install -d -m 755 "$STAGE/DEBIAN" "$STAGE$PKGLIBDIR" "$STAGE$EXTDIR" "$STAGE$DOCDIR"

install -m 644 "$SO" "$STAGE$PKGLIBDIR/"
strip --remove-section=.comment --remove-section=.note --strip-unneeded "$STAGE$PKGLIBDIR/amqp_outbox.so"
install -m 644 "$OUT$BUILD_EXTDIR"/* "$STAGE$EXTDIR/"
# Every script in sql/: pgrx copies the update scripts; the full scripts of earlier versions are
# added here, as `make install` does. A file of sql/ must never replace a different generated one.
for f in "$ROOT"/sql/amqp_outbox--*.sql; do
    dest="$STAGE$EXTDIR/$(basename "$f")"
    if [ -e "$dest" ]; then
        cmp -s "$f" "$dest" || die "$f differs from the script cargo pgrx made with the same name"
    else
        install -m 644 "$f" "$dest"
    fi
done

# Documentation, compressed as Debian policy asks of files over 4 kB (gzip -n: no name or time).
gzip -9n <"$ROOT/README.md" >"$STAGE$DOCDIR/README.md.gz"
# The documentation the README links to (docs/*.md), and the changes per version.
install -d -m 755 "$STAGE$DOCDIR/docs"
for f in "$ROOT"/docs/*.md; do
    gzip -9n <"$f" >"$STAGE$DOCDIR/docs/$(basename "$f").gz"
done
gzip -9n <"$ROOT/CHANGELOG.md" >"$STAGE$DOCDIR/CHANGELOG.md.gz"
# The version has no Debian revision (it is the extension's own), so Debian calls the package
# native, whose changelog is named changelog.gz (lintian: wrong-name-for-changelog-of-native-package).
gzip -9n <"$DEBIAN_SRC/changelog" >"$STAGE$DOCDIR/changelog.gz"
# The copyright file names the Rust crates linked into the library, as this build resolves them.
write_copyright "$STAGE$DOCDIR/copyright" -p amqp_outbox --no-default-features --features "pg$PG_MAJOR"

# --- 3. DEBIAN/control, md5sums -----------------------------------------------------------------
sed "s/PGVERSION/$PG_MAJOR/g" "$DEBIAN_SRC/control.in" >"$WORK/debian/control"
cp "$DEBIAN_SRC/changelog" "$WORK/debian/changelog"
(
    cd "$WORK"
    dpkg-shlibdeps -T"debian/$PKG.substvars" "debian/$PKG$PKGLIBDIR/amqp_outbox.so"
    # Installed-Size is computed from the staged tree; Version comes from the changelog.
    dpkg-gencontrol -p"$PKG" -P"debian/$PKG" -T"debian/$PKG.substvars"
)
# md5sums, modes 755/644 whatever the umask, times clamped for a reproducible archive.
finish_stage "$STAGE"

# --- 4. the archive ------------------------------------------------------------------------------
DEB="$ROOT/target/package/${PKG}_${VERSION}_${ARCH}.deb"
dpkg-deb --root-owner-group --build "$STAGE" "$DEB"
say "Built ${DEB#"$ROOT"/}"
dpkg-deb --field "$DEB" Package Version Architecture Installed-Size Depends | sed 's/^/    /'
