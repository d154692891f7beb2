"""varunactl's fleet commands: submit, status, nodes, jobs, logs, cancel (all through etcd).

Each command opens the store with a bounded timeout, so an unreachable etcd is one clear error
after a few seconds, never a hang. Errors the user can fix raise ``CtlError`` (one line on
stderr, exit status 1); ``varunad.ctl.cli`` declares the arguments and dispatches here.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import io
import json
import os
import sys
import time
import zipfile
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from varunad.cluster.facts import parse_member
from varunad.control.fleet import read_plan
from varunad.control.jobs import BundleError, JobSpec, JobSpecError, bundle_digest, pack_bundle
from varunad.control.status import (
    elapsed,
    job_queue,
    job_status,
    memory_lines,
    plan_lines,
    read_state,
    speed_lines,
)
from varunad.store.contract import (
    HistoryCompacted,
    Store,
    StoreAuthError,
    StoreConfigError,
    StoreError,
    StoreUnavailable,
)
from varunad.store.etcd import EtcdStore
from varunad.store.keys import Keys
from varunad.store.schemas import strict_json

__all__ = ["CtlError", "run", "check_bundle", "build_spec", "misplaced_paths", "submit", "plan_lines", "job_status", "fleet_status", "nodes", "jobs", "logs", "cancel",
           "print_job", "print_fleet", "dumps"]


class CtlError(Exception):
    """A refusal with its reason (printed as one line)."""


def _unreachable(etcd: str, exc: Exception, timeout: float) -> CtlError:
    """One line for "nothing answers there": what to do, not the gRPC client's paragraph."""
    text = str(exc)
    why = ("connection refused" if "connection refused" in text.lower() else
           f"no answer within {timeout:g}s" if "deadline" in text.lower() or "timed out" in text.lower() else
           text.splitlines()[0][:300] if text else type(exc).__name__)
    if why == "connection refused":
        from varunad.ctl.local import stopped_ring  # local imports this module

        ring = stopped_ring()
        if ring is not None and etcd in (ring.etcd, "127.0.0.1:2379"):   # not a remote etcd someone named
            # a probe restarted the ring's etcd by hand and was pointed at 2379, with no word of the ring
            return CtlError(f"cannot reach etcd at {etcd} ({why}): the local ring of {ring.dir} is down (its etcd "
                            f"at {ring.etcd} stopped): `varunactl up N` starts one again, `varunactl down` clears "
                            f"it; an etcd you started there yourself: --etcd {ring.etcd}")
        return CtlError(f"cannot reach etcd at {etcd} ({why}): no ring is up here? start one with `varunactl up N`, "
                        f"or point --etcd HOST:PORT (or $VARUNAD_ETCD) at your fleet's etcd")
    # something listens (or the network drops packets): a stopped, overloaded or partitioned etcd
    return CtlError(f"cannot reach etcd at {etcd} ({why}): it does not answer; is it stopped, overloaded or cut off "
                    f"(try again, or check the etcd process and its host)? --etcd HOST:PORT (or $VARUNAD_ETCD) "
                    f"names another")


# EtcdStore's TLS options and the flag (and variable) that sets each
_TLS_FLAGS = {"ca_file": "--etcd-ca (VARUNAD_ETCD_CA)", "cert_file": "--etcd-cert (VARUNAD_ETCD_CERT)",
              "key_file": "--etcd-key (VARUNAD_ETCD_KEY)"}
_USER_FLAGS = "--etcd-user (VARUNAD_ETCD_USER) and VARUNAD_ETCD_PASSWORD"


