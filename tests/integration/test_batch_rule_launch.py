"""One rule for batch and micro-batch sizes (trainer.planning.parallel.micro_batches), followed by the
engine under the launcher, by `varunactl submit` and by the planner: a replica's share of the global
batch is cut into micro-batches of the chosen size, the last one smaller when the size does not
divide the share; only a global batch that does not split evenly over the replicas is refused, in
the same words everywhere.

The tests of tests/unit/test_batch_rule.py that need processes or a real etcd (tests/README.md).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from support import REPO

from trainer.errors import ConfigError
from trainer.planning.parallel import micro_batches

GPT = REPO / "examples" / "train_gpt.py"


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.launch", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_the_launcher_trains_uneven_micro_batches_and_refuses_an_uneven_replica_split_in_the_same_words():
    ok = _launch("-P", "2", "-D", "1", str(GPT), "--preset", "tiny", "--steps", "2", "--batch-size", "30",
                 "--chunk-size", "4", "--examples", "64")
    assert ok.returncode == 0, ok.stderr[-3000:]
    bad = _launch("-P", "1", "-D", "4", str(GPT), "--preset", "tiny", "--steps", "1", "--batch-size", "30",
                  "--chunk-size", "4", "--examples", "64")
    assert bad.returncode != 0
    with pytest.raises(ConfigError) as rule:
        micro_batches(30, 4, 4)
    assert str(rule.value) in bad.stderr, bad.stderr[-3000:]
