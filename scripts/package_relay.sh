#!/usr/bin/env bash
# Builds the relay's Debian package amqp-outbox-relay_<version>_<arch>.deb into target/package/
# (`make package` builds it after the extension's): the release binary /usr/bin/amqp-outbox-relay
# (stripped), the systemd unit, the example configuration /etc/amqp-outbox-relay/relay.toml (a
# conffile), the plain-SQL install script of this version under /usr/share/amqp-outbox-relay/,
# and the documentation, copyright file and changelog under /usr/share/doc/amqp-outbox-relay/.
# The unit is installed, not enabled: a relay needs its databases configured first.
#
# The Debian tools do the Debian parts, as for the extension's package (scripts/package.sh):
# dpkg-shlibdeps, dpkg-gencontrol (packaging/debian/control.in's second stanza and the
# changelog), dpkg-deb with every file owned by root:root, times clamped to the changelog's date.
#
# Environment: CARGO (default: cargo), SOURCE_DATE_EPOCH (default: the changelog's date).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CARGO=${CARGO:-cargo}
DEBIAN_SRC="$ROOT/packaging/debian"
RELAY_SRC="$ROOT/packaging/relay"
PKG=amqp-outbox-relay

for cmd in dpkg dpkg-deb dpkg-shlibdeps dpkg-gencontrol dpkg-parsechangelog strip gzip; do
    command -v "$cmd" >/dev/null 2>&1 || die "$cmd not found: install dpkg-dev (scripts/setup.sh does)"
done
ARCH="$(dpkg --print-architecture)"
VERSION="$(dpkg-parsechangelog -l "$DEBIAN_SRC/changelog" -S Version)"
CRATE_VERSION="$(sed -nE 's/^version = "([^"]+)"/\1/p' "$ROOT/relay/Cargo.toml" | head -1)"
[ "$CRATE_VERSION" = "$VERSION" ] || die "relay/Cargo.toml says $CRATE_VERSION, packaging/debian/changelog $VERSION"
SQL="$ROOT/sql/hosted/amqp_outbox_hosted--$VERSION.sql"
[ -f "$SQL" ] || die "no plain-SQL install script $SQL (make sql)"
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(dpkg-parsechangelog -l "$DEBIAN_SRC/changelog" -S Timestamp)}"

say "Release build of the relay"
(cd "$ROOT" && "$CARGO" build --release --locked -p amqp_outbox_relay)
TARGET_DIR="$(cd "$ROOT" && "$CARGO" metadata --format-version 1 --no-deps |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
BIN="$TARGET_DIR/release/amqp-outbox-relay"
[ -x "$BIN" ] || die "the build made no $BIN"

say "Staging $PKG $VERSION ($ARCH)"
WORK="$ROOT/target/package/relay-work"
STAGE="$WORK/debian/$PKG"
DOCDIR="/usr/share/doc/$PKG"
rm -rf "$WORK"
install -d -m 755 "$STAGE/DEBIAN" "$STAGE/usr/bin" "$STAGE/lib/systemd/system" \
    "$STAGE/etc/amqp-outbox-relay" "$STAGE/usr/share/$PKG" "$STAGE$DOCDIR"
install -m 755 "$BIN" "$STAGE/usr/bin/"
strip --remove-section=.comment --remove-section=.note --strip-unneeded "$STAGE/usr/bin/amqp-outbox-relay"
install -m 644 "$RELAY_SRC/amqp-outbox-relay.service" "$STAGE/lib/systemd/system/"
install -m 644 "$RELAY_SRC/relay.toml" "$STAGE/etc/amqp-outbox-relay/"
install -m 644 "$SQL" "$STAGE/usr/share/$PKG/"
# Every update script, for installs made with an earlier version (run in order up to this one).
for update in "$ROOT"/sql/hosted/amqp_outbox_hosted--*--*.sql; do
    [ -f "$update" ] && install -m 644 "$update" "$STAGE/usr/share/$PKG/"
done
for f in relay.md install.md reference.md guarantees.md; do
    gzip -9n <"$ROOT/docs/$f" >"$STAGE$DOCDIR/$f.gz"
done
gzip -9n <"$ROOT/CHANGELOG.md" >"$STAGE$DOCDIR/CHANGELOG.md.gz"
gzip -9n <"$DEBIAN_SRC/changelog" >"$STAGE$DOCDIR/changelog.gz"
write_copyright "$STAGE$DOCDIR/copyright" -p amqp_outbox_relay

printf '/etc/amqp-outbox-relay/relay.toml\n' >"$STAGE/DEBIAN/conffiles"
sed "s/PGVERSION/0/g" "$DEBIAN_SRC/control.in" >"$WORK/debian/control"
cp "$DEBIAN_SRC/changelog" "$WORK/debian/changelog"
(
    cd "$WORK"
    dpkg-shlibdeps -T"debian/$PKG.substvars" "debian/$PKG/usr/bin/amqp-outbox-relay"
    dpkg-gencontrol -p"$PKG" -P"debian/$PKG" -T"debian/$PKG.substvars"
)
finish_stage "$STAGE" /usr/bin/amqp-outbox-relay

DEB="$ROOT/target/package/${PKG}_${VERSION}_${ARCH}.deb"
dpkg-deb --root-owner-group --build "$STAGE" "$DEB"
say "Built ${DEB#"$ROOT"/}"
dpkg-deb --field "$DEB" Package Version Architecture Installed-Size Depends | sed 's/^/    /'
