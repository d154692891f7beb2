"""The worker scripts of tests/workers, loaded as modules (for their models and helpers)."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from support import TESTS

WORKERS = TESTS / "workers"


def load_worker(name: str) -> ModuleType:
    """tests/workers/<name>.py as a module named ``name`` (its ``__main__`` part does not run)."""
    spec = importlib.util.spec_from_file_location(name, WORKERS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
