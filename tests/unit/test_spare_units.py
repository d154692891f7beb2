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
