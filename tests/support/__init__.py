"""What the test modules share: helpers no test module owns, and the repository's paths.

Test modules import from here (``from support.ring import Ring``, ``from support import REPO``),
never from one another; tests/ is on sys.path through tests/conftest.py (pytest's rootdir
conftest), and a worker or benchmark script puts it there itself.

Modules:
  * etcd_server: a real etcd (start, stop, pause, kill) and a throwaway PKI.
  * ring: a ring of real daemons on loopback (and JOB_SCRIPT, the job they train).
  * reference: the plain single-process loops a run's losses are checked against.
  * zoo, keyed_zoo: the model zoos the launcher tests train.
  * chaos_harness, store_faults: the chaos suite's scenarios and the checkpoint store's faults.
  * fabric: daemons in network namespaces on a bridge (root only).
  * cpu_quota: a cgroup v1 cpu group with a quota: a daemon as a slow VM (root only).
  * linkrun, netns_ring: runs over a fabric (the link experiment; the 3-VM ring).
  * fleet: members and election contenders against a real etcd.
  * hollow: hollow VMs, the real daemon with stand-in workers, many to a process (the scale
    benchmark's harness, benchmarks/fleet_scale.py; never imported by varunad).
  * decisions: the leader's inputs as plain data (snapshots, plans, reports).
  * fake_daemon: the daemon's control socket alone, and a launch of the tiny GPT against it.
  * metrics: reading Prometheus expositions and scraping a daemon.
  * waiting: bounded waits (``until``, ``until_async``) instead of sleeps.
  * calibrations, traces, png, normed: synthetic calibrations, trace files, PNG checks, a small model.
"""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
