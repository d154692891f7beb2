"""A daemon's workers and spares die with it (varunad.node.supervisor.dying_with), started without
a preexec_fn: a plain fork of the daemon, which runs gRPC threads, crashed children in an outside test."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from varunad.node.supervisor import dying_with


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as f:   # a zombie waiting for init to reap it is gone too
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        time.sleep(0.05)
    return False


def test_the_command_runs_in_the_same_process_and_dies_with_its_parent():
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, subprocess, sys, time
        from varunad.node.supervisor import dying_with
        child = subprocess.Popen(dying_with(os.getpid(), [sys.executable, "-c",
                                 "import os, time; print(os.getpid(), flush=True); time.sleep(120)"]),
                                 stdout=subprocess.PIPE, text=True, start_new_session=True)
        print(child.pid, child.stdout.readline().strip(), flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        started, ran_as = parent.stdout.readline().split()
        assert started == ran_as   # exec'd in place: the pid the daemon watches is the command's
        child = int(started)
        assert not _gone(child, 0.3)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert _gone(child, 10), "the child outlived its parent"
    finally:
        parent.kill()


def test_a_command_whose_parent_is_already_gone_does_not_run():
    # the parent it is told of is not its parent: as if the daemon had died before the child set its signal
    done = subprocess.run(dying_with(1, [sys.executable, "-c", "print('ran')"]), capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 1 and "ran" not in done.stdout
