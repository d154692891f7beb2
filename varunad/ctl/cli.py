"""varunactl: the operator's command line.

The parser and one small dispatcher: each command group has an `_add_<group>(subparsers)` function
that declares its arguments and binds one handler per subcommand with `set_defaults(handler=...)`; a
handler (`varunad.ctl.handlers`) takes the parsed arguments and returns the exit status. Add a group
by writing its `_add_*` function here, its handlers there, and listing it in `_GROUPS`. Errors the
user can fix print one line on stderr and exit with status 1.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence

from protocol.errors import ProtocolError
from trainer.planning.schedule import AUTO_SCHEDULE, DEFAULT_SCHEDULE, SCHEDULES
from varunad import __version__

# The handlers are bound by their names here when main() builds the parser, so a test can replace
# one (cli._cmd_status) before calling main().
from varunad.ctl.handlers import (
    _cmd_cancel,
    _cmd_down,
    _cmd_export,
    _cmd_jobs,
    _cmd_keys_generate,
    _cmd_keys_show,
    _cmd_keys_submit_key,
    _cmd_kill,
    _cmd_logs,
    _cmd_nodes,
    _cmd_report,
    _cmd_status,
    _cmd_submit,
    _cmd_up,
    _cmd_watch,
)
from varunad.options import Parser

__all__ = ["main"]

# --- option types ---------------------------------------------------------------------------------

def _seconds(text: str, *, zero: bool = False) -> float:
    """A duration option: a finite number of seconds above 0 (or 0 where ``zero``): a poll every
    0 seconds spins, a negative one reads as no wait at all."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise argparse.ArgumentTypeError(f"must be {'0 or more' if zero else 'more than 0'} seconds, got {text}")
    return value


def _seconds_or_zero(text: str) -> float:
    return _seconds(text, zero=True)


# --- keys -----------------------------------------------------------------------------------------

def _add_keys(sub: argparse._SubParsersAction) -> None:
    keys = sub.add_parser(
        "keys", help="create and inspect CURVE key pairs and job-signing keys",
        description="CURVE key pairs authenticate daemons to each other and encrypt their traffic.")
    actions = keys.add_subparsers(dest="action", metavar="ACTION", required=True)
    gen = actions.add_parser(
        "generate", help="write NAME.key and NAME.key_secret",
        description="Write a new key pair: DIR/NAME.key (public, share it) and DIR/NAME.key_secret "
                    "(secret, mode 0600). Name it after the daemon's member name.")
    _key_pair_options(gen)
    gen.set_defaults(handler=_cmd_keys_generate)
    sk = actions.add_parser(
        "submit-key", help="write NAME.sign_public and NAME.sign_secret (to sign jobs)",
        description="Write a new Ed25519 key pair for signing jobs: DIR/NAME.sign_public goes into the "
                    "--submit-keys directory of every daemon; DIR/NAME.sign_secret (mode 0600) stays with the "
                    "person who submits (varunactl submit --sign-key).")
    _key_pair_options(sk)
    sk.set_defaults(handler=_cmd_keys_submit_key)
    show = actions.add_parser("show", help="print the public key of a key file",
                              description="Print the Z85 public key held in a .key or .key_secret file.")
    show.add_argument("file", metavar="FILE", help="a NAME.key or NAME.key_secret file")
    show.set_defaults(handler=_cmd_keys_show)


# --- fleet commands (through etcd; implemented in varunad.ctl.commands, imported on use) ---------------------

