"""The control plane at fleet scale: N hollow VMs (tests/support/hollow.py: the real daemon, stand-in
workers) against one real etcd server, on this machine.

For each N: the VMs join (one process for the first, which leads; the others in ten processes of
about N/10, so that killing one process is a sudden loss of 10% of the fleet); a job is submitted
(the hollow model: a pipeline, P x D chosen by the planner for the N slots) and runs; then

* rest:   15 s of steady training: etcd requests (every gRPC message a client sent: unary calls,
          lease keep-alives, watch requests) and bytes (both ways) per second per VM;
* kill:   SIGKILL to one process of ~N/10 VMs. `noticed` is when the leader decided to morph (its
          pings find the VMs silent before their leases end), `expired` when etcd deleted the first
          of their member keys and `spread` how long until the last; `replan_s` is the leader's
          own record of the morph, from its decision to the new plan written: the old workers'
          stop (the survivors' rescue and their reports; split into the stop plan written and
          the last survivor's report of its stop, with the survivors' quantiles on stderr) and
          the plan, `kill->plan` the whole; `settle_s` from that plan to every rank of it
          running (its daemon's worker report says so); etcd load during the morph; watch events
          etcd delivered per lost VM; the leader's CPU seconds per cycle (its process, which holds
          only it, over its varunad_leader_cycles_total) and over the morph;
* join:   ~N/10 new VMs boot: from the last one's registration to a plan that takes them in
          (the VMs run with --scale-up-threshold 0: any gain the planner sees is a morph), and to its
          ranks running;
* probes: link measurements stored in etcd at the end (tests/support/hollow.py's probe is fixed, the
          survey's choice of pairs and its requests are the leader's own).

Run:  python benchmarks/fleet_scale.py [--quick] [--vms 50,100,300] [--profile-leader F] [--profile-morph F]
The last line is `bench fleet: vms=N replan_s=X settle_s=Y etcd_rps_per_vm=Z probes=W` for the largest N.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from support.etcd_server import EtcdServer, die_with_parent  # noqa: E402

from trainer.launch import free_ports  # noqa: E402
from varunad.control.fleet import read_plan  # noqa: E402
from varunad.control.records import WorkerReport  # noqa: E402
from varunad.control.status import job_status  # noqa: E402
from varunad.store.etcd import EtcdStore  # noqa: E402
from varunad.store.keys import Keys  # noqa: E402

HOLLOW = REPO / "tests" / "support" / "hollow.py"
ROOT = "/varunad/"
GROUPS = 10                 # processes of hollow VMs besides the leader's: one is 10% of the fleet
MEMORY = 3 << 30            # per slot: the hollow model (8 GiB of state) needs a pipeline
JOB_SCRIPT = '''"""A hollow fleet's job: its workers are tests/support/hollow.py's stand-ins; nothing runs this."""
raise SystemExit("a hollow VM's job is not run by python")
'''


def host_of(i: int) -> str:
    """VM i's own loopback address: distinct hosts, as on a fleet (127.0.0.0/8 is all loopback)."""
    return f"127.1.{i // 250}.{i % 250 + 1}"