def _etcd_failed(etcd: str, exc: StoreError, timeout: float, options: dict[str, Any], *,
                 connected: bool = False) -> CtlError:
    """One line for a failed etcd request that names the option to fix: a TLS file that cannot be
    read, a TLS handshake etcd or we refused, a wrong user or password, a role without the key
    root; anything else is "cannot reach" (:func:`_unreachable`). `connected`: etcd answered this
    client before, so a closed connection is etcd going away, not a TLS port."""
    text = getattr(exc, "reason", str(exc))
    user = options.get("user")
    if isinstance(exc, StoreConfigError):
        for option, flag in _TLS_FLAGS.items():
            path = options.get(option)
            if path and str(path) in text:
                why = getattr(exc.__cause__, "strerror", None) or text
                return CtlError(f"cannot read {flag} file {path} ({why}): fix the path or the file's permissions")
        return CtlError(f"etcd options: {text}")
    if isinstance(exc, StoreAuthError):
        if "user name is empty" in text:
            return CtlError(f"etcd at {etcd} requires a user (authentication is on): pass {_USER_FLAGS}")
        if "authentication failed" in text or "invalid auth token" in text:
            return CtlError(f"etcd at {etcd} refused user {user!r} and its password: check {_USER_FLAGS}")
        if "permission denied" in text:
            return CtlError(f"etcd at {etcd} denied user {user!r} access to {options.get('probe_key')!r} (permission "
                            "denied): pass the --root (VARUNAD_ROOT) its role is granted, or grant the role that prefix")
        return CtlError(f"etcd at {etcd} refused the request ({text.splitlines()[0][:120]}): check {_USER_FLAGS}")
    if isinstance(exc, StoreUnavailable):
        tls = options.get("ca_file") or options.get("cert_file")
        if "CERTIFICATE_VERIFY_FAILED" in text:
            return CtlError(f"etcd at {etcd}: its TLS certificate is not signed by {options.get('ca_file')}: pass the "
                            f"CA that signed it with {_TLS_FLAGS['ca_file']}")
        if tls and ("TSI_" in text or "handshake" in text.lower() or "BAD_CERTIFICATE" in text):
            return CtlError(f"etcd at {etcd} refused the TLS handshake: it may want a client certificate; pass "
                            f"{_TLS_FLAGS['cert_file']} and {_TLS_FLAGS['key_file']}, signed by a CA etcd trusts")
        if connected and "socket closed" in text.lower():
            return CtlError(f"etcd at {etcd} closed the connection: was it stopped or restarted? (check the etcd "
                            "process and its host, and try again)")
        if not tls and "socket closed" in text.lower():
            return CtlError(f"etcd at {etcd} closed a plaintext connection: it speaks TLS? pass "
                            f"{_TLS_FLAGS['ca_file']} (and {_TLS_FLAGS['cert_file']}, {_TLS_FLAGS['key_file']} if it "
                            "asks for client certificates)")
    return _unreachable(etcd, exc, timeout)


async def _open(etcd: str, timeout: float, **options: Any) -> Store:
    try:
        store = EtcdStore(etcd, timeout=timeout, **options)
        await store.connect()
        return store
    except StoreError as exc:
        raise _etcd_failed(etcd, exc, timeout, options) from None


def run(etcd: str, timeout: float, fn: Callable[[Store], Awaitable[int]], **options: Any) -> int:
    """Open the store (``options``: EtcdStore's TLS, auth and probe key), run ``fn(store)``, close
    it; StoreError becomes CtlError."""
    async def main() -> int:
        store = await _open(etcd, timeout, **options)
        try:
            return await fn(store)
        except StoreError as exc:
            raise _etcd_failed(etcd, exc, timeout, options, connected=True) from None
        finally:
            await store.close()

    return asyncio.run(main())


# --- submit --------------------------------------------------------------------------------------------

