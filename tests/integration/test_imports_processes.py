"""The house's import rules: the planning core needs no torch and every module of trainer, varunad
and protocol imports on its own (no cycle at import time), both checked in fresh interpreters;
and trainer's parts and varunad's layers import each other in one direction only, read from the
source (imports inside functions included, since a lazy import is a dependency too).

The tests of tests/unit/test_imports.py that need processes or a real etcd (tests/README.md).
"""

import json
import subprocess
import sys

from support import REPO
from support.sources import module_names

PACKAGES = ("trainer", "varunad", "protocol")


def _run(code: str) -> str:
    # cwd=REPO with -c: this tree comes first on sys.path, whatever is installed
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(REPO), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_planning_imports_no_torch():
    planning = [m for m in module_names("trainer") if m == "trainer.planning" or m.startswith("trainer.planning.")]
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
    modules = [m for p in PACKAGES for m in module_names(p)]
    assert len(modules) > 60 and "varunad.node.daemon" in modules and "trainer.engine.varuna" in modules
    failed = json.loads(_run(f"MODULES = {modules!r}\nPACKAGES = {PACKAGES!r}\n" + _EACH_ALONE).splitlines()[-1])
    assert failed == {}, "\n".join(f"{m}:\n{why}" for m, why in failed.items())
