"""The house's import rules: the planning core needs no torch and every module of trainer, varunad
and protocol imports on its own (no cycle at import time), both checked in fresh interpreters;
and trainer's parts and varunad's layers import each other in one direction only, read from the
source (imports inside functions included, since a lazy import is a dependency too)."""

import ast
from pathlib import Path

from support import REPO
from support.sources import module_names

# trainer's parts, lowest first: a part may import only the parts before it. The package root
# `trainer` (the API, whose names are looked up lazily) is not a part, and a module that does
# `import trainer` to find the package depends on nothing by it.
TRAINER_ORDER = (
    "trainer.errors",
    "trainer.spare",        # imports no part of trainer before it runs a worker script
    "trainer.planning",     # numpy only: the one part of trainer the control plane imports
    "trainer.worker_env",
    "trainer.graph",
    "trainer.checkpoint",
    "trainer.net",
    "trainer.data",
    "trainer.models",
    "trainer.launch",
    "trainer.engine",
    "trainer.profiler",
    "trainer.linkprobe",    # measures a link with the engine's transports and the profiler's fit
)
# Back edges between parts known and allowed, each with what would remove it. None today: the
# engine reaches the profiler's calibration run through trainer.engine.hooks, which the package
# root (not a part) sets.
KNOWN_BACK_EDGES: set[tuple[str, str]] = set()


def _part(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "trainer" or len(parts) == 1:
        return None
    return ".".join(parts[:2])


def _imports(path: Path, module: str, is_package: bool) -> set[str]:
    """Every module `path` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            # `from trainer.checkpoint import store` names the module trainer.checkpoint.store
            found.update(f"{target}.{a.name}" for a in node.names)
    return found


def _back_edges() -> list[tuple[str, str]]:
    rank = {p: i for i, p in enumerate(TRAINER_ORDER)}
    known = set(module_names("trainer"))
    back = []
    for f in sorted((REPO / "trainer").rglob("*.py")):
        parts = f.relative_to(REPO).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        src = _part(module)
        if src is None:
            continue
        assert src in rank, f"{module}: part {src} is not in TRAINER_ORDER; place it there"
        for target in _imports(f, module, is_package):
            dst = _part(target)
            if dst is None or dst == src or (target not in known and dst not in known):
                continue
            assert dst in rank, f"{module} imports {target}: part {dst} is not in TRAINER_ORDER"
            if rank[dst] > rank[src]:
                back.append((module, dst))
    return sorted(set(back))


def test_trainer_parts_import_in_one_direction():
    back = _back_edges()
    unexpected = [(m, dst) for m, dst in back if (_part(m), dst) not in KNOWN_BACK_EDGES]
    assert not unexpected, ("imports against the order of TRAINER_ORDER (move the code, or the module, "
                            "to the part where it belongs):\n" + "\n".join(f"  {a} -> {b}" for a, b in unexpected))
    # a known exception that has gone away is taken off the list, so that it cannot come back unseen
    stale = KNOWN_BACK_EDGES - {(_part(m), dst) for m, dst in back}
    assert not stale, f"no longer imported, remove from KNOWN_BACK_EDGES: {sorted(stale)}"


def test_the_order_check_sees_lazy_and_from_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from trainer.engine import comm\n    import trainer.profiler\n")
    got = _imports(f, "trainer.net.m", False)
    assert {"trainer.engine.comm", "trainer.profiler"} <= got
    f.write_text("from . import netaddr\nfrom ..engine.comm import PeerChannel\n")
    got = _imports(f, "trainer.net.m", False)
    assert {"trainer.net.netaddr", "trainer.engine.comm"} <= got


# varunad's subpackages, lowest first: each may import only those before it (and itself). The
# same order is stated in ARCHITECTURE.md and in each subpackage's __init__ docstring.
VARUNAD_LAYERS = ("store", "cluster", "control", "report", "node", "ctl")


def test_varunad_subpackages_import_only_lower_layers():
    found = {p.name for p in (REPO / "varunad").iterdir() if (p / "__init__.py").exists()}
    assert found == set(VARUNAD_LAYERS), f"a subpackage is missing from VARUNAD_LAYERS: {found ^ set(VARUNAD_LAYERS)}"
    rank = {name: i for i, name in enumerate(VARUNAD_LAYERS)}
    back = []
    for f in sorted((REPO / "varunad").rglob("*.py")):
        parts = f.relative_to(REPO).parts
        if len(parts) < 3:   # varunad/__init__.py, varunad/__main__.py: the package's door, above every layer
            continue
        names = f.relative_to(REPO).with_suffix("").parts
        is_package = names[-1] == "__init__"
        module = ".".join(names[:-1] if is_package else names)
        for target in (t for t in _imports(f, module, is_package) if t.split(".")[0] == "varunad"):
            layer = target.split(".")[1] if target.count(".") else None
            if layer in rank and rank[layer] > rank[parts[1]]:
                back.append(f"{'/'.join(parts)} imports {target} ({parts[1]} is below {layer})")
    assert back == [], "\n".join(back)
