"""`varunactl kill VM --at-step N [--notice]` rehearses a preemption on the user's own job on a local
ring (real etcd, real daemons, real workers): it waits for the step, kills the daemon's process
group as a vanished VM dies (or sends the notice), and prints the morph and where it resumed."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import psutil
import pytest
from support import REPO, TESTS

from varunad.ctl import local

pytestmark = pytest.mark.slow



def _varunactl(*args: str, env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "varunad.ctl.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO)


def test_kill_at_a_step_morphs_the_job_and_says_where_it_resumed(tmp_path):
    state = tmp_path / "ring"
    env = {k: v for k, v in os.environ.items() if k not in ("VARUNAD_ETCD", "VARUNAD_LOCAL_DIR")}
    try:
        up = _varunactl("up", "3", "--dir", str(state), "--ttl", "3", "--", "--calibrate", "uniform", env=env)
        assert up.returncode == 0, up.stderr
        ring = local.read_ring(state)
        env |= {"VARUNAD_LOCAL_DIR": str(state)}
        # before any job: nothing to wait for, and a VM the ring does not have
        none = _varunactl("kill", "vm2", "--at-step", "3", env=env)
        assert none.returncode == 1 and "no job is running or queued: submit one first" in none.stderr, none.stderr
        wrong = _varunactl("kill", "vm7", "--at-step", "3", env=env)
        assert wrong.returncode == 1 and "the ring has no daemon vm7 (it has vm1, vm2, vm3)" in wrong.stderr
        script = str(TESTS / "daemon_job" / "train_job.py")
        sub = _varunactl("submit", "--name", "rehearsal", "--batch-size", "12", "--steps", "300",
                         "--checkpoint-every", "5", script, env=env)
        assert sub.returncode == 0, sub.stderr
        kill = _varunactl("kill", "vm2", "--at-step", "8", env=env)
        assert kill.returncode == 0, kill.stdout + kill.stderr
        lines = kill.stdout.splitlines()
        pid = ring.daemon("vm2").pid
        killed = re.fullmatch(r"killed    vm2 \(pid (\d+), and its workers\) once rehearsal reported step (\d+): SIGKILL, as a "
                              r"VM that vanished", lines[0])
        assert killed and int(killed[1]) == pid and int(killed[2]) >= 8, lines
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert lines[1].startswith("morph 1x3 -> 1x2 "), lines
        resumed = re.fullmatch(r"resumed   at step (\d+) in epoch (\d+) as 1x2", lines[2])
        # the status trails the workers by a few steps: the job stood at least where it said, and
        # resumes at least from the checkpoint before that (every 5 steps)
        assert resumed and int(resumed[1]) >= int(killed[2]) // 5 * 5, lines
        # a preemption notice: the daemon checkpoints and leaves
        at = str(int(resumed[1]) + 30)
        notice = _varunactl("kill", "vm3", "--at-step", at, "--notice", "--job", "rehearsal", env=env)
        assert notice.returncode == 0, notice.stdout + notice.stderr
        lines = notice.stdout.splitlines()
        assert "SIGTERM, as a preemption notice" in lines[0] and lines[1].startswith("morph 1x2 -> 1x1 "), lines
        assert re.fullmatch(r"resumed   at step \d+ in epoch \d+ as 1x1", lines[-1]), lines
        watch = _varunactl("watch", "rehearsal", "--interval", "0.3", env=env)
        assert watch.returncode == 0 and "rehearsal 300/300 done" in watch.stdout, watch.stdout[-2000:]
        late = _varunactl("kill", "vm1", "--at-step", "400", "--job", "rehearsal", env=env)
        assert late.returncode == 1 and "rehearsal is done at step 300, before step 400" in late.stderr, late.stderr
    finally:
        local.down(state, timeout=10)
