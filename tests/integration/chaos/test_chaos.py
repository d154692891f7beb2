"""The chaos suite (issue 17): one fault per scenario against real etcd, daemons and workers.

Every scenario runs a short job of the tiny GPT (checkpoint every 4 steps, TTL 2 s), injects its
fault after the first checkpoint, and asserts that the job finishes, that its losses equal the
plain PyTorch loop within 1e-4, that at most one checkpoint interval of steps was redone, and
that no daemon or worker is left running. ``benchmarks/chaos.py`` runs the same scenarios and
prints them as a table. Run just this suite with ``pytest -m chaos``: kill -9 of a VM and of the
leader are tests/integration/test_daemon_ring.py's kill tests (marked chaos; the same fault is not run twice).
"""

from __future__ import annotations

import pytest
from support.chaos_harness import ELSEWHERE, EVERY, SCENARIOS, run_named

pytestmark = [pytest.mark.slow, pytest.mark.chaos]


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s not in ELSEWHERE])
def test_the_job_survives(scenario, tmp_path):
    out = run_named(scenario, tmp_path)
    print(f"\n{scenario}: finished={out.finished} equal={out.equal} redone={out.redone} "
          f"recovery={out.recovery_s:.1f}s morphs={[m.get('reason', '')[:70] for m in out.state.get('morphs', [])]}")
    assert not out.problems(EVERY), "\n".join(out.problems(EVERY)) + "\n" + out.note