def check_bundle(data: bytes, script: str, *, imports: bool = True) -> None:
    """Refuse a bundle whose Python files do not compile, or whose script imports a top-level
    module that is neither in the bundle nor installed here (found without importing it): both
    would fail on every VM, every time. BundleError names the file, line and what to do."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        names = zf.namelist()
        trees = {}
        for name in names:
            if not name.endswith(".py") and name != script:   # the script is Python whatever its name
                continue
            source = zf.read(name)
            try:
                trees[name] = ast.parse(source, filename=name)
                compile(trees[name], name, "exec", dont_inherit=True)
            except SyntaxError as exc:
                if name == script and not name.endswith(".py"):
                    # a data file given where the script goes (`submit ... input.txt`)
                    raise BundleError(f"{name} is not a Python script (line {exc.lineno}: {exc.msg}): submit the "
                                      "training script, and pass its data files as the script's arguments after "
                                      "--") from None
                raise BundleError(f"{name} line {exc.lineno}: {type(exc).__name__}: {exc.msg}; fix it and submit "
                                  "again (the job would fail on every VM)") from None
            except ValueError as exc:   # null bytes
                if name == script and not name.endswith(".py"):
                    raise BundleError(f"{name} is not a Python script ({exc}): submit the training script, and pass "
                                      "its data files as the script's arguments after --") from None
                raise BundleError(f"{name} cannot be compiled: {exc}") from None
    if not imports or script not in trees:
        return
    local = {n.split("/", 1)[0].removesuffix(".py") for n in names}
    wanted = set()
    for node in trees[script].body:   # top-level imports only: a guarded or lazy one may be optional
        if isinstance(node, ast.Import):
            wanted |= {a.name.split(".", 1)[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            wanted.add(node.module.split(".", 1)[0])
    missing = sorted(m for m in wanted - local if importlib.util.find_spec(m) is None)
    if missing:
        raise BundleError(f"{script} imports {', '.join(missing)}, which is neither next to it nor installed here; "
                          "install it (every VM needs it too) or pass --no-import-check if only the VMs have it")


def build_spec(*, name: str, script: str, args: list[str], batch_size: int, chunk_size: str, steps: int,
               checkpoint_every: int, keep_checkpoints: int, store: str | None, schedule: str,
               import_check: bool = True) -> tuple[JobSpec, bytes]:
    """The spec and bundle for ``submit``; JobSpecError/BundleError say why not."""
    if chunk_size == "auto":
        chunk = None
    else:
        try:
            chunk = int(chunk_size)
        except ValueError:
            raise JobSpecError(f"--chunk-size must be a positive integer or 'auto', got {chunk_size!r}") from None
    # Check the numbers first: a bad spec is refused before the script is even read.
    probe = dict(job=name, script="x.py", args=tuple(args), batch_size=batch_size, chunk_size=chunk, steps=steps,
                 checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints, store=store,
                 schedule=schedule, bundle_digest="0" * 64, bundle_bytes=0)
    JobSpec(**probe)
    data, rel = pack_bundle(script)
    check_bundle(data, rel, imports=import_check)
    spec = JobSpec(**{**probe, "script": rel, "bundle_digest": bundle_digest(data), "bundle_bytes": len(data),
                      "submitted_at": time.time()})
    return spec, data


def misplaced_paths(script: str | os.PathLike[str], args: Sequence[str], cwd: str | None = None) -> list[str]:
    """The script's arguments (or `--flag=value` values) that name a file or directory from here
    by a relative path that does not exist from the script's directory, where its workers run:
    a probe's `-- --data port2/input.txt` failed at calibration with FileNotFoundError."""
    here = Path(cwd or os.getcwd())
    home = (here / script).resolve().parent

    def exists(path: Path) -> bool:
        try:
            return path.exists()
        except (OSError, ValueError):   # a name too long, a NUL: an argument that is no path
            return False

    out = []
    for arg in args:
        value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
        if not value or value.startswith("-") or os.path.isabs(value):
            continue
        if exists(here / value) and not exists(home / value):
            out.append(value)
    return out


async def submit(store: Store, keys: Keys, spec: JobSpec, bundle: bytes, out: TextIO = sys.stdout, *,
                 signature: bytes | None = None) -> int:
    """Write the bundle, the signature (``signature`` of ``spec.encode()``, or none) and the spec
    in one transaction that only a job name not taken lets through: the leader finds everything
    the spec needs with it, and of two submits of one name, the one refused writes nothing (its
    bundle would otherwise replace the other job's)."""
    if await store.get(keys.job(spec.job)) is not None:
        raise CtlError(f"a job named {spec.job} exists already; choose another --name")
    with_it = [(keys.bundle(spec.job), bundle), (keys.signature(spec.job), signature)]
    if not await store.create_if_absent(keys.job(spec.job), spec.encode(), also=with_it):
        raise CtlError(f"a job named {spec.job} was submitted at the same moment; choose another --name")
    print(f"submitted {spec.job}: {spec.script} {' '.join(spec.args)} (batch {spec.batch_size}, {spec.steps} steps, "
          f"checkpoint every {spec.checkpoint_every}; bundle {spec.bundle_bytes / 1024:.1f} KiB"
          f"{'; signed' if signature is not None else ''})", file=out)
    if not await store.get_prefix(keys.members):
        # accepted all the same (a ring that boots later runs it), but a user waiting for it
        # should know nothing can yet
        print(f"note: no daemon is up (none holds a member key in etcd): {spec.job} waits in the queue until "
              "one starts; `varunactl nodes` lists them", file=sys.stderr)
    return 0


# --- status --------------------------------------------------------------------------------------------

async def _members(store: Store, keys: Keys) -> list[dict[str, Any]]:
    out = []
    for kv in await store.get_prefix(keys.members):
        try:
            m = parse_member(kv.value)
        except ValueError:
            continue
        remaining = await store.time_to_live(kv.lease) if kv.lease else None
        out.append({
            "name": m.name, "host": m.host, "endpoint": m.endpoint, "slots": m.slots, "device_kind": m.device_kind,
            "memory_bytes": m.memory_bytes, "version": m.version, "draining": m.draining,
            "warming": m.warming,
            "worker_ports": list(m.worker_ports), "rendezvous_port": m.rendezvous_port,
            "probe_ports": list(m.probe_ports),
            "machine": m.machine, "cores": m.cores, "threads": m.threads,
            "up_s": round(time.time() - m.started_at, 1),
            "lease_ttl_left_s": remaining,
            "lease_age_s": None if remaining is None or not m.lease_ttl else round(m.lease_ttl - remaining, 1),
        })
    # members that report one machine share its cores: each says with how many others
    sharing = Counter(m["machine"] for m in out if m["machine"])
    for m in out:
        m["sharing_machine_with"] = sharing[m["machine"]] - 1 if m["machine"] else 0
    return out


