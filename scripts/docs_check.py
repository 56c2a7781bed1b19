#!/usr/bin/env python3
"""The documentation's machine-checked rules (docs/contributing.md, "The documentation checks").

    scripts/docs_check.py                 links + sources + selftest (what `make lint` runs)
    scripts/docs_check.py links           every relative link in README.md, CHANGELOG.md and
                                          docs/*.md resolves: the file exists, and an anchor
                                          (#...) names a heading of the target Markdown file
    scripts/docs_check.py sources         docs/reference.md has one entry for every function,
                                          view, table, type and setting the sources define, and
                                          no entry for anything they do not (build-free)
    scripts/docs_check.py catalog [--host H] [--port P] [--user U]
                                          the same against the installed extension's catalog:
                                          a temporary database with CREATE EXTENSION amqp_outbox
                                          on a server that preloads the library (the end-to-end
                                          test docs_examples runs this on its private cluster)
    scripts/docs_check.py selftest        plants omissions in a copy of the docs and checks that
                                          each check fails on them

An entry of docs/reference.md is a name written in backticks, `amqp.<name>` or
`amqp_outbox.<setting>`, in a heading or in the first cell of a table row. Settings named
amqp_outbox.test_* exist only in the test build (cargo feature fault-injection): they are
ignored on both sides. Standard library only (Python 3.11), plus psql for `catalog`.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = "docs/reference.md"
NAME = r"[A-Za-z_][A-Za-z0-9_]*"


def fail(msg: str) -> None:
    print(f"docs_check: {msg}", file=sys.stderr)


# --- Markdown helpers ------------------------------------------------------------------------


def strip_code(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fence = [], None
    for n, line in enumerate(text.split("\n"), 1):
        m = re.match(r"^\s*(```+|~~~+)(.*)$", line)
        if m:
            mark = m.group(1)
            if fence is None:
                fence = mark
                continue
            if mark[0] == fence[0] and len(mark) >= len(fence) and not m.group(2).strip():
                fence = None
                continue
        if fence is None:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    """The anchor GitHub (and GitLab, Gitea) make of a heading."""
    h = heading.strip().lower()
    h = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", h)  # links: their text
    out = []
    for ch in h:
        if ch in " -":
            out.append("-")
        elif ch == "_" or ch.isalnum() or unicodedata.category(ch).startswith("M"):
            out.append(ch)
    return "".join(out)


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for _, line in strip_code(path.read_text(encoding="utf-8")):
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        result.add(base if n == 0 else f"{base}-{n}")
    for m in re.finditer(r'<a\s+(?:name|id)="([^"]+)"', path.read_text(encoding="utf-8")):
        result.add(m.group(1))
    return result


def doc_files(root: Path) -> list[Path]:
    files = [root / "README.md", root / "CHANGELOG.md"]
    files += sorted((root / "docs").glob("*.md"))
    return [f for f in files if f.exists()]


# --- links -----------------------------------------------------------------------------------


def check_links(root: Path) -> list[str]:
    problems = []
    cache: dict[Path, set[str]] = {}
    for f in doc_files(root):
        for n, line in strip_code(f.read_text(encoding="utf-8")):
            line = re.sub(r"`[^`]*`", "", line)  # inline code is not a link
            for m in re.finditer(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line):
                target = m.group(1)
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto:, ...
                    continue
                path_part, _, anchor = target.partition("#")
                dest = (f.parent / path_part).resolve() if path_part else f
                where = f"{f.relative_to(root)}:{n}: link {target}"
                if not dest.exists():
                    problems.append(f"{where}: {path_part} does not exist")
                    continue
                if anchor and dest.suffix == ".md":
                    if dest not in cache:
                        cache[dest] = anchors(dest)
                    if anchor not in cache[dest]:
                        problems.append(f"{where}: no heading makes the anchor #{anchor}")
    return problems


# --- reference entries -----------------------------------------------------------------------


def reference_entries(root: Path) -> set[str]:
    """The names docs/reference.md documents: `amqp.x` / `amqp_outbox.x` in backticks, in a
    heading or in a table row's first cell."""
    names = set()
    for _, line in strip_code((root / REFERENCE).read_text(encoding="utf-8")):
        if line.startswith("#"):
            where = line
        elif line.startswith("|"):
            cells = line.split("|")
            where = cells[1] if len(cells) > 2 else ""
        else:
            continue
        # Each code span names one object: its first name (argument types and defaults after
        # it, such as `amqp.delivery` in a signature, are not entries).
        for code in re.findall(r"`([^`]*)`", where):
            m = re.match(rf"\s*(amqp_outbox\.{NAME}|amqp\.{NAME})", code)
            if m:
                names.add(m.group(1))
    return {n for n in names if not n.startswith("amqp_outbox.test_")}


