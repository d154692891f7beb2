"""Local launcher: run a Varuna script as P x D worker processes on this machine (like torchrun).

    python -m trainer.launch --stages 2 --replicas 2 examples/train_gpt.py --steps 20

Each worker is `python script.py [args]` with its `trainer.worker_env.WorkerAssignment` in the
environment: rank = replica * P + stage, one ZeroMQ endpoint per rank on a free loopback port,
one torch.distributed rendezvous URL for all. The cores are shared out evenly (OMP/MKL and
VARUNA_THREADS). Output lines are prefixed with `[s<stage>r<replica>]`.

Lifecycle: SIGINT/SIGTERM to the launcher are forwarded to every worker (a second one kills
them); if a worker exits non-zero, the others are stopped (SIGTERM, then SIGKILL after a grace
period) and the launcher exits non-zero, naming the failing rank and the tail of its stderr.
Each worker runs in its own process group, so the forwarded signal is the only one it gets
and stopping it also stops anything it started.

The module imports neither torch nor zmq, so starting workers stays fast.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trainer
from trainer.errors import ConfigError
from trainer.net.ports import bind_quiet_ports
from trainer.planning.parallel import ParallelPlan, ParallelPlanError
from trainer.planning.schedule import SCHEDULES, ScheduleError, schedule_named
from trainer.worker_env import WorkerAssignment, available_cores

__all__ = ["LaunchResult", "launch", "plan_assignments", "main"]

_TAIL_LINES = 40
_POLL_S = 0.05
# What the package's own directory must be on the workers' path for: a script in examples/
# does `import trainer` and would otherwise only find it if the package were installed.
_PACKAGE_ROOT = str(Path(trainer.__file__).resolve().parent.parent)


@dataclass(frozen=True, slots=True)
class LaunchResult:
    """How a launch ended. `outputs`/`errors` are each rank's stdout/stderr (empty when not captured)."""

    returncode: int
    outputs: list[str]
    errors: list[str]
    failed_rank: int | None = None
    reason: str = "all workers finished"

    @property
    def ok(self) -> bool:
        return self.returncode == 0


