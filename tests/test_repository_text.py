"""The repository speaks about the software, not about how it was made: no development sessions, issue
numbers, bare dates of runs or "before/after" essays in docs, comments or docstrings (history lives in
git). A word list over every text file git tracks; CHANGELOG.md may date its releases."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
             "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|\\d+(?:st|nd|rd|th)")
# Each: (what it catches, pattern). Case-insensitive.
WORDS = [
    ("a development session by ordinal", rf"\b(?:{_ORDINALS}|previous|earlier|last|next|this|that) session\b"),
    ("a development session by number", r"\bsessions? \d+\b"),
    ("work done 'in one session'", r"\bin one session\b"),
    ("an issue or pull request number", r"\b(?:issue|pr|pull request)s? #?\d+\b"),
    ("a comparison with an earlier state of the code", r"\bthe run before\b|\bbefore/after\b"),
    # (a date quoted as a value, or a timestamp, is test data)
    ("a bare date (a dated run)", r"(?<![\"'])\b20\d\d-[01]\d-[0-3]\d\b(?![T\"'])"),
]
DATES_ALLOWED = {"CHANGELOG.md"}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".json", ".ipynb", ".sh", ""}


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    out = []
    for name in names:
        path = ROOT / name
        if path.suffix in TEXT_SUFFIXES and path.is_file() and path != Path(__file__).resolve():
            out.append(path)
    return out


def cells_text(path: Path) -> str:
    """A notebook's sources (its outputs are what a run printed, not prose of ours)."""
    import json
    notebook = json.loads(path.read_text(encoding="utf-8"))
    return "\n".join("".join(cell.get("source", "")) for cell in notebook.get("cells", []))


@pytest.mark.parametrize("what, pattern", WORDS, ids=[w for w, _ in WORDS])
def test_no_development_history_in_the_repository(what, pattern):
    regex = re.compile(pattern, re.IGNORECASE)
    hits = []
    for path in tracked_text_files():
        rel = path.relative_to(ROOT).as_posix()
        if what.startswith("a bare date") and rel in DATES_ALLOWED:
            continue
        try:
            text = cells_text(path) if path.suffix == ".ipynb" else path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, ValueError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if regex.search(line):
                hits.append(f"{rel}:{n}: {line.strip()[:120]}")
    assert not hits, f"{what} in the repository (history belongs in git):\n" + "\n".join(hits[:40])
