"""What each varunactl subcommand does: one handler per subcommand, `_cmd_<command>(args)`, which
takes the arguments `varunad.ctl.cli` parsed and returns the exit status.

The command line's declarations (arguments, help texts) and its dispatcher stay in cli, which binds
these handlers by name; this module owns what runs once the arguments are parsed: the fleet commands
through etcd (`_run`, with the TLS and auth varunactl was given), the local ring, live progress,
the report and the export. The modules they call are imported on use, so `varunactl --help` loads
none of them. An error the user can fix is raised (cli's `main` prints it as one line), or, where a
command words it itself (report, export), printed here with the exit status.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from protocol.security import generate_key_pair, load_public_key

# --- keys -----------------------------------------------------------------------------------------

def _cmd_keys_generate(args: argparse.Namespace) -> int:
    public, secret = generate_key_pair(args.dir, args.name, force=args.force)
    print(f"public key  {public}  (copy it into the allow-list directory of every daemon)")
    print(f"secret key  {secret}  (mode 0600; keep it on this machine)")
    return 0


def _cmd_keys_submit_key(args: argparse.Namespace) -> int:
    from varunad.node.signing import generate_submit_key

    secret, public = generate_submit_key(args.dir, args.name, force=args.force)
    print(f"public key  {public}  (copy it into the --submit-keys directory of every daemon)")
    print(f"secret key  {secret}  (mode 0600; sign jobs with `varunactl submit --sign-key {secret}`)")
    return 0


def _cmd_keys_show(args: argparse.Namespace) -> int:
    print(load_public_key(args.file).decode("ascii"))
    return 0

# --- fleet commands (through etcd; implemented in varunad.ctl.commands, imported on use) ---------------------

def _keys(args: argparse.Namespace):
    from varunad.store.keys import Keys

    return Keys(args.root)


def _run(args: argparse.Namespace, fn) -> int:
    from varunad.ctl import commands as ctl

    return ctl.run(args.etcd, args.timeout, fn, **_etcd_security(args))


def _etcd_security(args: argparse.Namespace) -> dict:
    """TLS and auth for etcd, as the daemon takes them (flags, else VARUNAD_ETCD_* variables)."""
    password = os.environ.get("VARUNAD_ETCD_PASSWORD")
    if (args.etcd_user is None) != (password is None):
        raise ValueError("--etcd-user (VARUNAD_ETCD_USER) needs VARUNAD_ETCD_PASSWORD, and the other way round")
    return dict(ca_file=args.etcd_ca, cert_file=args.etcd_cert, key_file=args.etcd_key, user=args.etcd_user,
                password=password, probe_key=args.root)


def _cmd_submit(args: argparse.Namespace) -> int:
    from varunad.ctl import commands as ctl

    script_args = list(args.script_args)
    if script_args and script_args[0] == "--":
        script_args = script_args[1:]
    spec, bundle = ctl.build_spec(
        name=args.name, script=args.script, args=script_args, batch_size=args.batch_size,
        chunk_size=args.chunk_size, steps=args.steps, checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints, store=args.store, schedule=args.schedule,
        import_check=not args.no_import_check)
    home = os.path.dirname(os.path.abspath(args.script))
    for path in ctl.misplaced_paths(args.script, script_args):
        inside = os.path.abspath(path).startswith(home + os.sep)
        print(f"varunactl submit: note: {path!r} is a path from this directory, but the script runs in its own "
              "directory's copy on each VM, where it names nothing: "
              + (f"give it as {os.path.relpath(path, home)!r}, relative to the script" if inside else
                 "it is outside the script's directory, so not in the job's bundle: give a path the VMs have, "
                 "absolute"), file=sys.stderr)
    if spec.checkpoint_every > spec.steps:
        print(f"varunactl submit: note: --checkpoint-every {spec.checkpoint_every} is more than --steps {spec.steps}: "
              "no checkpoint before the end, so a lost VM restarts the job from step 0", file=sys.stderr)
    signature = None
    if args.sign_key:
        from varunad.node.signing import sign_spec

        signature = sign_spec(args.sign_key, spec.encode()).encode()
    return _run(args, lambda store: ctl.submit(store, _keys(args), spec, bundle, signature=signature))


def _cmd_status(args: argparse.Namespace) -> int:
    from varunad.ctl import commands as ctl

    async def go(store) -> int:
        doc = await (ctl.job_status(store, _keys(args), args.job) if args.job else
                     ctl.fleet_status(store, _keys(args)))
        if args.json:
            print(ctl.dumps(doc))
        elif args.job:
            ctl.print_job(doc)
        else:
            ctl.print_fleet(doc)
        return 0

    return _run(args, go)


def _cmd_nodes(args: argparse.Namespace) -> int:
    from varunad.ctl import commands as ctl

    async def go(store) -> int:
        members = await ctl.nodes(store, _keys(args))
        if args.json:
            print(ctl.dumps(members))
            return 0
        print(f"{'NAME':<16} {'HOST':<16} {'SLOTS':>5} {'KIND':<8} {'MEM_GiB':>8} {'LEASE_AGE':>9} {'TTL_LEFT':>8} "
              f"{'UP_S':>8}  VERSION")
        for m in members:
            age = "-" if m["lease_age_s"] is None else f"{m['lease_age_s']:.0f}s"
            left = "-" if m["lease_ttl_left_s"] is None else f"{m['lease_ttl_left_s']}s"
            print(f"{m['name']:<16} {m['host']:<16} {m['slots']:>5} {m['device_kind']:<8} "
                  f"{m['memory_bytes'] / 2**30:>8.1f} {age:>9} {left:>8} {m['up_s']:>8.0f}  {m['version']}"
                  + ("  (leaving)" if m["draining"] else "")
                  + ("  (spare workers not ready)" if m["warming"] else "")
                  + (f"  (shares machine {m['machine'][:8]}'s {m['cores']} cores with {m['sharing_machine_with']} "
                     "other daemon(s))" if m["sharing_machine_with"] else ""))
        return 0

    return _run(args, go)


def _cmd_jobs(args: argparse.Namespace) -> int:
    from varunad.ctl import commands as ctl

    async def go(store) -> int:
        rows = await ctl.jobs(store, _keys(args))
        if args.json:
            print(ctl.dumps(rows))
            return 0
        print(f"{'JOB':<24} {'STATE':<10} {'EPOCH':>8}  REASON")
        for j in rows:
            print(f"{j['job']:<24} {j.get('activity') or j['state']:<10} {j['epoch']:>8}  {j['reason']}")
        return 0

    return _run(args, go)


def _cmd_logs(args: argparse.Namespace) -> int:
    from varunad.ctl import commands as ctl

    return _run(args, lambda store: ctl.logs(store, _keys(args), args.job, follow=args.follow))


def _cmd_cancel(args: argparse.Namespace) -> int:
    from varunad.ctl import commands as ctl

    return _run(args, lambda store: ctl.cancel(store, _keys(args), args.job, wait=args.wait))

# --- the local ring (varunad.ctl.local) and live progress (varunad.ctl.progress) ---------------------------

def _cmd_up(args: argparse.Namespace) -> int:
    from varunad.ctl import local

    ring = local.up(args.n, args.dir, ttl=args.ttl, root=args.root, metrics_port=args.metrics_port,
                    daemon_args=args.daemon_args, timeout=args.wait, say=lambda line: print(f"note      {line}"))
    print(f"etcd      {ring.etcd}  (log {ring.etcd_proc.log})")
    for d in ring.daemons:
        metrics = f", metrics on 127.0.0.1:{d.metrics_port}" if d.metrics_port else ""
        print(f"daemon    {d.name}  pid {d.pid}{metrics}  (log {d.log})")
    print(f"store     {ring.store}")
    if Path(ring.dir).resolve() == local.default_dir().resolve():
        print(f"ring      {ring.dir}/{local.RING_FILE}: varunactl finds this etcd by itself; "
              f"`varunactl down` stops everything")
    else:   # other commands look in the default directory only
        print(f"ring      {ring.dir}/{local.RING_FILE}: export VARUNAD_LOCAL_DIR={shlex.quote(str(ring.dir))} so "
              f"varunactl finds this etcd (or pass --etcd {ring.etcd}); `varunactl down --dir "
              f"{shlex.quote(str(ring.dir))}` stops everything")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from varunad.ctl import local

    if not local.down(args.dir, timeout=args.grace, say=print):
        print(f"no ring is up in {args.dir or local.default_dir()}")
    return 0


def _cmd_kill(args: argparse.Namespace) -> int:
    from varunad.ctl import local, rehearse

    ring = rehearse.local_ring(args.dir)
    if args.etcd == local.default_etcd():   # no --etcd given: the ring's own, wherever its --dir is
        args.etcd = ring.etcd
    return _run(args, lambda store: rehearse.kill_at_step(store, _keys(args), args.vm, args.at_step, job=args.job,
                                                          notice=args.notice, state_dir=args.dir,
                                                          timeout=args.wait))


def _cmd_watch(args: argparse.Namespace) -> int:
    from varunad.ctl import progress

    return _run(args, lambda store: progress.watch(store, _keys(args), args.job, interval=args.interval))

# --- report (varunad.report) ---------------------------------------------------------------------

def _cmd_report(args: argparse.Namespace) -> int:
    from varunad.report import pictures

    given = [name for name, on in (("JOB", args.job), ("--from", args.from_dir), ("--traces", args.traces)) if on]
    if len(given) != 1:
        print("varunactl report: give one of JOB, --from DIR or --traces PATH"
              + (f", not {' and '.join(given)}" if given else ""), file=sys.stderr)
        return 2
    try:
        if args.traces:
            print(pictures.draw_traces(args.traces, Path(args.out or ".") / "timeline.png", args.step))
            return 0
        if args.from_dir:
            drawn, notes = pictures.draw_report(args.from_dir, args.out)
            out = args.out or args.from_dir
            print("\n".join([f"drew     {', '.join(drawn) or 'nothing'} into {out}/"]
                            + [f"note     {n}" for n in notes]))
            return 0
        return _report_job(args, pictures)
    except pictures.NoMatplotlib as exc:
        print(f"varunactl report: {exc}", file=sys.stderr)
        return 1


def _report_job(args: argparse.Namespace, pictures) -> int:
    """JOB's report: its data from etcd and the job's store into DIR, then the pictures drawn from it."""
    from varunad import report
    from varunad.ctl import commands as ctl
    from varunad.report.prices import load_prices

    prices = load_prices(args.prices)  # a bad price file is refused before etcd is asked anything
    out = args.out or f"{args.job}-report"

    async def go(store) -> dict:
        inputs = await report.collect(store, _keys(args), args.job, store_dir=args.store)
        return report.build_report(inputs, out, prices)

    doc = _run(args, go)
    try:
        drawn, notes = pictures.draw_report(out)
    except pictures.NoMatplotlib as exc:   # the data stands; say what is missing for the pictures
        print(ctl.dumps(doc) if args.json else report.format_report(doc).rstrip("\n"))
        print(f"varunactl report: {exc} (the report's data is in {out}/)", file=sys.stderr)
        return 1
    if args.json:
        print(ctl.dumps(doc | {"pictures": drawn, "picture_notes": notes}))
    else:
        print(report.format_report(doc), end="")
        print("\n".join([f"pictures {', '.join(drawn) or 'none'}"] + [f"note     {n}" for n in notes]
                        + [f"written to {out}/"]))
    return 0

# --- export (varunad.ctl.export) -----------------------------------------------------------------

def _cmd_export(args: argparse.Namespace) -> int:
    from varunad.ctl import commands as ctl
    from varunad.ctl import export

    if args.store is None and args.job is None:
        print("varunactl export: give JOB (its store is read from etcd) or --store DIR", file=sys.stderr)
        return 2
    store_dir = args.store
    if store_dir is None:
        async def find(store) -> str:
            return await export.job_store_dir(store, _keys(args), args.job)

        store_dir = _run(args, find)
    doc = export.export(store_dir, args.out, args.step, args.module)
    if args.json:
        print(ctl.dumps(doc))
    else:
        export.print_exported(doc)
    return 0
