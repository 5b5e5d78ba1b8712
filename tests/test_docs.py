"""The user documentation (README.md and docs/*.md) holds together and its examples run.

- every relative link resolves to a file of the repository, and an anchor (`page.md#heading`, `#heading`)
  to a heading of that page, by GitHub's rule for heading ids;
- README.md stays a five-minute read: at most README_MAX_LINES lines;
- every ```python block either runs as written against the embedded broker, or is marked as a fragment
  by the line `<!-- fragment -->` directly above its opening fence. The runnable blocks are run here, one
  test each (id: file:line), with `exec` in a fresh namespace in this pytest process: they get Spark by
  `SparkSession.builder.getOrCreate()`, which returns the session of the `spark` fixture, so these tests
  use that fixture, and tests/conftest.py puts them on the Spark worker like every other Spark test.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 300
FRAGMENT = "<!-- fragment -->"


def pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fence = [], None
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        marker = re.match(r"(`{3,}|~{3,})", stripped)
        if fence is None and marker:
            fence = marker.group(1)
            continue
        if fence is not None:
            if stripped.startswith(fence) and not stripped[len(fence):].strip():
                fence = None
            continue
        out.append((n, line))
    return out


def slug(heading: str) -> str:
    """GitHub's id for a heading: its text (links and emphasis rendered, code spans' backticks dropped),
    lowercased, punctuation other than `-` and `_` removed, spaces turned into `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = text.lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The ids of a page's headings; a repeated id gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


LINK = re.compile(r"\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every markdown link outside code blocks and code spans."""
    out = []
    for n, line in prose_lines(path.read_text(encoding="utf-8")):
        line = re.sub(r"`[^`]*`", "", line)
        out += [(n, m.group(1)) for m in LINK.finditer(line)]
    return out


def test_every_relative_link_resolves():
    broken = []
    for page in pages():
        for n, target in links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):   # https:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            where = f"{rel(page)}:{n}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where}: no heading with id '{anchor}' in {rel(dest)} "
                              f"(ids: {', '.join(sorted(anchors(dest)))})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_slug_follows_githubs_rule():
    assert slug("Persistence (`--data-dir`)") == "persistence---data-dir"
    assert slug("Stream mode: `queueType=stream`") == "stream-mode-queuetypestream"
    assert slug("Users, vhosts and permissions") == "users-vhosts-and-permissions"
    assert slug("TLS (amqps)") == "tls-amqps"
    assert slug("max_connections and [limits](limits.md)") == "max_connections-and-limits"


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail into docs/")


def python_blocks() -> list[tuple[str, str, bool]]:
    """(id "file:line", code, runnable) of every ```python block in the pages."""
    blocks = []
    for page in pages():
        lines = page.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            opening = re.match(r"^(\s*)(`{3,})\s*python\s*$", lines[i])
            if not opening:
                i += 1
                continue
            indent, fence = opening.group(1), opening.group(2)
            start = i
            i += 1
            body = []
            while i < len(lines) and lines[i].strip() != fence:
                body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
                i += 1
            i += 1
            fragment = start > 0 and lines[start - 1].strip() == FRAGMENT
            blocks.append((f"{rel(page)}:{start + 1}", "\n".join(body) + "\n", not fragment))
    return blocks


BLOCKS = python_blocks()
RUNNABLE = [(name, code) for name, code, runnable in BLOCKS if runnable]


def test_there_are_runnable_examples():
    """The quickstarts run; so a page whose every block became a fragment is noticed."""
    assert any(name.startswith("README.md:") for name, _ in RUNNABLE)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, code", RUNNABLE, ids=[name for name, _ in RUNNABLE])
def test_python_block_runs(name, code, spark):
    """Run one documented block as a user would paste it. Whatever it leaves running (a streaming query,
    a started Broker) is stopped afterwards."""
    from spark_amqp_broker import Broker

    namespace = {"__name__": "__docs__"}
    try:
        exec(compile(code, name, "exec"), namespace)
    finally:
        for query in spark.streams.active:
            try:
                query.stop()
            except Exception:
                pass
        for value in list(namespace.values()):
            if isinstance(value, Broker):
                value.stop()