def _add_jobs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "submit", help="submit a training script as a job",
        description="Bundle SCRIPT and the files next to it (size-limited) into etcd as job NAME. The fleet's "
                    "leader runs it when it reaches the head of the queue, as P x D workers chosen for the live "
                    "VMs, and morphs it (same global batch, from the survivors' memory or the newest checkpoint) "
                    "when VMs come and go.")
    p.add_argument("--name", required=True, help="job name: letters, digits, . _ - : @")
    p.add_argument("--batch-size", type=int, required=True, metavar="B", help="global batch per step")
    p.add_argument("--chunk-size", default="auto", metavar="M|auto",
                   help="micro-batch size (a share of B that it does not divide ends in a smaller micro-batch), "
                        "or auto to let the planner choose (default)")
    p.add_argument("--steps", type=int, required=True, metavar="S", help="optimizer steps to train")
    p.add_argument("--checkpoint-every", type=int, required=True, metavar="K", help="checkpoint every K steps")
    p.add_argument("--keep-checkpoints", type=int, default=3, metavar="N", help="complete checkpoints kept (3)")
    p.add_argument("--store", metavar="DIR", help="checkpoint store of the job (default: the daemons' --store/NAME)")
    p.add_argument("--schedule", default=DEFAULT_SCHEDULE, choices=[*SCHEDULES, AUTO_SCHEDULE],
                   help=f"pipeline schedule (default {DEFAULT_SCHEDULE}); {AUTO_SCHEDULE}: the planner replays every "
                        "schedule for each plan and takes the fastest (zb-h1 splits backwards, and holds up to P "
                        "micro-batches on every stage)")
    p.add_argument("--no-import-check", action="store_true",
                   help="do not refuse a script whose imports are not installed on this machine (they are on the VMs)")
    p.add_argument("--sign-key", default=os.environ.get("VARUNAD_SIGN_KEY"), metavar="FILE",
                   help="sign the job with this NAME.sign_secret (default $VARUNAD_SIGN_KEY); fleets started "
                        "with --submit-keys run only jobs signed by a key they list")
    p.add_argument("script", metavar="SCRIPT", help="a Varuna training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="-- ARGS", help="arguments for the script")
    p.set_defaults(handler=_cmd_submit)

    p = sub.add_parser("status", help="the fleet, or one job",
                       description="Without JOB: leader, members, plan and jobs. With JOB: its state, plan "
                                   "(P, D, micro-batch, epoch), step, loss, throughput and last morph.")
    p.add_argument("job", nargs="?", metavar="JOB")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=_cmd_status)

    p = sub.add_parser("nodes", help="members with their facts and lease age",
                       description="Every live daemon: host, slots, device kind, memory, lease age and version.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=_cmd_nodes)

    p = sub.add_parser("jobs", help="every job and its state", description="Jobs in queue order with their state.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=_cmd_jobs)

    p = sub.add_parser("logs", help="the workers' output of a job",
                       description="The recent output of every worker of JOB, as the daemons ship it to etcd.")
    p.add_argument("job", metavar="JOB")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends (Ctrl-C stops)")
    p.set_defaults(handler=_cmd_logs)

    p = sub.add_parser("cancel", help="cancel a job", description="Stop JOB's workers and mark it cancelled. "
                       "Exits 0 once the leader confirms it, 1 when it did not within --wait (the request stands: "
                       "the leader cancels the job when it next runs).")
    p.add_argument("job", metavar="JOB")
    p.add_argument("--wait", type=_seconds_or_zero, default=10.0, metavar="SECONDS",
                   help="how long to wait for the leader to confirm (default 10; 0: ask and return 0 at once)")
    p.set_defaults(handler=_cmd_cancel)


# --- the local ring (varunad.ctl.local) and live progress (varunad.ctl.progress) ---------------------------

def _key_pair_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", required=True, metavar="DIR", help="directory to write into (created if missing)")
    p.add_argument("--name", required=True, metavar="NAME", help="key name: letters, digits, . _ - : @")
    p.add_argument("--force", action="store_true", help="replace an existing key pair of that name")


def _add_ring(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "up", help="start a local ring: a private etcd and N daemons on this machine",
        description="Start a private etcd and N varunad daemons (vm1..vmN, one slot each, plaintext, loopback) "
                    "in the background, with logs under DIR/logs, and wait until all have joined. Other "
                    "varunactl commands then use this etcd without --etcd, until `varunactl down`.")
    p.add_argument("n", type=int, metavar="N", help="number of daemons")
    p.add_argument("--dir", metavar="DIR", help="state: etcd data, store, logs, ring.json; an earlier ring's store, "
                   "logs and report are moved into DIR/earlier/<time>/ (default $VARUNAD_LOCAL_DIR or "
                   "~/.local/state/varunad/ring)")
    p.add_argument("--ttl", type=_seconds, default=5.0, metavar="SECONDS",
                   help="member lease TTL: how soon a killed daemon is noticed (default 5)")
    p.add_argument("--metrics-port", type=int, default=0, metavar="BASE",
                   help="give daemon i --metrics-port BASE+i (default 0: no metrics endpoint)")
    p.add_argument("--wait", type=_seconds, default=60.0, metavar="SECONDS",
                   help="longest wait for etcd and for the daemons to join (default 60)")
    # Not a positional: argparse would take every option after N as one. main() gives `up` what
    # follows "--" (see _split_daemon_args); this entry only documents it in --help.
    p.add_argument("daemon_args", nargs="?", metavar="-- FLAGS...", default=None,
                   help="more varunad flags for every daemon, after --, e.g. -- --calibrate uniform")
    p.set_defaults(handler=_cmd_up)

    p = sub.add_parser("down", help="stop the local ring",
                       description="SIGTERM every daemon of the local ring (running workers checkpoint), SIGKILL "
                                   "what is left after --grace seconds, then stop etcd. Logs and the store stay.")
    p.add_argument("--dir", metavar="DIR", help="the ring's state directory (default as for up)")
    p.add_argument("--grace", type=_seconds_or_zero, default=30.0, metavar="SECONDS",
                   help="how long daemons get to stop before SIGKILL (default 30)")
    p.set_defaults(handler=_cmd_down)

    p = sub.add_parser("kill", help="rehearse a preemption: end a daemon of the local ring at a step of the job",
                       description="Wait until the running job (or --job) has trained N steps, then end daemon VM "
                                   "of the local ring as a spot VM ends: SIGKILL of the daemon and its workers (a "
                                   "VM that vanished), or SIGTERM with --notice (a preemption notice: it "
                                   "checkpoints and leaves). Then follow the job until the new plan trained a "
                                   "step, and print the morph and where it resumed.")
    p.add_argument("vm", metavar="VM", help="a daemon of the ring running a worker of the job (vm1, vm2, ...)")
    p.add_argument("--at-step", type=int, required=True, metavar="N", help="kill once the job trained N steps")
    p.add_argument("--notice", action="store_true", help="SIGTERM (a preemption notice) instead of SIGKILL")
    p.add_argument("--job", metavar="JOB", help="the job to wait for (default: the one running)")
    p.add_argument("--dir", metavar="DIR", help="the ring's state directory (default as for up)")
    p.add_argument("--wait", type=_seconds, default=600.0, metavar="SECONDS",
                   help="longest wait for the step and then for the job to resume (default 600)")
    p.set_defaults(handler=_cmd_kill)

    p = sub.add_parser("watch", help="live progress of a job until it ends",
                       description="A progress bar for JOB (step, loss, samples/s, P x D, micro-batch, epoch) and "
                                   "a line per morph; plain lines when stdout is not a terminal. Exits 0 when the "
                                   "job is done, 1 when it failed or was cancelled.")
    p.add_argument("job", metavar="JOB")
    p.add_argument("--interval", type=_seconds, default=1.0, metavar="SECONDS", help="poll interval (default 1)")
    p.set_defaults(handler=_cmd_watch)


# --- report (varunad.report) ---------------------------------------------------------------------

def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report", help="pictures and cost of a job",
        description="Write JOB's report into DIR and print its summary. Data: loss.json, trace.json (one measured "
                    "step of every worker; open it in Perfetto), trace_predicted.json (the simulator's replay of "
                    "the plan), cost.json (device-hours, cost at spot and on-demand prices, samples per dollar, "
                    "time lost to morphs), report.json and report.txt; the leader writes the same into "
                    "<job store>/report/ when a job ends. Pictures, drawn with matplotlib (pip install "
                    "'varunad[report]'): loss.png (loss per step, morphs marked, redone steps shaded), "
                    "timeline.png and timeline_predicted.png (a row per worker: forward, recompute, backward, "
                    "send, receive, all-reduce), throughput.png (samples/s and P x D over time). --from draws "
                    "the pictures of a report directory without etcd; --traces draws workers' trace files.")
    p.add_argument("job", metavar="JOB", nargs="?", help="the job (not with --from or --traces)")
    p.add_argument("--out", metavar="DIR", help="directory to write into (default ./JOB-report; with --from: the "
                                                "report directory itself; with --traces: .)")
    p.add_argument("--prices", metavar="FILE",
                   help='JSON price table overriding the built-in one per device kind: '
                        '{"cpu": {"spot": 0.18, "on_demand": 0.34}, ...} in $ per device-hour '
                        '(built-in figures and their sources: varunad/report/prices.py)')
    p.add_argument("--store", metavar="DIR",
                   help="the job's store, where its traces are (default: as the leader recorded it)")
    p.add_argument("--json", action="store_true", help="print report.json instead of the summary")
    p.add_argument("--from", dest="from_dir", metavar="DIR",
                   help="draw the pictures of the report in DIR (e.g. <job store>/report/, which the leader wrote)")
    p.add_argument("--traces", metavar="PATH", nargs="+",
                   help="draw workers' trace files (a --trace-dir directory or its .json files) as DIR/timeline.png")
    p.add_argument("--step", type=_trace_step, default="last", metavar="N|last|all",
                   help="with --traces: the step to draw (default last)")
    p.set_defaults(handler=_cmd_report)


def _trace_step(text: str) -> int | str | None:
    if text in ("last", "all"):
        return None if text == "all" else text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step number, 'last' or 'all', got {text!r}") from None


# --- export (varunad.ctl.export) -----------------------------------------------------------------

def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="write a job's checkpoint as the model's own safetensors files",
        description="Write checkpoint N of JOB (default: its newest complete one) into DIR as safetensors files "
                    "under the names of the model's state_dict, which the model's own class loads with "
                    "load_state_dict(strict=True); for a Hugging Face model inside the script's module, its "
                    "weights and config.json, ready for from_pretrained(DIR). One file per layer of the checkpoint "
                    "(Hugging Face's sharded layout with model.safetensors.index.json), read and written one at "
                    "a time. Only a complete checkpoint is exported.")
    p.add_argument("job", metavar="JOB", nargs="?", help="the job, whose store etcd records (not needed with --store)")
    p.add_argument("--out", required=True, metavar="DIR", help="a new or empty directory to write into")
    p.add_argument("--step", type=int, metavar="N", help="the checkpoint of step N (default: the newest complete one)")
    p.add_argument("--store", metavar="DIR", help="the job's checkpoint store (default: as etcd records it for JOB)")
    p.add_argument("--module", metavar="PATH",
                   help="the submodule to export, by its path in the script's model ('' for the whole model; "
                        "default: the Hugging Face model inside, if there is one, else the whole model)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=_cmd_export)


# --- dispatcher -----------------------------------------------------------------------------------

_GROUPS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_keys, _add_jobs, _add_ring, _add_report,
                                                                   _add_export)


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="varunactl",
        description="Control a varunad fleet: keys, jobs, status. "
                    "Run `varunactl COMMAND --help` for a command's options.")
    parser.add_argument("--etcd", metavar="HOST:PORT[,...]",
                        help="etcd endpoints (default $VARUNAD_ETCD, else the ring `varunactl up` started, "
                             "else 127.0.0.1:2379)")
    parser.add_argument("--root", default=os.environ.get("VARUNAD_ROOT", "/varunad/"), metavar="PREFIX",
                        help="the fleet's etcd key root (default $VARUNAD_ROOT or /varunad/)")
    parser.add_argument("--timeout", type=_seconds, default=5.0, metavar="SECONDS",
                        help="give up on an unreachable etcd after this long (default 5)")
    env = os.environ.get
    parser.add_argument("--etcd-ca", default=env("VARUNAD_ETCD_CA"), metavar="FILE",
                        help="CA certificate to verify etcd's TLS certificate (default $VARUNAD_ETCD_CA)")
    parser.add_argument("--etcd-cert", default=env("VARUNAD_ETCD_CERT"), metavar="FILE",
                        help="client certificate for etcd, with --etcd-key (default $VARUNAD_ETCD_CERT)")
    parser.add_argument("--etcd-key", default=env("VARUNAD_ETCD_KEY"), metavar="FILE",
                        help="client key for etcd (default $VARUNAD_ETCD_KEY)")
    parser.add_argument("--etcd-user", default=env("VARUNAD_ETCD_USER"), metavar="USER",
                        help="etcd user (default $VARUNAD_ETCD_USER; the password is read from "
                             "$VARUNAD_ETCD_PASSWORD, never from the command line)")
    parser.add_argument("--version", action="version", version=f"varunactl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _GROUPS:
        add(sub)
    return parser


def _split_daemon_args(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """For `up`, the varunad flags after "--" apart from varunactl's own; other commands keep their
    "--" (submit passes what follows it to the script)."""
    commands = next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command = next((a for a in argv if a in commands), None)
    if command != "up" or "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def main(argv: Sequence[str] | None = None) -> int:
    """Run varunactl with `argv` (default: the process arguments); returns the exit status."""
    parser = _parser()
    argv, daemon_args = _split_daemon_args(parser, list(sys.argv[1:] if argv is None else argv))
    try:
        args = parser.parse_args(argv)
        if args.command == "up":
            if args.daemon_args is not None:
                parser.error(f"up: unexpected argument {args.daemon_args!r}; varunad flags go after --")
            args.daemon_args = daemon_args
        if args.command != "up":
            # gRPC's C core would print its TLS errors on stderr before varunactl's one line that
            # says what to fix (set before grpc is imported; the daemons `up` starts keep them)
            os.environ.setdefault("GRPC_VERBOSITY", "NONE")
        if args.etcd is None:
            from varunad.ctl.local import default_etcd
            args.etcd = default_etcd()
    except SystemExit as exc:   # --help, or a usage error argparse already explained
        return exc.code if isinstance(exc.code, int) else 2
    from varunad.control.jobs import JobSpecError
    from varunad.ctl.commands import CtlError

    try:
        return args.handler(args)
    except BrokenPipeError:   # `varunactl status | head`: the reader has what it wanted
        # (Python's documented way: point stdout at devnull so the exit flush cannot fail again)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ProtocolError, OSError, CtlError, JobSpecError, ValueError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"varunactl {args.command}: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C, e.g. ending `logs --follow`
        return 130


if __name__ == "__main__":
    sys.exit(main())
