"""The code cites design notes that the repository itself holds (ARCHITECTURE.md, "Design notes"),
never a document a clone does not have."""

import re

from support import REPO

SOURCES = [p for d in ("protocol", "trainer", "varunad", "tests", "benchmarks", "examples")
           for p in (REPO / d).rglob("*.py") if p.name != "test_notes.py"]
NOTE = re.compile(r"\[Note: ([^\]]+)\]")


def test_every_cited_note_is_written_down():
    written = set(NOTE.findall((REPO / "ARCHITECTURE.md").read_text()))
    assert len(written) >= 8
    cited = {(p.relative_to(REPO), name) for p in SOURCES for name in NOTE.findall(p.read_text())}
    assert cited, "no module cites a note"
    missing = sorted(f"{path}: [Note: {name}]" for path, name in cited if name not in written)
    assert not missing, "cited but not in ARCHITECTURE.md: " + ", ".join(missing)


def test_no_code_cites_a_document_outside_the_repository():
    outside = re.compile(r"DESIGN idea \d|DESIGN\.md|\.\./shared/")
    found = sorted(f"{p.relative_to(REPO)}:{i}" for p in SOURCES
                   for i, line in enumerate(p.read_text().splitlines(), 1) if outside.search(line))
    assert not found, "cites a document a clone does not have: " + ", ".join(found)