def compare(documented: set[str], actual: set[str], source: str) -> list[str]:
    problems = []
    for n in sorted(actual - documented):
        problems.append(f"{n} exists ({source}) but has no entry in {REFERENCE}")
    for n in sorted(documented - actual):
        problems.append(f"{REFERENCE} documents {n}, which does not exist ({source})")
    return problems


# --- what the sources define ------------------------------------------------------------------


def source_objects(root: Path) -> set[str]:
    names: set[str] = set()
    lib = (root / "src/lib.rs").read_text(encoding="utf-8")
    sql_files = re.findall(r'extension_sql_file!\(\s*"\.\./(sql/[^"]+)"', lib)
    if not sql_files:
        raise RuntimeError("found no extension_sql_file! in src/lib.rs")
    create = re.compile(
        rf"CREATE\s+(?:OR\s+REPLACE\s+)?(?:UNLOGGED\s+)?(?:FUNCTION|VIEW|TABLE|TYPE)\s+"
        rf"(?:IF\s+NOT\s+EXISTS\s+)?@extschema@\.({NAME})",
        re.I,
    )
    drop = re.compile(rf"DROP\s+(?:FUNCTION|VIEW|TABLE|TYPE)\s+(?:IF\s+EXISTS\s+)?@extschema@\.({NAME})", re.I)
    for f in sql_files:
        text = re.sub(r"--[^\n]*", "", (root / f).read_text(encoding="utf-8"))
        names.update("amqp." + n for n in create.findall(text))
        for n in drop.findall(text):
            names.discard("amqp." + n)
    # Functions pgrx generates: #[pg_extern] (its `name = "..."`, else the fn's name), not
    # `sql = false`; #[pg_trigger].
    for rs in sorted((root / "src").rglob("*.rs")):
        text = rs.read_text(encoding="utf-8")
        for m in re.finditer(r"#\[(pg_extern|pg_trigger)(\(([^\]]*)\))?\]\s*(?:(?:#\[[^\]]*\]|///[^\n]*)\s*)*(?:pub(?:\([^)]*\))?\s+)?fn\s+([A-Za-z_0-9]+)", text):
            args = m.group(3) or ""
            if re.search(r"\bsql\s*=\s*false", args):
                continue
            named = re.search(r'\bname\s*=\s*"([^"]+)"', args)
            names.add("amqp." + (named.group(1) if named else m.group(4)))
    gucs = (root / "src/gucs.rs").read_text(encoding="utf-8")
    names.update(re.findall(rf'c"(amqp_outbox\.{NAME})"', gucs))
    return {n for n in names if not n.startswith("amqp_outbox.test_")}


HOSTED_SECTION = "## Only in the plain-SQL install"


def hosted_only_entries(root: Path) -> set[str]:
    """The entries under the heading HOSTED_SECTION: objects of the plain-SQL install
    (sql/hosted/) that the extension does not have."""
    names = set()
    inside = False
    for _, line in strip_code((root / REFERENCE).read_text(encoding="utf-8")):
        if line.startswith("## "):
            inside = line.strip() == HOSTED_SECTION
        if inside and line.startswith("|"):
            cells = line.split("|")
            for code in re.findall(r"`([^`]*)`", cells[1] if len(cells) > 2 else ""):
                m = re.match(rf"\s*(amqp\.{NAME})", code)
                if m:
                    names.add(m.group(1))
    return names