async def fleet_status(store: Store, keys: Keys) -> dict[str, Any]:
    leader = await store.get(keys.leader)
    # the plan the fleet follows: a value no leader wrote (garbage, a forgery) is not shown as it
    plan, epoch = await read_plan(store, keys, timeout=None)
    plan_doc = None if plan is None else {**json.loads(plan.encode()), "epoch": epoch}
    return {"leader": leader.value.decode(errors="replace") if leader else None,
            "members": await _members(store, keys), "plan": plan_doc, "jobs": await job_queue(store, keys)}


# a note about a job's checkpoints is a warning while it runs, history once it is over
_ENDED = ("done", "failed", "cancelled")


def print_job(doc: dict[str, Any], out: TextIO = sys.stdout) -> None:
    plan = doc["plan"]
    shape = f"{plan['P']}x{plan['D']}, micro-batch {plan['micro_batch_size']}" if plan["P"] else "-"
    redo = doc.get("redoing")
    moves = [m for m in doc["morphs"] if not m.get("restart")]
    lines = [
        f"job       {doc['job']}: {doc.get('activity') or doc['state']} ({doc['reason']}"
        + (f", for {elapsed(doc['calibrating_s'])} so far" if doc.get("calibrating_s") is not None else "") + ")",
        f"plan      epoch {doc['epoch']}: {shape} on {', '.join(plan['members']) or '-'}",
        *plan_lines(plan),
        *memory_lines(doc.get("stages") or []),
        *speed_lines(doc.get("paces") or {}, doc.get("stragglers") or {}),
        f"step      {doc['step']}" + (f" of {doc['steps']}" if doc.get("steps") else "") + " done"
        + (f", loss {doc['loss']:.4f} (step {doc['step'] - 1})" if doc["loss"] is not None and doc["step"] else "")
        + (f", {doc['samples_per_s']:.1f} samples/s" if doc["samples_per_s"] else "")
        + (f", busy {100 * doc['busy_fraction']:.0f}%" if doc["busy_fraction"] is not None else "")
        + (f", redoing steps {redo['first']}-{redo['last']} after {redo['cause']}" if redo else ""),
        f"restarts  {doc['restarts']}" + (f" (last error: {doc['error'].splitlines()[0][:200]})"
                                          if doc["error"] and doc["restarts"] else ""),
        f"morphs    {len(moves) or 'none'}" + "".join(f"\n  {m['from']} -> {m['to']}: {m['reason'].splitlines()[0]}"
                                                       for m in moves[-5:]),
    ] + [f"{'noted' if doc['state'] in _ENDED else 'warning':9s} {w}" for w in doc.get("warnings", [])]
    if doc.get("unrecorded"):
        lines.append("losses    not recorded for steps " + ", ".join(
            f"{a}-{b}" if b > a else str(a) for a, b in doc["unrecorded"][:5])
            + ": trained once, but the daemon holding their losses was lost before it wrote them")
    if doc.get("daemons") == 0:
        lines.append("fleet     no daemon is up (no live member key): nothing trains until one starts; the job goes "
                     "on from its newest checkpoint then (varunactl nodes)")
    if doc.get("store_failing"):
        # a checkpoint is staged in the daemon's state directory (STATE_DIR/staging/JOB) before the
        # store: which of the two refused is in the path the error names
        where = ("the daemon's --state-dir, where checkpoints are staged on their way to the store,"
                 if "/staging/" in doc["store_failing"] else "the store")
        lines.append(f"store     {doc['store_failing']}: free space on {where} or remount it writable; "
                     "training keeps its state and writes again when it can")
    print("\n".join(lines), file=out)


def print_fleet(doc: dict[str, Any], out: TextIO = sys.stdout) -> None:
    print(f"leader    {doc['leader'] or '(none)'}", file=out)
    print(f"members   {len(doc['members'])}: " + ", ".join(
        f"{m['name']} ({m['slots']} {m['device_kind']}{', leaving' if m['draining'] else ''})" for m in doc["members"]),
        file=out)
    plan = doc["plan"]
    if plan and "kind" in plan:
        if plan["kind"] == "run":
            par = plan["plan"]
            print(f"plan      epoch {plan['epoch']}: {plan['job']} as {par['P']}x{par['D']}, "
                  f"micro-batch {par['micro_batch_size']}", file=out)
        else:
            print(f"plan      epoch {plan['epoch']}: {plan['kind']} {plan.get('job') or ''} ({plan['reason']})",
                  file=out)
    for j in doc["jobs"]:
        print(f"job       {j['job']}: {j.get('activity') or j['state']} ({j['reason']})", file=out)


