#!/usr/bin/env bash
# The rules a machine checks (`make lint`, run first by `make test`). Every check runs; the
# script lists the ones that failed and exits non-zero if any did.
#
#   fmt        cargo fmt --check
#   clippy     clippy -D warnings on every target of the workspace, with
#              clippy::undocumented_unsafe_blocks (every `unsafe {}` says why it is sound)
#   no-pgrx    the AMQP crate (amqp_outbox_broker), the delivery engine (amqp_outbox_engine) and
#              the relay (amqp_outbox_relay) do not depend on pgrx, even transitively: they
#              never call PostgreSQL's API (README, "How it works")
#   sql        update scripts assembled from install-script files (`make sql`) are current
#   pg_guard   every `extern "C"`/`extern "C-unwind"` fn under src/ carries #[pg_guard], so a
#              panic or ERROR inside a callback PostgreSQL calls cannot unwind through C frames;
#              except a signal handler, marked by a `// SIGNAL HANDLER:` comment saying why it
#              cannot fail (it must not raise an ERROR, which #[pg_guard] would turn a panic into)
#   docs       scripts/docs_check.py: every relative link in README.md, CHANGELOG.md and docs/
#              resolves (anchors too); docs/reference.md has an entry for every function, view,
#              table, type and setting the sources define and none for anything else; and its
#              self-test (each check fails on a planted omission). Build-free: the comparison
#              with the installed catalog runs in the end-to-end test docs_examples, after
#              `make install-test` (docs/contributing.md)
#   changelog  packaging/debian/changelog is what scripts/debian_changelog.py makes of
#              CHANGELOG.md (the one place a release's changes are written)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CARGO=${CARGO:-cargo}
BROKER_CRATE=amqp_outbox_broker
ENGINE_CRATE=amqp_outbox_engine
RELAY_CRATE=amqp_outbox_relay
failed=()

run() {
    local name=$1
    shift
    echo "==> lint: $name"
    if ! "$@"; then
        failed+=("$name")
    fi
}

check_sql() {
    local f
    for f in sql/upgrade/*.head.sql; do
        local step=${f#sql/upgrade/}
        step=${step%.head.sql}
        local target=sql/amqp_outbox--$step.sql
        # Its parts, in order: the prerequisites of its rule in the Makefile (`cat $^`).
        local parts
        parts=$(sed -n "s|^$target: *||p" Makefile)
        [ -n "$parts" ] || { echo "lint: the Makefile has no rule for $target" >&2; return 1; }
        # shellcheck disable=SC2086 # a list of file names
        cat $parts | cmp -s - "$target" ||
            { echo "lint: $target is not current: run 'make sql'" >&2; return 1; }
    done
    python3 scripts/hosted_sql.py --check
}

check_fmt() {
    "$CARGO" fmt --all -- --check ||
        { echo "lint: code is not formatted: run 'cargo fmt --all'" >&2; return 1; }
}

check_clippy() {
    # The lint is also enabled in Cargo.toml ([workspace.lints]) for the crates that opt in; the
    # flag here covers every member, whichever manifests opt in. --keep-going: every crate's
    # findings in one run.
    "$CARGO" clippy --workspace --all-targets --keep-going -- -D warnings -W clippy::undocumented_unsafe_blocks ||
        { echo "lint: clippy found problems (see above)" >&2; return 1; }
    # The test build's code (`make install-test`) is checked too.
    "$CARGO" clippy -p amqp_outbox --all-targets --features fault-injection -- -D warnings -W clippy::undocumented_unsafe_blocks ||
        { echo "lint: clippy found problems in the fault-injection build (see above)" >&2; return 1; }
}

check_no_pgrx() {
    # The AMQP thread's crate, the delivery engine and the relay never reach PostgreSQL's API.
    # `cargo tree -i pgrx` is no use here: "not in the graph" and "cargo failed" both exit 101.
    # So list the whole graph (every target platform, build scripts included), require that the
    # listing worked, and look for any pgrx crate in it.
    local crate tree found
    for crate in "$BROKER_CRATE" "$ENGINE_CRATE" "$RELAY_CRATE"; do
        if ! tree=$("$CARGO" tree -p "$crate" -e normal,build --target all --prefix none \
            --format '{p}'); then
            echo "lint: cargo tree failed for $crate" >&2
            return 1
        fi
        if ! grep -q "^$crate v" <<<"$tree"; then
            echo "lint: cargo tree did not list $crate itself; cannot check its dependencies" >&2
            return 1
        fi
        found=$(grep -E '^pgrx[-_a-z0-9]* v' <<<"$tree" | sort -u)
        if [ -n "$found" ]; then
            echo "lint: $crate depends on pgrx (it must not reach PostgreSQL's API):" >&2
            sed 's/^/    /' <<<"$found" >&2
            echo "    see: $CARGO tree -p $crate -e normal,build --target all -i <crate>" >&2
            return 1
        fi
    done
}

check_pg_guard() {
    # An item's attributes are the lines between it and the end of the previous item or block
    # (a line ending in `{`, `}` or `;`); an extern fn whose attributes lack #[pg_guard] is
    # reported. Function-pointer types (`extern "C" fn(`) have no name and do not match.
    local missing
    missing=$(find src -name '*.rs' -print0 | sort -z | xargs -0 awk '
        FNR == 1 { guarded = 0 }
        /^[[:space:]]*\/\/ SIGNAL HANDLER:/ { guarded = 1; next }
        /^[[:space:]]*\/\// { next }
        /^[[:space:]]*#\[(::)?(pgrx::)?pg_guard[\](]/ { guarded = 1; next }
        /extern[[:space:]]+"C(-unwind)?"[[:space:]]+fn[[:space:]]+[A-Za-z_]/ {
            if (!guarded) print FILENAME ":" FNR ": " $0
            guarded = 0
            next
        }
        /[{};][[:space:]]*$/ { guarded = 0 }
    ')
    if [ -n "$missing" ]; then
        echo "lint: extern \"C\" functions without #[pg_guard] (PostgreSQL calls them; a panic must become an ERROR):" >&2
        sed 's/^/    /' <<<"$missing" >&2
        return 1
    fi
}

run sql check_sql
run fmt check_fmt
run clippy check_clippy
run no-pgrx check_no_pgrx
run pg_guard check_pg_guard
run docs python3 scripts/docs_check.py
run changelog python3 scripts/debian_changelog.py --check

if [ ${#failed[@]} -gt 0 ]; then
    echo "make lint: FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "make lint: all passed (sql fmt clippy no-pgrx pg_guard docs changelog)"