def etcd_counters(endpoint: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
    out = {"requests": 0.0, "bytes": 0.0, "events": 0.0}
    for line in text.splitlines():
        if line.startswith("grpc_server_msg_received_total{"):
            value = float(line.rsplit(" ", 1)[1])
            out["requests"] += value
            method = re.search(r'grpc_method="(\w+)"', line)
            if method and value:
                out[f"rpc:{method.group(1)}"] = out.get(f"rpc:{method.group(1)}", 0.0) + value
        elif line.startswith(("etcd_network_client_grpc_received_bytes_total ",
                              "etcd_network_client_grpc_sent_bytes_total ")):
            out["bytes"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("etcd_debugging_mvcc_events_total "):
            out["events"] += float(line.rsplit(" ", 1)[1])
    return out


def leader_cycles(port: int) -> float:
    text = urllib.request.urlopen(f"http://{host_of(0)}:{port}/metrics", timeout=10).read().decode()
    m = re.search(r"^varunad_leader_cycles_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@dataclass
class Observed:
    """What the benchmark's watches saw, with the wall clock of each event."""

    deleted: dict[str, float] = field(default_factory=dict)     # member -> when its key went
    joined: dict[str, float] = field(default_factory=dict)      # member -> when its key was put
    plans: list[tuple[float, int, frozenset[str]]] = field(default_factory=list)  # (at, epoch, members)
    running: dict[str, tuple[int, float]] = field(default_factory=dict)  # member -> (epoch all running, since)
    stops: list[tuple[float, int]] = field(default_factory=list)          # (at, epoch stopped) of stop plans
    stopped: dict[tuple[str, int], float] = field(default_factory=dict)   # (member, epoch) -> first report without it alive


class Fleet:
    def __init__(self, base: Path, ttl: float, log_level: str, profile: str | None = None) -> None:
        self.base, self.ttl, self.log_level, self.profile = base, ttl, log_level, profile
        self.etcd = EtcdServer()
        self.procs: list[tuple[subprocess.Popen, list[str]]] = []
        self.keys = Keys(ROOT)
        self.seen = Observed()
        self.metrics_port = free_ports(1)[0]
        self.next_vm = 0
        self.profile_group: str | None = None

    def start_group(self, count: int, *, leader: bool = False) -> list[str]:
        names = [f"h{i:04d}" for i in range(self.next_vm, self.next_vm + count)]
        hosts = [host_of(i) for i in range(self.next_vm, self.next_vm + count)]
        self.next_vm += count
        cmd = [*die_with_parent(), sys.executable, str(HOLLOW), "--names", ",".join(names), "--hosts", ",".join(hosts),
               "--state-base", str(self.base / "vms"), "--log-level", self.log_level,
               "--etcd", self.etcd.endpoint, "--root", ROOT, "--ttl", str(self.ttl), "--slots", "1",
               "--memory", str(MEMORY), "--device-kind", "hollow", "--store", str(self.base / "store"),
               "--plaintext", "--straggler-threshold", "0", "--scale-up-threshold", "0"]
        if self.profile_group and len(self.procs) == 2:   # a group that survives the kill
            cmd += ["--profile-window", str(self.profile_group)]
        if leader:
            cmd += ["--metrics-port", str(self.metrics_port)]
            if self.profile:
                cmd += ["--profile", str(self.profile)]
        log = open(self.base / f"group-{len(self.procs)}.log", "ab")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=str(REPO))
        self.procs.append((proc, names))
        return names

    def close(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for proc, _ in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.etcd.stop()


async def _watch(store: EtcdStore, prefix: str, on_event) -> None:
    while True:
        watch = store.watch_prefix(prefix)
        try:
            await watch.start(timeout=5.0)
            while True:
                event = await watch.next(timeout=None)
                if event is not None:
                    await on_event(event)
        except Exception as exc:  # a broken watch is started again; the benchmark must not stop
            print(f"  (watch of {prefix} broke: {exc!r}; watching again)", file=sys.stderr)
            await asyncio.sleep(0.2)
        finally:
            with contextlib.suppress(Exception):
                await watch.cancel()


async def _until(check, what: str, timeout: float, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        await asyncio.sleep(interval)
    raise TimeoutError(f"no {what} within {timeout:.0f}s")


async def run_size(n: int, *, ttl: float, rest_s: float, log_level: str, profile: str | None = None,
                   profile_morph: str | None = None) -> dict[str, float]:
    base = Path(tempfile.mkdtemp(prefix=f"fleet-{n}-"))
    fleet = Fleet(base, ttl, log_level, profile)
    fleet.profile_group = profile_morph
    fleet.etcd.start()
    store = EtcdStore(fleet.etcd.endpoint, timeout=5.0)
    await store.connect()
    keys, seen = fleet.keys, fleet.seen
    members: set[str] = set()

    async def on_member(ev) -> None:
        name = keys.member_name(ev.key)
        if ev.kind == "put" and name not in members:
            members.add(name)
            seen.joined[name] = time.time()
        elif ev.kind == "delete":
            members.discard(name)
            seen.deleted[name] = time.time()

    async def on_plan(ev) -> None:
        if ev.kind != "put" or ev.key != keys.plan:
            return
        at = time.time()
        doc, epoch = await read_plan(store, keys, timeout=5.0)
        if doc is not None and doc.kind == "run" and (not seen.plans or seen.plans[-1][1] != epoch):
            seen.plans.append((at, epoch, frozenset(doc.members)))
        elif doc is not None and doc.kind == "stop" and (not seen.stops or seen.stops[-1][1] != doc.stop_epoch):
            seen.stops.append((at, doc.stop_epoch))

    async def on_report(ev) -> None:
        if ev.kind != "put":
            return
        with contextlib.suppress(ValueError):
            r = WorkerReport.decode(ev.value)
            if r.workers and all(w.outcome == "running" for w in r.workers):
                if seen.running.get(r.member, (None,))[0] != r.epoch:
                    seen.running[r.member] = (r.epoch, time.time())
            ran = seen.running.get(r.member, (None,))[0]
            if ran is not None and not r.alive(ran):
                seen.stopped.setdefault((r.member, ran), time.time())

    watches = [asyncio.create_task(_watch(store, p, f)) for p, f in
               ((keys.members, on_member), (keys.plan, on_plan), (keys.workers, on_report))]
    try:
        await asyncio.sleep(0.5)
        # the leader first, alone in its process, so that its CPU time is its own
        fleet.start_group(1, leader=True)
        await _until(lambda: len(members) == 1, "first member", 60)
        leader_proc = psutil.Process(fleet.procs[0][0].pid)
        rest = n - 1
        for g in range(GROUPS):
            fleet.start_group(rest // GROUPS + (1 if g < rest % GROUPS else 0))
        t0 = time.time()
        await _until(lambda: len(members) >= n, f"{n} members", 120 + n / 2)
        join_all_s = time.time() - t0
        script = base / "job" / "hollow_job.py"
        script.parent.mkdir()
        script.write_text(JOB_SCRIPT)
        r = subprocess.run([sys.executable, "-m", "varunad.ctl.cli", "--etcd", fleet.etcd.endpoint, "--root", ROOT,
                            "submit", "--name", "hollow", "--batch-size", "4096", "--steps", "100000000",
                            "--checkpoint-every", "20", "--no-import-check", str(script)],
                           capture_output=True, text=True, cwd=str(REPO), timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"submit failed: {r.stderr}")
        t_submit = time.time()

        def all_running(plan) -> bool:
            at, epoch, ms = plan
            return all(seen.running.get(m, (None,))[0] == epoch for m in ms)

        first = await _until(lambda: seen.plans and all_running(seen.plans[-1]) and seen.plans[-1],
                             "job running", 300 + n)
        first_plan_s = first[0] - t_submit
        await asyncio.sleep(rest_s / 3)   # the first steps' reports and history writes
        c0, t_rest = etcd_counters(fleet.etcd.endpoint), time.time()
        cpu0, cyc0 = sum(leader_proc.cpu_times()[:2]), leader_cycles(fleet.metrics_port)
        await asyncio.sleep(rest_s)
        c1 = etcd_counters(fleet.etcd.endpoint)
        cpu1, cyc1 = sum(leader_proc.cpu_times()[:2]), leader_cycles(fleet.metrics_port)
        dt = time.time() - t_rest
        print("  at rest, etcd requests/s per VM by method: " + ", ".join(
            f"{k[4:]} {(c1[k] - c0.get(k, 0.0)) / dt / n:.2f}" for k in sorted(c1) if k.startswith("rpc:")
            and c1[k] > c0.get(k, 0.0)), file=sys.stderr, flush=True)
        out: dict[str, float] = {
            "vms": n, "join_all_s": join_all_s, "first_plan_s": first_plan_s, "slots_planned": len(first[2]),
            "rest_rps_per_vm": (c1["requests"] - c0["requests"]) / dt / n,
            "rest_Bps_per_vm": (c1["bytes"] - c0["bytes"]) / dt / n,
            "rest_cycles_per_s": (cyc1 - cyc0) / dt, "rest_leader_cpu": (cpu1 - cpu0) / dt,
        }

        # -- kill 10% at once ---------------------------------------------------------------------
        victim, victims = fleet.procs[1]
        cpu0, cyc0 = sum(leader_proc.cpu_times()[:2]), leader_cycles(fleet.metrics_port)
        c0, t_kill = etcd_counters(fleet.etcd.endpoint), time.time()
        plans_before = len(seen.plans)
        os.killpg(victim.pid, signal.SIGKILL)
        gone = set(victims)
        if fleet.profile_group:   # from the stop plan on: the survivors' stop
            await _until(lambda: any(at >= t_kill for at, _ in seen.stops), "the stop plan", 4 * ttl + 120, 0.01)
            os.kill(fleet.procs[2][0].pid, signal.SIGUSR2)

        def replanned():
            return next((p for p in seen.plans[plans_before:] if not (p[2] & gone)), None)

        plan = await _until(replanned, "a plan without the lost VMs", 4 * ttl + 120)
        if fleet.profile_group:
            os.kill(fleet.procs[2][0].pid, signal.SIGUSR2)
        morph = next(m for m in (await job_status(store, keys, "hollow"))["morphs"] if m["to_epoch"] == plan[1])
        await _until(lambda: gone <= set(seen.deleted), "the lost VMs' leases to end", 4 * ttl + 60)
        await _until(lambda: all_running(seen.plans[-1]) and seen.plans[-1], "the new epoch running", 120)
        settled = seen.plans[-1]
        t_settled = max(seen.running[m][1] for m in settled[2])
        c1 = etcd_counters(fleet.etcd.endpoint)
        cpu1, cyc1 = sum(leader_proc.cpu_times()[:2]), leader_cycles(fleet.metrics_port)
        first_gone = min(seen.deleted[m] for m in gone)
        t_stop, old = next(s for s in seen.stops if s[0] >= t_kill)
        survivors = [seen.stopped.get((m, old)) for m in seen.plans[plans_before - 1][2] - gone]
        after = sorted(t - t_stop for t in survivors if t is not None)
        if after:
            print(f"  survivors' reports of their stop, after the stop plan: {len(after)} of {len(survivors)}; "
                  + ", ".join(f"p{q} {after[min(len(after) - 1, len(after) * q // 100)]:.2f} s" for q in (10, 50, 90, 100)),
                  file=sys.stderr, flush=True)
        last_gone = max(seen.deleted[m] for m in gone)
        dt = t_settled - t_kill
        out.update({
            "lost": len(gone), "noticed_s": morph["noticed_at"] - t_kill, "expired_s": first_gone - t_kill,
            "expiry_spread_s": last_gone - first_gone, "replan_s": morph["planned_at"] - morph["noticed_at"],
            "stop_s": morph["stopped_at"] - morph["noticed_at"], "plan_s": morph["planned_at"] - morph["stopped_at"],
            "stop_written_s": t_stop - morph["noticed_at"],
            "last_stopped_s": max((t for t in survivors if t is not None), default=float("nan")) - t_stop,
            "kill_to_plan_s": plan[0] - t_kill, "plans_in_morph": len(seen.plans) - plans_before,
            "settle_s": t_settled - settled[0], "slots_after": len(settled[2]),
            "morph_rps_per_vm": (c1["requests"] - c0["requests"]) / dt / n,
            "morph_Bps_per_vm": (c1["bytes"] - c0["bytes"]) / dt / n,
            "events_per_change": (c1["events"] - c0["events"]) / len(gone),
            "leader_cpu_s_per_cycle": (cpu1 - cpu0) / max(1.0, cyc1 - cyc0),
            "leader_cpu_s_morph": cpu1 - cpu0,
        })

        # -- boot 10% new VMs ------------------------------------------------------------------------
        plans_before = len(seen.plans)
        new = set(fleet.start_group(len(gone)))
        await _until(lambda: new <= members, "the new VMs registered", 120 + n)
        last_join = max(seen.joined[m] for m in new)
        with contextlib.suppress(TimeoutError):
            grown = await _until(lambda: next((p for p in seen.plans[plans_before:] if p[2] & new), None),
                                 "a plan with the new VMs", 30 + 4 * ttl)
            await _until(lambda: all_running(seen.plans[-1]) and seen.plans[-1], "the grown epoch running", 120)
            last = seen.plans[-1]
            out.update({"join_replan_s": grown[0] - last_join,
                        "join_settle_s": max(seen.running[m][1] for m in last[2]) - last[0],
                        "slots_grown": len(last[2])})
        out["probes"] = len(await store.get_prefix(keys.link_pairs, timeout=10.0))
        return out
    finally:
        for w in watches:
            w.cancel()
        with contextlib.suppress(Exception):
            await store.close()
        fleet.close()


COLUMNS = [
    ("vms", "VMs", "{:.0f}"), ("join_all_s", "join s", "{:.1f}"), ("first_plan_s", "1st plan s", "{:.1f}"),
    ("slots_planned", "ranks", "{:.0f}"), ("rest_rps_per_vm", "rest req/s/VM", "{:.2f}"),
    ("rest_Bps_per_vm", "rest B/s/VM", "{:.0f}"), ("rest_cycles_per_s", "rest cycles/s", "{:.1f}"),
    ("rest_leader_cpu", "rest leader CPU", "{:.0%}"), ("lost", "lost", "{:.0f}"), ("noticed_s", "noticed s", "{:.1f}"),
    ("expired_s", "expired s", "{:.1f}"), ("expiry_spread_s", "spread s", "{:.1f}"), ("replan_s", "replan s", "{:.2f}"),
    ("stop_s", "(stop s", "{:.2f}"), ("stop_written_s", "[written s", "{:.2f}"),
    ("last_stopped_s", "last report s]", "{:.2f}"), ("plan_s", "plan s)", "{:.2f}"),
    ("kill_to_plan_s", "kill->plan s", "{:.1f}"),
    ("plans_in_morph", "plans", "{:.0f}"), ("settle_s", "settle s", "{:.2f}"),
    ("morph_rps_per_vm", "morph req/s/VM", "{:.2f}"), ("morph_Bps_per_vm", "morph B/s/VM", "{:.0f}"),
    ("events_per_change", "events/lost VM", "{:.0f}"), ("leader_cpu_s_per_cycle", "leader CPU s/cycle", "{:.3f}"),
    ("leader_cpu_s_morph", "leader CPU s/morph", "{:.1f}"), ("join_replan_s", "join replan s", "{:.2f}"),
    ("join_settle_s", "join settle s", "{:.2f}"), ("probes", "probes", "{:.0f}"),
]


def table(rows: list[dict[str, float]]) -> str:
    head = [h for _, h, _ in COLUMNS]
    body = [[fmt.format(r[k]) if k in r else "-" for k, _, fmt in COLUMNS] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="50 VMs only")
    p.add_argument("--vms", default="50,100,300", help="fleet sizes (default 50,100,300)")
    p.add_argument("--ttl", type=float, default=10.0, help="member lease TTL (the daemon's default, 10)")
    p.add_argument("--rest", type=float, default=15.0, help="seconds of steady training measured")
    p.add_argument("--log-level", default="WARNING", help="the hollow VMs' log level (their logs: the temp dir)")
    p.add_argument("--profile-leader", metavar="FILE", help="cProfile the leader's process into FILE (last size)")
    p.add_argument("--profile-morph", metavar="FILE",
                   help="cProfile one surviving process of hollow VMs from the stop plan to the new plan (last size)")
    args = p.parse_args()
    sizes = [50] if args.quick else [int(x) for x in args.vms.split(",")]
    rows = []
    for n in sizes:
        print(f"{n} hollow VMs ...", file=sys.stderr, flush=True)
        rows.append(asyncio.run(run_size(n, ttl=args.ttl, rest_s=args.rest, log_level=args.log_level,
                                         profile=args.profile_leader if n == sizes[-1] else None,
                                         profile_morph=args.profile_morph if n == sizes[-1] else None)))
        print(table(rows), file=sys.stderr, flush=True)
    print(table(rows))
    last = rows[-1]
    print(f"bench fleet: vms={last['vms']:.0f} replan_s={last['replan_s']:.2f} settle_s={last['settle_s']:.2f} "
          f"etcd_rps_per_vm={last['rest_rps_per_vm']:.2f} probes={last['probes']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
