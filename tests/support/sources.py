"""The repository's Python modules, by name, for the import tests."""

from __future__ import annotations

from support import REPO


def module_names(package: str) -> list[str]:
    out = []
    for f in sorted((REPO / package).rglob("*.py")):
        parts = f.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out
