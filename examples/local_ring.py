"""A local ring of varunad daemons training the GPT, with one of them preempted midway.

    python3 examples/local_ring.py [--daemons 4] [--steps 60] [--work runs/ring]

Starts a private etcd (data under --work), N daemons on loopback (plaintext: everything stays
on this machine), submits examples/train_gpt.py with varunactl, prints the job's progress,
kill -9s one non-leader daemon and its workers halfway (a spot VM vanishing), and waits until
the job is done on the survivors from its newest checkpoint, with the same global batch.
Everything it started is stopped on exit; logs stay under --work.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=REPO, env=env)


def varunactl(etcd: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "varunad.cli", "--etcd", etcd, *args],
                          capture_output=True, text=True, cwd=REPO, timeout=60)


def status(etcd: str, job: str) -> dict:
    r = varunactl(etcd, "status", job, "--json")
    return json.loads(r.stdout) if r.returncode == 0 else {}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--daemons", type=int, default=4, help="daemons (one slot each) in the ring")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--ttl", type=float, default=5.0, help="membership lease TTL, seconds")
    p.add_argument("--work", type=Path, default=Path("runs/ring"), help="etcd data, store, state and logs")
    p.add_argument("--preset", default="small", help="GPT size for examples/train_gpt.py (tiny, small)")
    p.add_argument("--no-preempt", action="store_true", help="do not kill a daemon midway")
    args = p.parse_args()
    if shutil.which("etcd") is None:
        sys.exit("etcd is not installed: apt-get install -y etcd-server")
    work = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    client, peer = free_port(), free_port()
    etcd = f"127.0.0.1:{client}"
    procs: dict[str, subprocess.Popen] = {}
    procs["etcd"] = start(["etcd", "--name", "ring", "--data-dir", str(work / "etcd"),
                           "--listen-client-urls", f"http://{etcd}", "--advertise-client-urls", f"http://{etcd}",
                           "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                           "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                           "--initial-cluster", f"ring=http://127.0.0.1:{peer}"], work / "etcd.log")
    try:
        for i in range(1, args.daemons + 1):
            name = f"vm{i}"
            procs[name] = start([sys.executable, "-m", "varunad.daemon", "--etcd", etcd, "--name", name,
                                 "--advertise", "127.0.0.1", "--slots", "1", "--store", str(work / "store"),
                                 "--state-dir", str(work / name), "--ttl", str(args.ttl), "--threads", "1",
                                 "--plaintext", "--calibrate", "profile"], work / f"{name}.log")
        print(f"etcd on {etcd}; {args.daemons} daemons; logs in {work}", flush=True)
        deadline = time.monotonic() + 120
        while varunactl(etcd, "nodes").stdout.count("vm") < args.daemons:
            if time.monotonic() > deadline:
                sys.exit(f"the daemons did not all join; see {work}/vm*.log")
            time.sleep(0.5)
        r = varunactl(etcd, "submit", "--name", "gpt", "--batch-size", str(args.batch_size),
                      "--steps", str(args.steps), "--checkpoint-every", str(args.checkpoint_every),
                      str(REPO / "examples" / "train_gpt.py"), "--", "--preset", args.preset)
        if r.returncode:
            sys.exit(r.stderr.strip())
        return watch(etcd, args, procs)
    finally:
        for name, proc in procs.items():
            if name != "etcd" and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for name, proc in procs.items():
            if name != "etcd":
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
        procs["etcd"].terminate()
        procs["etcd"].wait(30)


def watch(etcd: str, args, procs: dict[str, subprocess.Popen]) -> int:
    preempted, last = args.no_preempt, None
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        s = status(etcd, "gpt")
        plan = s.get("plan") or {}
        line = (f"{s.get('state', '?'):9} step {s.get('step', 0):4}/{args.steps}  epoch {s.get('epoch')}  "
                f"plan {plan.get('P')}x{plan.get('D')} mb {plan.get('micro_batch_size')}  "
                f"loss {s['loss_history'][-1][1]:.4f}" if s.get("loss_history") else f"{s.get('state', 'queued')}")
        if line != last:
            print(line, flush=True)
            last = line
        if s.get("state") in ("done", "failed", "cancelled"):
            print(varunactl(etcd, "status", "gpt").stdout, flush=True)
            return 0 if s["state"] == "done" else 1
        if not preempted and s.get("step", 0) >= args.steps // 2:
            leader = varunactl(etcd, "status", "--json")
            lead = json.loads(leader.stdout).get("leader") if leader.returncode == 0 else None
            victim = next(n for n in procs if n not in ("etcd", lead))
            os.killpg(procs[victim].pid, signal.SIGKILL)
            print(f"*** kill -9 {victim} (a spot VM vanished) at step {s['step']}", flush=True)
            preempted = True
        time.sleep(1.0)
    print("the job did not finish in 15 minutes", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
