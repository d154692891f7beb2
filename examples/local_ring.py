"""A local ring of varunad daemons training the GPT, with one of them preempted midway.

    python3 examples/local_ring.py [--quick] [--daemons 4] [--steps 60] [--dir DIR]

What it does, with the library calls behind `varunactl up`, `submit`, `watch` and `down`:
starts a private etcd and N daemons on loopback (varunad.ctl.local.up), submits
examples/train_gpt.py on this package's own Python source (shipped, nothing to download), shows
the job's live progress (varunad.ctl.progress), kill -9s one daemon that runs a worker (not the leader, unless it alone runs one) halfway
(a spot VM vanishing: the fleet notices, re-plans and carries on with the same global batch, from
the survivors' memory when every stage kept a replica, else from the newest checkpoint), waits
until the job is done, saves what each daemon's metrics endpoint serves (DIR/metrics/), writes
the report (`varunactl report` into DIR/report/: the data, and with matplotlib, pip install
'varunad[report]', the pictures loss.png, timeline.png, timeline_predicted.png and
throughput.png), and stops everything
(varunad.ctl.local.down), also on Ctrl-C or an error. Logs stay under DIR/logs.

--quick is the small size CI runs: the tiny GPT, 3 daemons, 240 short steps, a 3 s lease.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from trainer.planning.schedule import AUTO_SCHEDULE, DEFAULT_SCHEDULE, SCHEDULES
from varunad.ctl import cli, local, progress
from varunad.ctl import commands as ctl
from varunad.store.keys import Keys

REPO = Path(__file__).resolve().parent.parent
JOB = "gpt"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Full size takes 3 to 4 minutes on 2 cores (the calibration included); "
                                       "--quick about 45 s.")
    p.add_argument("--quick", action="store_true", help="CI size: tiny GPT, 3 daemons, 240 steps, 3 s lease")
    p.add_argument("--daemons", type=int, help="daemons (one slot each) in the ring (default 4; 3 with --quick)")
    p.add_argument("--steps", type=int, help="optimizer steps (default 60; 240 with --quick)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (default 16)")
    p.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (default 10; 20 with --quick)")
    p.add_argument("--ttl", type=float, help="membership lease TTL in seconds (default 5; 3 with --quick)")
    p.add_argument("--preset", help="GPT size for examples/train_gpt.py: tiny or small (default small; tiny with "
                                    "--quick)")
    p.add_argument("--dir", type=Path, help="state: etcd data, store, logs (default as for `varunactl up`)")
    p.add_argument("--no-preempt", action="store_true", help="do not kill a daemon midway")
    p.add_argument("--schedule", default=DEFAULT_SCHEDULE, choices=[*SCHEDULES, AUTO_SCHEDULE],
                   help=f"pipeline schedule (default {DEFAULT_SCHEDULE}; {AUTO_SCHEDULE}: the planner's fastest)")
    args = p.parse_args(argv)
    # The tiny GPT takes milliseconds a step: many steps, so that the job is still running when the
    # watch (polling every half second) sees it halfway and kills a daemon.
    quick = dict(daemons=3, steps=240, checkpoint_every=20, ttl=3.0, preset="tiny")
    full = dict(daemons=4, steps=60, checkpoint_every=10, ttl=5.0, preset="small")
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


class Preemption:
    """Kills a daemon that is not the leader once the job is halfway (the watch's on_status hook)."""

    def __init__(self, store, keys: Keys, ring: local.Ring, at_step: int) -> None:
        self.store, self.keys, self.ring, self.at_step = store, keys, ring, at_step
        self.done = False

    async def __call__(self, doc: dict[str, Any]) -> str | None:
        if self.done or doc["state"] != "running" or doc["step"] < self.at_step:
            return None
        kv = await self.store.get(self.keys.leader)
        leader = kv.value.decode() if kv else None
        # one that runs a worker of the job, so that the job itself must morph; the leader only when
        # it alone runs one (a plan that leaves the other slots of a shared machine idle)
        working = set(doc["plan"].get("members") or ())
        victims = sorted((d for d in reversed(self.ring.daemons) if local.alive(d)),
                         key=lambda d: (d.name not in working, d.name == leader))
        if not victims:
            return None
        local.kill_daemon(victims[0].name, self.ring.dir)
        self.done = True
        return (f"*** kill -9 {victims[0].name} at step {doc['step']}: a spot VM vanished; the fleet notices "
                f"when its peers' connections break or its {self.ring.ttl:g}s lease expires")


async def train(store, ring: local.Ring, args: argparse.Namespace) -> dict[str, Any]:
    """Submit the GPT, watch it to the end with a preemption halfway; returns the final status."""
    keys = Keys(ring.root)
    spec, bundle = ctl.build_spec(
        name=JOB, script=str(REPO / "examples" / "train_gpt.py"), args=["--preset", args.preset, "--corpus", "source"],
        batch_size=args.batch_size, chunk_size="auto", steps=args.steps, checkpoint_every=args.checkpoint_every,
        keep_checkpoints=3, store=None, schedule=args.schedule)
    await ctl.submit(store, keys, spec, bundle)
    hook = None if args.no_preempt else Preemption(store, keys, ring, args.steps // 2)
    await progress.watch(store, keys, JOB, interval=0.5, on_status=hook)
    return await ctl.job_status(store, keys, JOB)


def summary(doc: dict[str, Any], seconds: float) -> str:
    history = doc["loss_history"]
    loss = f"loss {history[0][1]:.3f} -> {history[-1][1]:.3f}" if history else "no loss recorded"
    shapes = " -> ".join([doc["morphs"][0]["from"], *(m["to"] for m in doc["morphs"])]) if doc["morphs"] else "-"
    sources = [progress.morph_source(m) for m in doc["morphs"]]
    resumed = f" {'; '.join(s for s in sources if s)}" if any(sources) else ""
    return (f"demo: {JOB} {doc['state']} at step {doc['step']} in {seconds:.0f}s, {len(doc['morphs'])} morph(s) "
            f"({shapes}){resumed}, {doc['steps_trained_twice']} step(s) trained twice, {loss}")


def report(ring: local.Ring) -> None:
    out = Path(ring.dir) / "report"
    if cli.main(["--etcd", ring.etcd, "--root", ring.root, "report", JOB, "--out", str(out)]) == 0:
        print(f"report: {out}")


def save_metrics(ring: local.Ring) -> None:
    """What each live daemon's Prometheus endpoint serves now, into DIR/metrics/<name>.txt."""
    out = Path(ring.dir) / "metrics"
    out.mkdir(exist_ok=True)
    for d in ring.daemons:
        if not (d.metrics_port and local.alive(d)):
            continue
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=10) as r:
                (out / f"{d.name}.txt").write_bytes(r.read())
        except OSError as exc:
            print(f"metrics: {d.name} did not answer: {exc}", flush=True)
    print(f"metrics: {out} (what each daemon's --metrics-port endpoint served at the end)", flush=True)


_TERMINATED: list[int] = []   # the signal that ended the run, when it was SIGTERM or SIGHUP


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM or SIGHUP (a `timeout`, a kill, a closed terminal) stops the ring as Ctrl-C does.
    Python's default for them ends the process without `finally`, and the ring trained on; an
    exception raised here, mid-way through the etcd client's calls, crashed the interpreter
    ("corrupted double-linked list"). SIGINT is Ctrl-C's way: asyncio cancels its task."""
    _TERMINATED.append(signum)
    signal.raise_signal(signal.SIGINT)


def _interrupted_code(exc: BaseException) -> int:
    """The exit code of a run Ctrl-C or _terminated stopped. asyncio turns Ctrl-C into its task's
    cancellation: a signal that came as the task was being set up or torn down surfaces as the
    CancelledError itself. Any other cancellation is no stop of ours: raised again."""
    if not _TERMINATED and not isinstance(exc, KeyboardInterrupt):
        raise exc
    return 128 + _TERMINATED[0] if _TERMINATED else 130


def _stop_ring(state_dir: Path | None) -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):   # a second signal must not cut the stop short
        signal.signal(sig, signal.SIG_IGN)
    print("stopping the ring ...", flush=True)
    local.down(state_dir, say=lambda line: print(f"  {line}", flush=True))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminated)
    try:
        ring = local.up(args.daemons, args.dir, ttl=args.ttl, metrics_port=local.free_port_range(args.daemons),
                        daemon_args=["--progress-interval", "0.5"], timeout=120.0,
                        say=lambda line: print(f"local_ring: {line}", flush=True))
    except ctl.CtlError as exc:
        print(f"local_ring: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError) as exc:   # while the ring started: what did start stops
        code = _interrupted_code(exc)
        _stop_ring(args.dir)
        return code
    try:
        ports = [f"{d.name}:{d.metrics_port}" for d in ring.daemons if d.metrics_port]
        print(f"etcd on {ring.etcd}; {len(ring.daemons)} daemons ({', '.join(d.name for d in ring.daemons)}); "
              f"logs in {ring.dir}/logs" + (f"; metrics at 127.0.0.1 {' '.join(ports)}" if ports else ""), flush=True)
        doc = ctl.run(ring.etcd, 5.0, lambda store: train(store, ring, args))
        ctl.print_job(doc)
        print(summary(doc, time.monotonic() - started), flush=True)
        save_metrics(ring)
        if doc["state"] == "done":
            report(ring)
        return 0 if doc["state"] == "done" else 1
    except (KeyboardInterrupt, asyncio.CancelledError) as exc:
        return _interrupted_code(exc)
    finally:
        _stop_ring(ring.dir)


if __name__ == "__main__":
    sys.exit(main())
