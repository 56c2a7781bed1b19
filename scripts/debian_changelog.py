#!/usr/bin/env python3
"""packaging/debian/changelog, made from CHANGELOG.md: one entry per released version, its
summary line and every item of its sections, in Debian's format.

    scripts/debian_changelog.py           write packaging/debian/changelog
    scripts/debian_changelog.py --check   fail if it is not what CHANGELOG.md makes (make lint)

CHANGELOG.md is the one place a release's changes are written; the package carries them too.
"""

import datetime
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "CHANGELOG.md"
TARGET = ROOT / "packaging" / "debian" / "changelog"
PACKAGE = "amqp-outbox"
MAINTAINER = "amqp_outbox maintainers <maintainers@amqp-outbox.example.org>"
HEADING = re.compile(r"^## \[(?P<version>[0-9][^\]]*)\] - (?P<date>\d{4}-\d{2}-\d{2})\s*$")


def plain(text: str) -> str:
    """Markdown inline markup to plain text: links keep their text, code loses its backticks."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return text.replace("`", "")


def releases(markdown: str):
    """(version, date, summary, [(section, item)]) for each released version, newest first."""
    out = []
    current = None
    section = None
    item = None
    for line in markdown.splitlines():
        m = HEADING.match(line)
        if m or line.startswith("## "):
            if item is not None and current is not None:
                current[3].append((section, item))
            item = None
            current = (m["version"], m["date"], [], []) if m else None
            if current is not None:
                out.append(current)
            section = None
            continue
        if current is None:
            continue
        if line.startswith("### "):
            if item is not None:
                current[3].append((section, item))
            item = None
            section = line[4:].strip()
        elif line.startswith("- "):
            if item is not None:
                current[3].append((section, item))
            item = line[2:].strip()
        elif line.startswith("  ") and item is not None:
            item += " " + line.strip()
        elif line.strip() and section is None:
            current[2].append(line.strip())
    if item is not None and current is not None:
        current[3].append((section, item))
    return out


def bullet(text: str) -> str:
    return "\n".join(
        textwrap.wrap(plain(text), width=76, initial_indent="  * ", subsequent_indent="    ")
    )


def render(markdown: str) -> str:
    entries = []
    for version, date, summary, items in releases(markdown):
        day = datetime.datetime.strptime(date, "%Y-%m-%d").replace(
            hour=12, tzinfo=datetime.timezone.utc
        )
        lines = [f"{PACKAGE} ({version}) unstable; urgency=medium", ""]
        if summary:
            lines.append(bullet(" ".join(summary)))
        for section, text in items:
            lines.append(bullet(f"{section}: {text}" if section else text))
        lines += ["", f" -- {MAINTAINER}  {day.strftime('%a, %d %b %Y %H:%M:%S +0000')}", ""]
        entries.append("\n".join(lines))
    return "\n".join(entries)


def main() -> int:
    text = render(SOURCE.read_text(encoding="utf-8"))
    if not text:
        print("debian_changelog: no released version in CHANGELOG.md", file=sys.stderr)
        return 1
    if sys.argv[1:] == ["--check"]:
        if TARGET.read_text(encoding="utf-8") != text:
            print(
                "debian_changelog: packaging/debian/changelog is not what CHANGELOG.md makes: "
                "run scripts/debian_changelog.py",
                file=sys.stderr,
            )
            return 1
        print("debian_changelog: current")
        return 0
    TARGET.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