@dataclass(eq=False)
class _LaunchedWorker:
    """One local worker process the launcher started, with its captured output."""

    assignment: WorkerAssignment
    proc: subprocess.Popen
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=_TAIL_LINES))
    readers: list[threading.Thread] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.assignment.rank

    @property
    def label(self) -> str:
        stage, replica = self.assignment.position()
        return f"rank {self.rank} (stage {stage}, replica {replica})"

    def signal(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # already gone


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on loopback, below the kernel's ephemeral range when it can
    (trainer.net.ports: a port bind(0) hands out may be taken by any outgoing connection before
    the worker binds it)."""
    def bind(port: int) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            raise
        return s

    socks = bind_quiet_ports(n, bind)
    try:
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def plan_assignments(
    stages: int,
    replicas: int,
    *,
    job: str = "local",
    schedule: str | None = None,
    cuts: Sequence[int] | None = None,
    recompute: Sequence[bool] | None = None,
    shares: Sequence[int] | None = None,
    threads: int | None = None,
    trace_dir: str | None = None,
    store: str | None = None,
    device: str | None = None,
    checkpoint_every: int | None = None,
    checkpoint_tmpdir: str | None = None,
    capture_cache: str | None = None,
) -> list[WorkerAssignment]:
    """One WorkerAssignment per rank (rank = replica * stages + stage), with fresh loopback ports.
    `recompute` is one flag per stage, as the daemon's planner sets them (None: the script's).
    `shares` is the examples of the global batch each replica takes per step, in replica order,
    as the planner sets them for slow replicas (None: an even split); the workers check that they
    add up to the script's global batch.
    With a store, the workers resume from its newest complete checkpoint by themselves.
    `device` "cuda" gives rank r the r-th visible GPU (NCCL wants one GPU per rank); any other
    value (a torch device, "cpu") goes to every rank as it is (ranks that find they share a GPU
    reduce over gloo: trainer.engine.groups); None leaves it to the script."""
    if stages < 1 or replicas < 1:
        raise ConfigError(f"need at least one stage and one replica, got --stages {stages} --replicas {replicas}")
    if schedule is not None:
        try:
            schedule_named(schedule)
        except ScheduleError as exc:
            raise ConfigError(str(exc)) from None
    # Refused here, in the flags' own words, rather than by every worker in the variables' words.
    if cuts is not None and len(cuts) != stages - 1:
        raise ConfigError(f"--cuts names {len(cuts)} cut point(s); {stages} stages need {stages - 1}")
    if cuts is not None and (len(set(cuts)) != len(cuts) or any(c < 0 for c in cuts)):
        raise ConfigError(f"--cuts must be distinct cut-point indices >= 0, got {list(cuts)}")
    if shares is not None and len(shares) != replicas:
        raise ConfigError(f"--shares names {len(shares)} share(s); {replicas} replicas need {replicas}")
    if checkpoint_every is not None and checkpoint_every < 1:
        raise ConfigError(f"--checkpoint-every must be >= 1, got {checkpoint_every}")
    if (checkpoint_every is not None or checkpoint_tmpdir is not None) and store is None:
        raise ConfigError("--checkpoint-every and --checkpoint-tmpdir need --store DIR, where checkpoints go")
    world = stages * replicas
    devices = [device] * world
    if device == "cuda":
        import torch  # only here: the daemon imports this module too

        gpus = torch.cuda.device_count()
        if gpus < world:
            raise ConfigError(f"--device cuda puts each of the {world} workers on a GPU of its own; "
                              f"this host shows {gpus}", hint="use fewer stages x replicas, or --device cpu")
        devices = [str(rank) for rank in range(world)]
    if threads is None:
        threads = max(1, available_cores() // world)
    ports = free_ports(world + 1)
    endpoints = [f"tcp://127.0.0.1:{p}" for p in ports[:world]]
    try:
        plan = ParallelPlan(P=stages, D=replicas, schedule=schedule, cuts=None if cuts is None else tuple(sorted(cuts)),
                            recompute=None if recompute is None else tuple(recompute),
                            shares=None if shares is None else tuple(shares))
    except ParallelPlanError as exc:
        raise ConfigError(f"{exc} (--stages, --replicas, --cuts, --schedule, --shares)") from None
    return [
        WorkerAssignment(
            rank=rank,
            plan=plan,
            endpoints=endpoints,
            dist_url=f"tcp://127.0.0.1:{ports[world]}",
            bind_address="127.0.0.1",
            job=job,
            threads=threads,
            trace_dir=trace_dir,
            store=store,
            device=devices[rank],
            checkpoint_every=checkpoint_every,
            checkpoint_tmpdir=checkpoint_tmpdir,
            resume="latest" if store else None,
            capture_cache=capture_cache,
        )
        for rank in range(world)
    ]


def worker_environment(assignment: WorkerAssignment, extra: Mapping[str, str] | None = None, *,
                       base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of one worker process; the launcher and the daemon both start workers
    with it. `base` defaults to this process's environment; `extra` goes over it and the
    assignment's variables over everything."""
    env = dict(os.environ if base is None else base)
    threads = str(assignment.threads or 1)
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, PYTHONUNBUFFERED="1")
    # Gradients are freed and reallocated every step; glibc's default of returning big blocks
    # to the OS turns that into ~1,000 page faults a step (~9% of a worker's CPU, measured).
    # A worker on the CPU overrides this when trainer.engine.memory is imported: there the
    # slot's memory budget comes first (it returns every freed block of 1 MiB or more, so its
    # resident memory follows its tensors, which the planner counts), at ~14% of a step's time.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 << 20))
    env.setdefault("MALLOC_TRIM_THRESHOLD_", str(256 << 20))
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = _PACKAGE_ROOT + (os.pathsep + path if path else "")
    env.update(extra or {})
    env.update(assignment.to_env())
    return env


def _worker_env(assignment: WorkerAssignment, extra: Mapping[str, str] | None) -> dict[str, str]:
    # Every worker listens on loopback only: the local launcher is for one machine, so it asks
    # for plaintext streams explicitly (the daemon passes CURVE keys instead).
    security = {"VARUNA_SECURITY": os.environ.get("VARUNA_SECURITY", "plaintext")}
    return worker_environment(assignment, {**security, **(extra or {})})


