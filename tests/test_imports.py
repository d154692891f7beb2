"""The house's import rules, checked in fresh interpreters: the planning core needs no torch, and
every module of trainer, varunad and protocol imports on its own (no cycle at import time)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("trainer", "varunad", "protocol")


def _modules(package: str) -> list[str]:
    out = []
    for f in sorted((REPO / package).rglob("*.py")):
        parts = f.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _run(code: str) -> str:
    # cwd=REPO with -c: this tree comes first on sys.path, whatever is installed
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(REPO), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_planning_imports_no_torch():
    planning = [m for m in _modules("trainer") if m == "trainer.planning" or m.startswith("trainer.planning.")]
    assert {"trainer.planning.schedule", "trainer.planning.planner", "trainer.planning.simulator"} <= set(planning)
    code = ("import importlib, json, sys\n"
            f"for m in {planning!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))")
    assert json.loads(_run(code)) == []


# Each module is imported first in a child forked from an interpreter that holds only third-party
# libraries (so a child pays for our code alone); a cycle shows up as the ImportError of a
# partially initialized module in the child that enters it from the wrong side.
_EACH_ALONE = """
import importlib, json, os, sys, traceback
for lib in ("numpy", "torch", "torch.distributed", "torch.fx", "torch.export", "zmq", "msgpack", "psutil",
            "aetcd", "cryptography", "prometheus_client"):
    try:
        importlib.import_module(lib)
    except ImportError:
        pass
failed = {}
for name in MODULES:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(name)
            os._exit(0)
        except ModuleNotFoundError as exc:
            # an optional extra that is not installed here (matplotlib for the report) is no cycle
            if exc.name and exc.name.split(".")[0] not in PACKAGES:
                os._exit(0)
            os.write(w, traceback.format_exc()[-2000:].encode())
            os._exit(1)
        except BaseException:
            os.write(w, traceback.format_exc()[-2000:].encode())
            os._exit(1)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        why = f.read().decode()
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failed[name] = why or f"exit status {status}"
print(json.dumps(failed))
"""


def test_every_module_imports_on_its_own():
    modules = [m for p in PACKAGES for m in _modules(p)]
    assert len(modules) > 60 and "varunad.node.daemon" in modules and "trainer.engine.varuna" in modules
    failed = json.loads(_run(f"MODULES = {modules!r}\nPACKAGES = {PACKAGES!r}\n" + _EACH_ALONE).splitlines()[-1])
    assert failed == {}, "\n".join(f"{m}:\n{why}" for m, why in failed.items())


# varunad's subpackages, lowest first: each may import only those before it (and itself). The
# same order is stated in ARCHITECTURE.md and in each subpackage's __init__ docstring.
VARUNAD_LAYERS = ("store", "cluster", "control", "report", "node", "ctl")


def _varunad_imports(path: Path) -> set[str]:
    """Every varunad module ``path`` imports, at module level or inside a function (a lazy
    import is still a dependency: it only moves the cycle from import time to run time)."""
    import ast
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.split(".")[0] == "varunad"}


def test_varunad_subpackages_import_only_lower_layers():
    found = {p.name for p in (REPO / "varunad").iterdir() if (p / "__init__.py").exists()}
    assert found == set(VARUNAD_LAYERS), f"a subpackage is missing from VARUNAD_LAYERS: {found ^ set(VARUNAD_LAYERS)}"
    rank = {name: i for i, name in enumerate(VARUNAD_LAYERS)}
    back = []
    for f in sorted((REPO / "varunad").rglob("*.py")):
        parts = f.relative_to(REPO).parts
        if len(parts) < 3:   # varunad/__init__.py, varunad/__main__.py: the package's door, above every layer
            continue
        for target in _varunad_imports(f):
            layer = target.split(".")[1] if target.count(".") else None
            if layer in rank and rank[layer] > rank[parts[1]]:
                back.append(f"{'/'.join(parts)} imports {target} ({parts[1]} is below {layer})")
    assert back == [], "\n".join(back)
