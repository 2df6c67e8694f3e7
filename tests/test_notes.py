"""ARCHITECTURE.md's named notes: every ALL-CAPS rule name the code uses is indexed, every
indexed invariant is named in a test that guards it, and every indexed name is in the code at
the module the index says."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "streamdata"
TESTS = ROOT / "tests"

# hyphenated ALL-CAPS tokens in streamdata/ that are not notes
NOT_NOTES = {"UTF-8", "CRC-32", "GPT-2", "ISA-L", "JSON-API", "PARQUET-816", "AWS4-HMAC-SHA256",
             "UNSIGNED-PAYLOAD", "P-256", "A-Z0-9"}
NAME = re.compile(r"\b[A-Z][A-Z0-9]*(?:-[A-Z0-9]+)+\b")
ROW = re.compile(r"^\| ([A-Z][A-Z0-9-]*) \| ([^|]*) \|", re.M)


def _names(name: str, text: str) -> bool:
    """``text`` names the note ``name`` (a whole name: TRUST is not in TRUSTED, nor LIST-ONCE in
    A-LIST-ONCE)."""
    return re.search(rf"(?<![A-Z0-9-]){re.escape(name)}(?![A-Z0-9-])", text) is not None


def _tables() -> dict[str, dict[str, list[str]]]:
    """Each table of the "Named notes" section ("Invariants", "Optimisations"): note -> the
    modules its "where" names, relative to streamdata/."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text[text.index("\n## Named notes\n"):]
    end = re.search(r"\n## ", section[1:])
    section = section[:end.start() + 1] if end else section
    tables: dict[str, dict[str, list[str]]] = {}
    for part in re.split(r"\n### ", section)[1:]:
        title = part.split()[0]
        tables[title] = {name: re.findall(r"`([^`]+\.py)`", where) for name, where in ROW.findall(part)}
    assert set(tables) == {"Invariants", "Optimisations"}, set(tables)
    assert all(tables.values()), "a table without rows"
    return tables


def _indexed() -> dict[str, list[str]]:
    tables = _tables()
    both = set(tables["Invariants"]) & set(tables["Optimisations"])
    assert not both, f"in both tables: {sorted(both)}"
    return {**tables["Invariants"], **tables["Optimisations"]}


def test_every_note_the_code_uses_is_indexed():
    used: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in NAME.findall(path.read_text()):
            used.setdefault(name, str(path.relative_to(ROOT)))
    missing = sorted(used.keys() - NOT_NOTES - _indexed().keys())
    assert not missing, f"notes ARCHITECTURE.md does not index: {[(n, used[n]) for n in missing]}"


def test_every_invariant_is_named_in_a_test():
    texts = [path.read_text(errors="replace") for path in sorted(TESTS.rglob("*"))
             if path.is_file() and path != Path(__file__).resolve() and "__pycache__" not in path.parts]
    unguarded = [name for name in _tables()["Invariants"] if not any(_names(name, text) for text in texts)]
    assert not unguarded, f"invariants no test names: {unguarded}"


def test_every_note_is_in_the_code_where_the_index_says():
    absent = []
    for name, modules in _indexed().items():
        assert modules, f"{name}: no module named"
        for module in modules:
            path = PACKAGE / module
            if not path.is_file() or not _names(name, path.read_text()):
                absent.append((name, module))
    assert not absent, absent