def hosted_objects(root: Path) -> set[str]:
    """What the plain-SQL install's own files (sql/hosted/*.sql but the generated script)
    define in the schema amqp."""
    create = re.compile(
        rf"CREATE\s+(?:OR\s+REPLACE\s+)?(?:UNLOGGED\s+)?(?:FUNCTION|VIEW|TABLE|TYPE)\s+"
        rf"(?:IF\s+NOT\s+EXISTS\s+)?amqp\.({NAME})",
        re.I,
    )
    names: set[str] = set()
    for f in sorted((root / "sql" / "hosted").glob("*.sql")):
        if f.name.startswith("amqp_outbox_hosted--"):
            continue
        text = re.sub(r"--[^\n]*", "", f.read_text(encoding="utf-8"))
        names.update("amqp." + n for n in create.findall(text))
    return names


def check_sources(root: Path) -> list[str]:
    extension = source_objects(root)
    problems = compare(reference_entries(root), extension | hosted_objects(root), "in the sources")
    # The plain-SQL install's section lists exactly what only it has.
    problems += compare(hosted_only_entries(root), hosted_objects(root) - extension,
                        f"only in sql/hosted, under \"{HOSTED_SECTION}\"")
    return problems


# --- the installed catalog --------------------------------------------------------------------

CATALOG_SQL = """
SELECT 'amqp.' || p.proname FROM pg_catalog.pg_proc p
  JOIN pg_catalog.pg_depend d ON d.classid = 'pg_catalog.pg_proc'::pg_catalog.regclass
   AND d.objid = p.oid AND d.deptype = 'e'
  JOIN pg_catalog.pg_extension e ON e.oid = d.refobjid AND e.extname = 'amqp_outbox'
 WHERE p.pronamespace = 'amqp'::pg_catalog.regnamespace
UNION
SELECT 'amqp.' || c.relname FROM pg_catalog.pg_class c
  JOIN pg_catalog.pg_depend d ON d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass
   AND d.objid = c.oid AND d.deptype = 'e'
  JOIN pg_catalog.pg_extension e ON e.oid = d.refobjid AND e.extname = 'amqp_outbox'
 WHERE c.relnamespace = 'amqp'::pg_catalog.regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
UNION
SELECT 'amqp.' || t.typname FROM pg_catalog.pg_type t
  JOIN pg_catalog.pg_depend d ON d.classid = 'pg_catalog.pg_type'::pg_catalog.regclass
   AND d.objid = t.oid AND d.deptype = 'e'
  JOIN pg_catalog.pg_extension e ON e.oid = d.refobjid AND e.extname = 'amqp_outbox'
 WHERE t.typnamespace = 'amqp'::pg_catalog.regnamespace AND t.typtype IN ('c', 'e', 'd')
UNION
SELECT name FROM pg_catalog.pg_settings
 WHERE name LIKE 'amqp\\_outbox.%' AND name NOT LIKE 'amqp\\_outbox.test\\_%'
"""


def psql(args: list[str], db: str, sql: str) -> str:
    cmd = ["psql", "-X", "-A", "-t", "-q", "-v", "ON_ERROR_STOP=1", *args, "-d", db, "-c", sql]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise RuntimeError("psql not found on the PATH")
    if r.returncode != 0:
        raise RuntimeError(f"psql {' '.join(args)} -d {db} failed: {r.stderr.strip()}")
    return r.stdout