class _Launcher:
    def __init__(self, *, echo: bool, capture: bool, grace: float) -> None:
        self.echo = echo
        self.capture = capture
        self.grace = grace
        self.workers: list[_LaunchedWorker] = []
        self.signalled: int | None = None
        self._print_lock = threading.Lock()

    # -- output ---------------------------------------------------------------------------

    def _pump(self, worker: _LaunchedWorker, pipe, is_err: bool) -> None:
        stage, replica = worker.assignment.position()
        prefix = f"[s{stage}r{replica}] "
        sink = sys.stderr if is_err else sys.stdout
        store = worker.stderr if is_err else worker.stdout
        with pipe:
            for raw in iter(pipe.readline, b""):
                line = raw.decode("utf-8", errors="replace")
                if is_err:
                    worker.stderr_tail.append(line)
                if self.capture:
                    store.append(line)
                if self.echo:
                    with self._print_lock:
                        sink.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
                        sink.flush()

    def note(self, message: str) -> None:
        if self.echo:
            with self._print_lock:
                print(f"[launch] {message}", file=sys.stderr, flush=True)

    # -- processes ------------------------------------------------------------------------

    def start(self, script: str, args: Sequence[str], assignments: list[WorkerAssignment],
              env: Mapping[str, str] | None) -> None:
        for a in assignments:
            proc = subprocess.Popen(
                [sys.executable, script, *args],
                env=_worker_env(a, env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            worker = _LaunchedWorker(a, proc)
            self.workers.append(worker)
            for pipe, is_err in ((proc.stdout, False), (proc.stderr, True)):
                t = threading.Thread(target=self._pump, args=(worker, pipe, is_err), daemon=True)
                t.start()
                worker.readers.append(t)
            if self.signalled is not None:
                break  # interrupted while starting: do not start the rest

    def forward(self, signum: int, _frame=None) -> None:
        # First signal: pass it on and let workers shut down cleanly; a second one means
        # "now", as with Ctrl-C twice.
        sig = signum if self.signalled is None else signal.SIGKILL
        self.signalled = signum
        for w in self.workers:
            w.signal(sig)

    def stop(self, signum: int | None = signal.SIGTERM) -> None:
        """Send `signum` (None: already sent) to live workers, wait `grace`, then SIGKILL."""
        alive = [w for w in self.workers if w.proc.poll() is None]
        if signum is not None:
            for w in alive:
                w.signal(signum)
        deadline = time.monotonic() + self.grace
        for w in alive:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for w in self.workers:
            # Also reaps anything a worker started in its group and left behind.
            w.signal(signal.SIGKILL)
            w.proc.wait()

    def supervise(self, timeout: float | None) -> tuple[int, int | None, str]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.signalled is not None:
                name = signal.Signals(self.signalled).name
                self.note(f"got {name}; stopping {len(self.workers)} workers")
                self.stop(None)
                return 128 + self.signalled, None, f"interrupted by {name}"
            codes = [w.proc.poll() for w in self.workers]
            failed = [w for w, c in zip(self.workers, codes) if c not in (None, 0)]
            if failed:
                w = failed[0]
                code = w.proc.returncode
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                others = sum(c is None for c in codes)
                self.stop()
                return (code if code > 0 else 128 - code), w.rank, f"worker {w.label} {how}; stopped {others} other(s)"
            if all(c == 0 for c in codes):
                return 0, None, "all workers finished"
            if deadline is not None and time.monotonic() > deadline:
                self.stop()
                return 124, None, f"timed out after {timeout:g}s; stopped all workers"
            time.sleep(_POLL_S)

    def drain(self) -> None:
        for w in self.workers:
            for t in w.readers:
                t.join(timeout=5.0)


def launch(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    stages: int,
    replicas: int,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    job: str = "local",
    schedule: str | None = None,
    cuts: Sequence[int] | None = None,
    recompute: Sequence[bool] | None = None,
    shares: Sequence[int] | None = None,
    threads: int | None = None,
    trace_dir: str | os.PathLike[str] | None = None,
    store: str | os.PathLike[str] | None = None,
    device: str | None = None,
    checkpoint_every: int | None = None,
    checkpoint_tmpdir: str | os.PathLike[str] | None = None,
    grace: float = 5.0,
    echo: bool = False,
    capture: bool = True,
    capture_cache: str | os.PathLike[str] | None = None,
) -> LaunchResult:
    """Run `script` as stages x replicas workers and wait for them.

    `env` is added to every worker's environment (the assignment's variables win). `timeout`
    stops everything after that many seconds (return code 124). `grace` is how long stopped
    workers get between SIGTERM (or the forwarded signal) and SIGKILL. `echo` prints the
    prefixed output as it comes; `capture` keeps it in the result. `capture_cache` is a directory
    where workers keep the exported model and load it from (trainer.graph.capture_cache), as a
    daemon's workers do: a script that builds Varuna again, or a later launch of the same script
    and arguments, skips torch.export. When called from the main
    thread, SIGINT/SIGTERM are forwarded to the workers for the duration of the call.
    """
    script = os.fspath(script)
    if not os.path.isfile(script):
        raise ConfigError(f"{script} is a directory, not a script" if os.path.isdir(script)
                          else f"no such script: {script}")
    assignments = plan_assignments(
        stages, replicas, job=job, schedule=schedule, cuts=cuts, recompute=recompute, shares=shares, threads=threads,
        trace_dir=None if trace_dir is None else os.fspath(trace_dir),
        store=None if store is None else os.fspath(store), device=device,
        checkpoint_every=checkpoint_every,
        checkpoint_tmpdir=None if checkpoint_tmpdir is None else os.fspath(checkpoint_tmpdir),
        capture_cache=None if capture_cache is None else os.fspath(capture_cache),
    )
    launcher = _Launcher(echo=echo, capture=capture, grace=grace)
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            handlers[sig] = signal.signal(sig, launcher.forward)
    try:
        launcher.start(script, [str(a) for a in args], assignments, env)
        code, failed_rank, reason = launcher.supervise(timeout)
    except BaseException:
        launcher.stop(signal.SIGKILL)
        raise
    finally:
        for sig, old in handlers.items():
            signal.signal(sig, old)
    launcher.drain()
    if failed_rank is not None:
        tail = "".join("    " + line for line in launcher.workers[failed_rank].stderr_tail).rstrip()
        launcher.note(reason)
        launcher.note(f"last lines of rank {failed_rank}'s stderr:\n{tail or '    (nothing)'}")
    elif code:
        launcher.note(reason)
    return LaunchResult(
        returncode=code,
        outputs=["".join(w.stdout) for w in launcher.workers],
        errors=["".join(w.stderr) for w in launcher.workers],
        failed_rank=failed_rank,
        reason=reason,
    )


def _parse_cuts(text: str) -> list[int]:
    try:
        return [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated cut-point indices, got {text!r}") from None


def _parse_shares(text: str) -> list[int]:
    try:
        return [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers of examples, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer.launch",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a Varuna training script as P pipeline stages x D data-parallel replicas\n"
                    "of local worker processes. Rank = replica * P + stage; each worker finds its\n"
                    "assignment in VARUNA_* environment variables (see trainer/worker_env.py). Output\n"
                    "lines are prefixed [s<stage>r<replica>]. If a worker fails, the others are\n"
                    "stopped; Ctrl-C stops them all.",
        epilog="examples:\n"
               "  python -m trainer.launch --stages 2 --replicas 2 examples/train_gpt.py --steps 20\n"
               "  python -m trainer.launch -P 4 --trace-dir traces examples/train_cnn.py\n"
               "  varunactl report --traces traces   # timeline.png of the last step",
    )
    p.add_argument("--stages", "-P", type=int, required=True, help="pipeline depth P")
    p.add_argument("--replicas", "-D", type=int, default=1, help="data-parallel width D (default 1)")
    p.add_argument("--schedule", choices=list(SCHEDULES), help="pipeline schedule (default: Varuna's)")
    p.add_argument("--cuts", type=_parse_cuts, metavar="I,J,...",
                   help="active cut-point indices, P-1 of them (default: Varuna balances the stages)")
    p.add_argument("--shares", type=_parse_shares, metavar="N,M,...",
                   help="examples of the global batch each replica takes per step, D of them in replica order, "
                        "adding up to the script's batch size (e.g. 10,10,4 for a batch of 24 over 3 replicas, the "
                        "third one slow); the math of a step is the same (default: an even split)")
    p.add_argument("--trace-dir", metavar="DIR", help="write a Chrome trace per worker here "
                   "(draw them with `varunactl report --traces DIR`)")
    p.add_argument("--store", metavar="DIR", help="checkpoint store of the job; workers resume from its "
                   "newest complete checkpoint")
    p.add_argument("--checkpoint-every", type=int, metavar="K",
                   help="checkpoint to --store every K steps (default: only when the script calls checkpoint)")
    p.add_argument("--checkpoint-tmpdir", metavar="DIR",
                   help="write each periodic checkpoint to this local directory first and copy it to --store "
                        "in the background, while training goes on (it counts once rank 0 commits it)")
    p.add_argument("--capture-cache", metavar="DIR",
                   help="keep the exported model here and load it from here on the next launch of the same script, "
                        "arguments and libraries, skipping torch.export (default: export every time)")
    p.add_argument("--job", default="local", help="job id (default: local)")
    p.add_argument("--threads", type=int, help="torch threads per worker (default: cores // (P*D))")
    p.add_argument("--device", choices=["cpu", "cuda"],
                   help="cuda: one GPU per worker (rank r on the r-th visible GPU); cpu: every worker on "
                        "the CPU (default: what the script passes to Varuna as device/local_rank)")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="stop all workers after this long and exit 124 (default: no limit)")
    p.add_argument("--grace", type=float, default=5.0, metavar="SECONDS",
                   help="time a stopping worker gets before SIGKILL (default 5)")
    p.add_argument("script", help="the training script; every worker runs `python script [args]`")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    ns = parser.parse_args(argv)
    try:
        result = launch(
            ns.script, ns.script_args, stages=ns.stages, replicas=ns.replicas, timeout=ns.timeout,
            job=ns.job, schedule=ns.schedule, cuts=ns.cuts, shares=ns.shares, threads=ns.threads,
            trace_dir=ns.trace_dir, store=ns.store, device=ns.device, grace=ns.grace, echo=True, capture=False,
            checkpoint_every=ns.checkpoint_every, checkpoint_tmpdir=ns.checkpoint_tmpdir,
            capture_cache=ns.capture_cache,
        )
    except ConfigError as exc:
        parser.error(str(exc))
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