# --- logs and cancel -------------------------------------------------------------------------------------

def _seq(key: str) -> tuple[str, str]:
    member, _, seq = key.rpartition("/")
    return seq, member


async def logs(store: Store, keys: Keys, job: str, *, follow: bool, out: TextIO = sys.stdout) -> int:
    if await store.get(keys.job(job)) is None:
        raise CtlError(f"no job named {job} (see `varunactl jobs`)")
    prefix = keys.logs_of(job)
    shown: set[tuple[str, int]] = set()  # (key, mod revision) already written out

    async def catch_up() -> int:
        listing = await store.get_prefix(prefix)
        for kv in sorted(listing, key=lambda kv: _seq(kv.key)):
            if (kv.key, kv.mod_revision) not in shown:
                shown.add((kv.key, kv.mod_revision))
                out.write(kv.value.decode("utf-8", errors="replace"))
        out.flush()
        return listing.revision

    revision = await catch_up()
    unanswered = 0.0   # since when etcd has not answered (0: it answers)
    if not shown and not follow:
        # nothing on stdout is a log; a note on stderr says why there is none
        state = await read_state(store, keys, job)
        print(f"{job}: no output from its workers or its calibration run "
              f"({state.state if state is not None else 'queued'}; what a worker prints is kept here once "
              f"its daemon ships it, every few seconds)", file=sys.stderr)
    try:
        while follow:
            try:
                if unanswered:   # what came meanwhile, then watch again
                    revision = await catch_up()
                    print(f"etcd answers again after {time.monotonic() - unanswered:.0f}s", file=sys.stderr)
                    unanswered = 0.0
                async with store.watch_prefix(prefix, start_revision=revision + 1) as watch:
                    while True:
                        event = await watch.next(timeout=2.0)
                        if event is None:
                            state = await read_state(store, keys, job)
                            if state is not None and state.terminal:
                                return 0
                            continue
                        if event.kind == "put" and (event.key, event.revision) not in shown:
                            shown.add((event.key, event.revision))
                            out.write(event.value.decode("utf-8", errors="replace"))
                            out.flush()
            except HistoryCompacted:
                # etcd compacted what the watch was to replay: list again, write what is new
                revision = await catch_up()
            except StoreUnavailable as exc:
                # the fleet rides through an etcd pause or restart, and so does a follower of it
                if not unanswered:
                    unanswered = time.monotonic()
                    print(f"etcd does not answer ({str(exc).splitlines()[0][:200]}); still following "
                          "(Ctrl-C to stop)", file=sys.stderr)
                await asyncio.sleep(1.0)
    except KeyboardInterrupt:
        return 0
    return 0


async def cancel(store: Store, keys: Keys, job: str, *, wait: float, out: TextIO = sys.stdout,
                 err: TextIO = sys.stderr) -> int:
    if await store.get(keys.job(job)) is None:
        raise CtlError(f"no job named {job} (see `varunactl jobs`)")
    state = await read_state(store, keys, job)
    if state is not None and state.terminal:
        raise CtlError(f"job {job} is already {state.state}")
    await store.put(keys.cancel(job), str(time.time()))
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        state = await read_state(store, keys, job)
        if state is not None and state.terminal:
            print(f"{job} is {state.state}", file=out)
            return 0
        await asyncio.sleep(0.2)
    if not wait:
        print(f"asked to cancel {job} (see `varunactl status {job}`)", file=out)
        return 0
    # the request stands in etcd, but a script that waited for the cancel must not read a success
    # (a probe's fleet was down: nothing could confirm, and the cancel returned 0)
    why = ("no daemon is up: the leader cancels it once one starts" if not await store.get_prefix(keys.members)
           else f"the leader has not confirmed it within {wait:g}s")
    print(f"asked to cancel {job}, not cancelled yet: {why} (see `varunactl status {job}`)", file=err)
    return 1


def dumps(doc: Any) -> str:
    return strict_json(doc, indent=2, sort_keys=False)


async def nodes(store: Store, keys: Keys) -> list[dict[str, Any]]:
    return await _members(store, keys)


async def jobs(store: Store, keys: Keys) -> list[dict[str, Any]]:
    return await job_queue(store, keys)