def catalog_objects(conn: list[str]) -> set[str]:
    try:
        preloaded = psql(conn, "postgres", "SELECT current_setting('shared_preload_libraries')")
    except RuntimeError as e:
        raise RuntimeError(f"cannot connect to the server to read the catalog: {e}")
    if "amqp_outbox" not in [p.strip() for p in preloaded.strip().split(",")]:
        raise RuntimeError(
            "the server does not preload amqp_outbox (shared_preload_libraries): its settings "
            "are registered only when the library is loaded at server start; use a server "
            "that preloads it (the end-to-end test docs_examples starts one)"
        )
    db = f"amqp_outbox_docs_check_{os.getpid()}"
    psql(conn, "postgres", f"CREATE DATABASE {db}")
    try:
        out = psql(conn, db, "CREATE EXTENSION amqp_outbox;" + CATALOG_SQL)
    finally:
        psql(conn, "postgres", f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
    names = {line.strip() for line in out.splitlines() if line.strip()}
    if not any(n.startswith("amqp.") for n in names):
        raise RuntimeError("the catalog listed no object of the extension")
    return names


def check_catalog(root: Path, conn: list[str]) -> list[str]:
    documented = reference_entries(root) - hosted_only_entries(root)
    return compare(documented, catalog_objects(conn), "in the installed catalog")


# --- self-test --------------------------------------------------------------------------------


def selftest(root: Path) -> list[str]:
    """Each check must pass on the docs as they are and fail on a planted omission."""
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp)
        for f in doc_files(root):
            (copy / f.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, copy / f.relative_to(root))
        for d in ("src", "sql"):
            shutil.copytree(root / d, copy / d)
        for other in ("bench/RESULTS.md", "tests/README.md"):
            (copy / other).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(root / other, copy / other)
        ref = copy / REFERENCE
        original = ref.read_text(encoding="utf-8")

        def expect(label: str, check, should_fail: bool):
            found = check(copy)
            if should_fail and not found:
                problems.append(f"selftest: the check did not notice {label}")
            if not should_fail and found:
                problems.append(f"selftest: the check fails on the unchanged copy ({label}): {found[0]}")

        expect("nothing", check_sources, False)
        expect("nothing", check_links, False)
        # 1. a function's entry removed
        ref.write_text(re.sub(r"^### `amqp\.wake\(\).*$", "### wake", original, flags=re.M), encoding="utf-8")
        expect("a function without an entry (amqp.wake)", check_sources, True)
        # 2. a setting's row removed
        ref.write_text(re.sub(r"^\| `amqp_outbox\.heartbeat` \|.*\n", "", original, flags=re.M), encoding="utf-8")
        expect("a setting without an entry (amqp_outbox.heartbeat)", check_sources, True)
        # 3. an entry for something that does not exist
        ref.write_text(original + "\n### `amqp.no_such_function()`\n", encoding="utf-8")
        expect("an entry for a function that does not exist", check_sources, True)
        # 4. a table the sources define, unknown to the reference
        ref.write_text(original, encoding="utf-8")
        (copy / "sql/schema.sql").write_text(
            (copy / "sql/schema.sql").read_text(encoding="utf-8")
            + "\nCREATE TABLE @extschema@.planted_table (x int);\n",
            encoding="utf-8",
        )
        expect("a new table without an entry", check_sources, True)
        # 5. a link to a missing file, 6. a link to a missing anchor
        readme = copy / "README.md"
        text = readme.read_text(encoding="utf-8")
        readme.write_text(text + "\n[gone](docs/no-such-file.md)\n", encoding="utf-8")
        expect("a link to a missing file", check_links, True)
        readme.write_text(text + "\n[gone](docs/install.md#no-such-heading)\n", encoding="utf-8")
        expect("a link to a missing anchor", check_links, True)
        readme.write_text(text, encoding="utf-8")
        # 7. the catalog comparison, with a made-up catalog
        documented = reference_entries(copy)
        if not compare(documented, documented | {"amqp.planted"}, "test"):
            problems.append("selftest: compare() did not notice an object of the catalog without an entry")
    return problems


# --- main -------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    mode = argv[1] if len(argv) > 1 else "lint"
    conn = argv[2:]
    checks = {
        "links": lambda: check_links(ROOT),
        "sources": lambda: check_sources(ROOT),
        "selftest": lambda: selftest(ROOT),
        "catalog": lambda: check_catalog(ROOT, conn),
    }
    if mode == "lint":
        run = ["links", "sources", "selftest"]
    elif mode in checks:
        run = [mode]
    else:
        print(__doc__, file=sys.stderr)
        return 2
    failed = []
    for name in run:
        try:
            problems = checks[name]()
        except RuntimeError as e:
            problems = [str(e)]
        for p in problems:
            fail(p)
        print(f"docs_check {name}: {'FAILED' if problems else 'ok'}" + (f" ({len(problems)} problem(s))" if problems else ""))
        if problems:
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
