"""`varunactl keys generate|show`: files, modes, refusals, one-line errors.

The tests of tests/unit/test_cli_keys.py that need processes or a real etcd (tests/README.md).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from protocol.security import load_public_key


@pytest.mark.skipif(shutil.which("varunactl") is None, reason="package not installed (pip install -e .)")
def test_console_script(tmp_path):
    done = subprocess.run(["varunactl", "keys", "generate", "--dir", str(tmp_path), "--name", "n"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    shown = subprocess.run(["varunactl", "keys", "show", str(tmp_path / "n.key")],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and shown.stdout.strip().encode() == load_public_key(tmp_path / "n.key")
