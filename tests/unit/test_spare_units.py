"""trainer.spare: a process started ahead with torch imported runs a worker script as `python
script args` would: its arguments, directory, environment, output and exit status. Real processes.
The daemon's use of it (a morph's workers started in spares) runs in every daemon ring test.


The in-process tests of tests/integration/test_spare.py (tests/README.md).
"""

from __future__ import annotations

from trainer import spare


def test_a_spare_fits_only_a_job_with_its_start_up_environment():
    base = {"OMP_NUM_THREADS": "2", "PYTHONPATH": "/opt/varunad", "VARUNA_RANK": "0"}
    assert spare.fits(base, {**base, "VARUNA_RANK": "3", "VARUNA_JOB": "gpt"})   # read after start-up
    assert not spare.fits(base, {**base, "OMP_NUM_THREADS": "4"})                 # torch read it at import
    assert not spare.fits(base, {**base, "LD_PRELOAD": "libjemalloc.so"})
    # torch's and dynamo's configs read their variables when the spare imported them
    assert not spare.fits(base, {**base, "TORCH_LOGS": "+dynamo"})
    assert not spare.fits({**base, "TORCHDYNAMO_VERBOSE": "1"}, base)
    assert spare.fits({**base, "TORCH_LOGS": "graph"}, {**base, "TORCH_LOGS": "graph", "VARUNA_RANK": "1"})


def test_the_imports_a_script_runs_at_start_are_found_and_its_own_modules_left_out(tmp_path):
    (tmp_path / "model.py").write_text("X = 1\n")          # the script's own module
    (tmp_path / "helpers").mkdir()                         # and its own package
    (tmp_path / "helpers" / "__init__.py").write_text("")
    script = tmp_path / "train.py"
    script.write_text(
        "import os, json as j\n"
        "import torch.nn.functional as F\n"
        "from transformers import GPT2Config, GPT2LMHeadModel\n"
        "from transformers import *\n"
        "from . import sibling\n"                          # relative: never ahead
        "import model\n"
        "from helpers import thing\n"
        "from trainer import Varuna\n"                     # this project's: reads the environment
        "import varunad.ctl\n"
        "if True:\n    import numpy\n"
        "try:\n    import yaml\nexcept ImportError:\n    import json5\nfinally:\n    import csv\n"
        "with open(__file__):\n    import gzip\n"
        "def f():\n    import late_module\n"                # runs later, if ever
        "class C:\n    import also_late\n")
    got = spare.script_imports(str(script))
    assert got == [("os", ()), ("json", ()), ("torch.nn.functional", ()),
                   ("transformers", ("GPT2Config", "GPT2LMHeadModel")), ("transformers", ()),
                   ("numpy", ()), ("yaml", ()), ("json5", ()), ("csv", ()), ("gzip", ())], got
    # a plain folder (a data directory) named like a package does not hide the installed one
    (tmp_path / "yaml").mkdir()
    assert ("yaml", ()) in spare.script_imports(str(script))
    (tmp_path / "broken.py").write_text("import (\n")
    assert spare.script_imports(str(tmp_path / "broken.py")) == []
    assert spare.script_imports(str(tmp_path / "missing.py")) == []
