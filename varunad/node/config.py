"""varunad's settings: command-line flags, an env file, the environment, and their timing rules.

Every flag has an environment variable (``--stop-grace`` is ``VARUNAD_STOP_GRACE``), so the
systemd unit can keep all of them in ``/etc/varunad/varunad.env``. Precedence, highest first:
flags, ``--env-file``, the process environment (what systemd's ``EnvironmentFile=`` sets),
defaults.

Timing rules, checked at load like Patroni's (all durations in seconds, on the monotonic clock):

* ``ttl`` (lease of the member key, default 10, at least 2: etcd's minimum);
* ``loop_wait`` (longest pause of the leader and election loops; default ttl / 5) must be below
  the TTL;
* ``retry_timeout`` (bound of one etcd request; default min(3, ttl / 4)) must satisfy
  ``loop_wait + 2 * retry_timeout <= ttl``, so a leader whose etcd calls time out twice in a row
  still notices before its lease can expire. A retry timeout that breaks the rule is lowered,
  with a warning;
* ``stop_grace`` (how long workers get to checkpoint and stop before SIGKILL) must exceed
  ``abort_grace`` (workers stopped without a checkpoint, typically blocked on a dead peer).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from varunad.options import Parser
from varunad.store.contract import StoreConfigError
from varunad.store.etcd import parse_endpoints

__all__ = ["DaemonConfigError", "DaemonConfig", "load_config", "parse_env_file", "build_parser", "ENV_PREFIX"]

log = logging.getLogger(__name__)

ENV_PREFIX = "VARUNAD_"
_NAME_RE = re.compile(r"[A-Za-z0-9._:@-]{1,128}")


class DaemonConfigError(ValueError):
    """A setting cannot be used; the message says which and what to change."""


def route_address(etcd: str) -> str:
    """The local address this host's packets to the first etcd endpoint leave from (a UDP
    connect picks the route and sends nothing); 127.0.0.1 when there is no route."""
    try:
        host, port = parse_endpoints(etcd)[0]
        family, _, _, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except (OSError, StoreConfigError):   # no route, or endpoints the store will refuse itself
        return "127.0.0.1"


def _default_name() -> str:
    return socket.gethostname().split(".")[0] or "varunad"


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonConfig:
    """One daemon's settings (see the module docstring for the timing rules)."""

    etcd: str
    """etcd endpoints, ``host:port[,host:port...]``."""
    name: str = field(default_factory=_default_name)
    """Member name, unique in the fleet (default: the short hostname)."""
    advertise: str = ""
    """Host or IP the other daemons and workers reach this VM at ("" = the address this host
    uses to reach etcd: the interface a fleet's traffic takes)."""
    slots: int = 0
    """Device slots (one worker each); 0 = detect (GPUs, else 1)."""
    store: str = ""
    """The global checkpoint store every VM can reach (a shared mount); jobs use STORE/<job>."""
    state_dir: str = "/var/lib/varunad"
    """Local directory for job bundles and worker logs."""
    root: str = "/varunad/"
    """Key root in etcd: fleets (or tests) sharing one etcd use different roots."""
    ttl: float = 10.0
    """Lease TTL of the member (and leader) key."""
    loop_wait: float = 0.0
    """Longest pause of the election and leader loops (0 = ttl / 5)."""
    retry_timeout: float = 0.0
    """Bound of one etcd request (0 = min(3, ttl / 4))."""
    curve_keys: str | None = None
    """Directory with NAME.key_secret of this daemon and the public NAME.key of every peer."""
    plaintext: bool = False
    """No CURVE on ZeroMQ sockets (development only; must be asked for)."""
    trusted_network: bool = False
    """Tensor streams between workers skip CURVE (the network between VMs is private)."""
    submit_keys: str | None = None
    """Directory of *.sign_public keys: run only jobs signed by one of them (varunad.node.signing)."""
    etcd_ca: str | None = None
    etcd_cert: str | None = None
    etcd_key: str | None = None
    etcd_user: str | None = None
    etcd_password: str | None = None
    port: int = 0
    """TCP port of this daemon's control socket (0 = a free one)."""
    metrics_port: int = 0
    """TCP port of the Prometheus endpoint ``/metrics`` (0 = none; see ``varunad.node.metrics``)."""
    worker_port_base: int = 0
    """First of slots + 3 consecutive ports: one per slot's worker, the rendezvous, two for link probes
    (0 = free ones chosen at start)."""
    device_kind: str = ""
    """Device kind for calibration ("" = detect: the GPU model, else "cpu" or "cpu-<n>slots")."""
    machine_id: str = ""
    """The machine this daemon runs on ("" = the kernel's boot id): daemons reporting one machine
    share its cores, and plans count their workers against them. Only a test that plays separate
    VMs on one host (each held to its own CPU share by a cgroup) has a reason to set it."""
    memory: int = 0
    """Memory per slot in bytes (0 = detect: a GPU's memory (nvidia-smi), host memory / slots on a CPU host)."""
    threads: int = 0
    """torch threads per worker (0 = cores / slots)."""
    stop_grace: float = 60.0
    """Seconds workers get to checkpoint and stop before SIGKILL (also a broken epoch's workers saving
    their state from memory)."""
    abort_grace: float = 3.0
    """Seconds a broken epoch's workers get before SIGKILL unless they say they are saving their state
    (they may be blocked on a dead peer)."""
    notice_timeout: float = 0.0
    """On SIGTERM, how long to wait for the checkpoint before leaving (0 = stop_grace + 5)."""
    scale_up_threshold: float = 0.1
    """A running job is re-planned onto new members only if the estimate improves by more than this fraction."""
    straggler_threshold: float = 1.5
    """A slot whose measured compute per micro-batch is this many times its kind's fastest slot's
    (alone of its kind: its calibration's) is a straggler, and plans weigh it by its speed (0 = off)."""
    straggler_window: int = 3
    """Progress reports in a row a slot must be slow (or fast again) in before it is called a
    straggler (or no longer one)."""
    straggler_forget: float = 1800.0
    """Seconds after its last measurement that a straggler no plan uses is taken at full speed again
    (by the next plan made for any reason)."""
    max_restarts: int = 3
    """Failed epochs (a worker error, not a lost member) before a job fails."""
    debounce: float = 0.5
    """Seconds the leader waits for more changes after one before deciding."""
    start_timeout: float = 120.0
    """Seconds the workers of a new epoch may take to report their first step."""
    stall_timeout: float = 1800.0
    """Seconds a running epoch may go without a step (or 10x its longest wait between two steps,
    if longer) before it counts as stuck and is restarted (varunad.control.stall); 0: never. Longer
    than anything a script does between two steps (an evaluation), which looks the same."""
    progress_interval: float = 1.0
    """Seconds between progress (and log) writes to etcd."""
    keep_jobs: int = 10
    """Jobs whose bundle and worker logs stay in the state dir (the most recently used)."""
    stage_checkpoints: bool = True
    """Workers write periodic checkpoints to the state dir and copy them to the store in the background."""
    spare_workers: bool = True
    """Keep a spare worker process per slot with torch imported (trainer.spare), started once an epoch's
    traced steps are done here: the next epoch's worker starts in it, without the import."""
    calibrate: Literal["uniform", "profile"] = "profile"
    """What to do when no calibration exists for a job's model: plan data-parallel only from a
    synthetic one ("uniform"), or run the script once with VARUNA_PROFILE on one slot ("profile")."""
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not self.etcd:
            raise DaemonConfigError("no etcd endpoint: pass --etcd host:port[,host:port] or set VARUNAD_ETCD")
        if not _NAME_RE.fullmatch(self.name):
            raise DaemonConfigError(f"--name {self.name!r} must be 1..128 letters, digits or . _ - : @")
        if not self.store:
            raise DaemonConfigError("no checkpoint store: pass --store DIR (a directory every VM mounts)")
        if not (self.root.startswith("/") and self.root.endswith("/")):
            raise DaemonConfigError(f"--root {self.root!r} must start and end with '/'")
        if self.plaintext == bool(self.curve_keys):
            raise DaemonConfigError("choose ZeroMQ security: --curve-keys DIR (the fleet's keys) or --plaintext "
                              "(development only)")
        if self.ttl < 2:
            raise DaemonConfigError(f"--ttl {self.ttl} is below etcd's minimum lease of 2 s")
        for name in ("slots", "port", "worker_port_base", "memory", "threads", "max_restarts", "metrics_port",
                     "stall_timeout"):
            if getattr(self, name) < 0:
                raise DaemonConfigError(f"--{name.replace('_', '-')} must not be negative")
        if self.keep_jobs < 1:
            raise DaemonConfigError(f"--keep-jobs {self.keep_jobs} must be at least 1 (the running job's files stay)")
        for name in ("stop_grace", "abort_grace", "debounce", "start_timeout", "progress_interval"):
            if not getattr(self, name) > 0:
                raise DaemonConfigError(f"--{name.replace('_', '-')} must be positive")
        if self.metrics_port > 65535:
            raise DaemonConfigError(f"--metrics-port {self.metrics_port} is not a TCP port (0 turns metrics off)")
        if self.abort_grace >= self.stop_grace:
            raise DaemonConfigError(f"--abort-grace {self.abort_grace} must be shorter than --stop-grace {self.stop_grace}")
        if self.scale_up_threshold < 0:
            raise DaemonConfigError("--scale-up-threshold must be >= 0 (a fraction: 0.1 means 10% faster)")
        if not 0 <= self.straggler_threshold or 0 < self.straggler_threshold <= 1:
            raise DaemonConfigError(f"--straggler-threshold {self.straggler_threshold} must be above 1 (a slowdown "
                                    "factor: 1.5 means 1.5x slower than the fastest slot of its kind), or 0 for off")
        if self.straggler_window < 1 or not self.straggler_forget > 0:
            raise DaemonConfigError("--straggler-window must be at least 1 and --straggler-forget positive")
        if self.calibrate not in ("uniform", "profile"):
            raise DaemonConfigError(f"--calibrate must be uniform or profile, got {self.calibrate!r}")
        if (self.etcd_cert is None) != (self.etcd_key is None):
            raise DaemonConfigError("--etcd-cert and --etcd-key go together")
        if (self.etcd_user is None) != (self.etcd_password is None):
            raise DaemonConfigError("--etcd-user needs VARUNAD_ETCD_PASSWORD (and the other way round)")

    def with_timing(self) -> DaemonConfig:
        """Fill the derived timing defaults and enforce the rules (lowering retry_timeout if needed)."""
        loop_wait = self.loop_wait or self.ttl / 5
        retry = self.retry_timeout or min(3.0, self.ttl / 4)
        if not 0 < loop_wait < self.ttl:
            raise DaemonConfigError(f"--loop-wait {loop_wait} must be positive and below --ttl {self.ttl}")
        if loop_wait + 2 * retry > self.ttl:
            lowered = (self.ttl - loop_wait) / 2
            log.warning("loop_wait %.2fs + 2 x retry_timeout %.2fs exceeds ttl %.2fs; lowering retry_timeout to "
                        "%.2fs", loop_wait, retry, self.ttl, lowered)
            retry = lowered
        notice = self.notice_timeout or self.stop_grace + 5.0
        return replace(self, loop_wait=loop_wait, retry_timeout=retry, notice_timeout=notice,
                       advertise=self.advertise or route_address(self.etcd))

    @property
    def security_mode(self) -> str:
        return "plaintext" if self.plaintext else "curve"

    @property
    def secret_key_file(self) -> str | None:
        return None if self.curve_keys is None else str(Path(self.curve_keys) / f"{self.name}.key_secret")


# --- loading ---------------------------------------------------------------------------------------

_BOOL = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _field_types() -> dict[str, Any]:
    return {f.name: f.type for f in fields(DaemonConfig)}


def _convert(name: str, text: str) -> Any:
    kind = _field_types()[name]
    try:
        if kind == "bool":
            return _BOOL[text.strip().lower()]
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
    except (KeyError, ValueError):
        raise DaemonConfigError(f"{ENV_PREFIX}{name.upper()}={text!r} is not a valid {kind}") from None
    return text


def parse_env_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """``KEY=VALUE`` lines (``#`` comments, optional quotes) as systemd's EnvironmentFile reads them."""
    out: dict[str, str] = {}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise DaemonConfigError(f"cannot read env file {path}: {exc.strerror or exc}") from None
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise DaemonConfigError(f"{path}:{number}: expected KEY=VALUE, got {raw!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        out[key] = value
    return out


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    known = _field_types()
    out = {}
    for key, text in env.items():
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name not in known:
            continue
        if text == "" and known[name] != "str":
            continue
        out[name] = _convert(name, text)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="varunad",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The varunad daemon: one per VM. It registers the VM's device slots in etcd under a lease,\n"
                    "takes part in leader election, runs the trainer workers the leader assigns to it, and\n"
                    "reports their progress. The leader plans each job (P stages x D replicas) for the live\n"
                    "fleet and morphs it (from the survivors' memory or the newest checkpoint) when VMs leave or join.\n\n"
                    "SIGTERM (a preemption notice) makes the workers checkpoint, then the daemon leaves the\n"
                    "fleet at once so the others re-plan without waiting for the lease to expire.",
        epilog="Every flag can also be set as VARUNAD_<FLAG> (e.g. VARUNAD_ETCD, VARUNAD_STOP_GRACE) in the\n"
               "environment or in --env-file; flags win.\n\n"
               "example (a development ring on one machine):\n"
               "  varunad --etcd 127.0.0.1:2379 --name vm1 --store /tmp/store --state-dir /tmp/vm1 --plaintext\n"
               "  varunactl --etcd 127.0.0.1:2379 submit --name gpt --batch-size 32 --steps 100 \\\n"
               "      --checkpoint-every 10 examples/train_gpt.py",
    )
    a = p.add_argument
    a("--env-file", metavar="FILE", help="read VARUNAD_* settings from this file first")
    a("--etcd", metavar="HOST:PORT[,...]", help="etcd endpoints (required)")
    a("--name", help="member name, unique in the fleet (default: short hostname)")
    a("--advertise", metavar="HOST",
      help="address peers reach this VM at (default: the local address of the route to etcd)")
    a("--slots", type=int, metavar="N", help="device slots; 0 = detect (GPUs, else 1)")
    a("--store", metavar="DIR", help="global checkpoint store, a mount every VM shares (required)")
    a("--state-dir", metavar="DIR", help="local state: job bundles and worker logs (default /var/lib/varunad)")
    a("--root", metavar="PREFIX", help="etcd key root (default /varunad/)")
    a("--ttl", type=float, metavar="SECONDS", help="member lease TTL in seconds (default 10)")
    a("--loop-wait", type=float, metavar="SECONDS", help="longest pause of the leader/election loops (default ttl/5)")
    a("--retry-timeout", type=float, metavar="SECONDS", help="bound of one etcd request (default min(3, ttl/4))")
    sec = p.add_mutually_exclusive_group()
    sec.add_argument("--curve-keys", metavar="DIR",
                     help="CURVE keys: DIR/NAME.key_secret and the fleet's public *.key files")
    sec.add_argument("--plaintext", action="store_true", default=None,
                     help="no authentication or encryption on ZeroMQ (development only)")
    a("--trusted-network", action="store_true", default=None,
      help="tensor streams between workers skip CURVE (private network between VMs)")
    a("--submit-keys", metavar="DIR", help="run only jobs signed by a key DIR/*.sign_public holds "
      "(`varunactl keys submit-key`; default: any job in etcd runs)")
    a("--etcd-ca", metavar="FILE", help="CA certificate to verify etcd's TLS certificate")
    a("--etcd-cert", metavar="FILE", help="client certificate for etcd (with --etcd-key)")
    a("--etcd-key", metavar="FILE", help="client key for etcd")
    a("--etcd-user", metavar="USER", help="etcd user (password in VARUNAD_ETCD_PASSWORD)")
    a("--port", type=int, metavar="PORT", help="TCP port of the daemon's control socket (default: a free one)")
    a("--metrics-port", type=int, metavar="PORT",
      help="serve Prometheus metrics at http://HOST:PORT/metrics on the control socket's host (default 0: off)")
    a("--worker-port-base", type=int, metavar="PORT",
      help="first of SLOTS+3 consecutive ports: one per slot's worker, the job's rendezvous, two for link probes "
      "between VMs (default: free ones)")
    a("--device-kind", metavar="KIND", help="device kind for calibration and prices (default: the GPU model, e.g. "
      "'NVIDIA A100-SXM4-80GB'; 'cpu' on a CPU host, 'cpu-<n>slots' with --slots n)")
    a("--machine-id", metavar="ID",
      help="the machine this daemon runs on (default: the kernel's boot id, so daemons on one host, a local "
           "ring or network namespaces, know they share its cores); set it only to play separate VMs on one host")
    a("--memory", type=int, metavar="BYTES",
      help="memory per slot (default: the GPU's, from nvidia-smi; on a CPU host its memory / slots). On a CPU "
           "slot a worker's process itself (about 300 MB, measured by the calibration) counts against it; a spare "
           "worker per slot (--spare-workers) holds about 230 MB more that the plans do not count yet")
    a("--threads", type=int, metavar="N", help="torch threads per worker (default: cores / slots)")
    a("--stop-grace", type=float, metavar="SECONDS",
      help="seconds workers get to checkpoint and stop before SIGKILL, also a broken epoch's workers "
           "saving the step they hold from memory (default 60)")
    a("--abort-grace", type=float, metavar="SECONDS",
      help="seconds before SIGKILL for a broken epoch's workers that do not say they are saving their "
           "state (blocked on a dead peer) (default 3)")
    a("--notice-timeout", type=float, metavar="SECONDS",
      help="on SIGTERM, longest wait for the checkpoint (default stop-grace + 5)")
    a("--scale-up-threshold", type=float, metavar="FRACTION",
      help="re-plan a running job onto new VMs only if it gets this much faster (default 0.1)")
    a("--straggler-threshold", type=float, metavar="FACTOR",
      help="a slot computing this many times slower than the fastest of its device kind (alone of its kind: "
           "than its calibration) is a straggler: plans give it less work or leave it idle, and status names "
           "it (default 1.5; 0 = off)")
    a("--straggler-window", type=int, metavar="N",
      help="progress reports in a row a slot must be slow, or fast again, in to become, or stop being, a "
           "straggler (default 3)")
    a("--straggler-forget", type=float, metavar="SECONDS",
      help="a straggler no plan uses is taken at full speed again this long after its last measurement, "
           "by the next plan made for any reason (default 1800)")
    a("--max-restarts", type=int, metavar="N", help="failed epochs before a job fails (default 3)")
    a("--debounce", type=float, metavar="SECONDS", help="seconds to collect changes before re-planning (default 0.5)")
    a("--start-timeout", type=float, metavar="SECONDS",
      help="seconds a new epoch may take to its first step (default 120)")
    a("--stall-timeout", type=float, metavar="SECONDS",
      help="restart an epoch in which no worker finished a step for this long, or for 10x its longest wait "
           "between two steps if that is longer: a worker is stuck (stopped, deadlocked); keep it above the "
           "longest evaluation the script runs between steps, which looks the same; 0 never (default 1800)")
    a("--progress-interval", type=float, metavar="SECONDS", help="seconds between progress writes to etcd (default 1)")
    a("--keep-jobs", type=int, metavar="N",
      help="keep the bundles and worker logs of the N most recently used jobs in the state dir; "
           "older ones are deleted when a job starts here (default 10)")
    a("--stage-checkpoints", action=argparse.BooleanOptionalAction, default=None,
      help="workers write each periodic checkpoint to the state dir and copy it into the store in the "
           "background while training goes on (default on; on-demand checkpoints go straight to the store)")
    a("--spare-workers", action=argparse.BooleanOptionalAction, default=None,
      help="keep a spare process per slot with torch already imported, started once an epoch's "
           "traced steps are done here, so that the next epoch's workers (after a morph) skip the import (default on)")
    a("--calibrate", choices=["uniform", "profile"],
      help="missing calibration: profile the job's script once on one slot (profile, default) or plan "
           "from a synthetic one (uniform: data-parallel only, for quick experiments)")
    a("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="default INFO")
    a("--version", action="store_true", help="print the version and exit")
    a("--check", action="store_true",
      help="check the settings (flags, --env-file, environment), print them as resolved, and exit")
    return p


def load_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
                *, parser: argparse.ArgumentParser | None = None) -> DaemonConfig:
    """Flags > --env-file > environment > defaults; then the timing rules (``with_timing``)."""
    parser = parser or build_parser()
    ns = parser.parse_args(argv)
    values: dict[str, Any] = _from_env(os.environ if environ is None else environ)
    if ns.env_file:
        values.update(_from_env(parse_env_file(ns.env_file)))
    known = _field_types()
    for name, value in vars(ns).items():
        if name in known and value is not None:
            values[name] = value
    if "etcd" not in values:
        raise DaemonConfigError("no etcd endpoint: pass --etcd host:port[,host:port] or set VARUNAD_ETCD")
    if values.get("curve_keys") and values.get("plaintext"):
        # the environment may ask for one and a flag for the other: the flag wins
        if ns.plaintext:
            values.pop("curve_keys")
        else:
            values["plaintext"] = False
    try:
        config = DaemonConfig(**values)
    except TypeError as exc:
        raise DaemonConfigError(str(exc)) from None
    return config.with_timing()
