"""What a job's calibration costs before its first plan, as a user meets it: one daemon (two CPU
slots, the default `--calibrate profile`), a job submitted, the time from the calibration run's
plan to the first run plan (JobState.calibration_started/ended, which the leader records), and
from there to the job's first trained step.

Jobs, in one fleet, one after the other:
- gpt        examples/train_gpt.py --preset tiny
- gpt again  the same script and arguments: the stored calibration is reused (no run)
- gpt lr     the same script with another --lr: the arguments are part of the calibration's key,
             so it is measured again
- hf         examples/train_hf.py (GPT-2 from a small config, random weights; needs transformers)

Run:  python benchmarks/calibration.py
The last line is  `bench calibration: gpt_s=<s> reused_s=<s or 0> other_args_s=<s> hf_s=<s or nan>`.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from support.etcd_server import EtcdServer  # noqa: E402
from support.ring import Ring  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _run(ring: Ring, name: str, script: str, args: list[str]) -> dict:
    r = ring.varunactl("submit", "--name", name, "--batch-size", "8", "--steps", "3", "--checkpoint-every", "3",
                       str(REPO / script), "--", *args)
    if r.returncode != 0:
        raise SystemExit(f"submit {name}: {r.stderr}")
    st = ring.wait_state(name, ("done", "failed"), timeout=600)
    state = json.loads(ring.call(ring.store.get(ring.keys.state(name))).value)
    a, b = state.get("calibration_started") or 0.0, state.get("calibration_ended") or 0.0
    first = (st.get("epoch_spans") or {}).get(str(state["epochs"][0]), [None])[0] if state.get("epochs") else None
    return {"job": name, "state": st["state"], "calibration_s": b - a if a and b else 0.0,
            "to_first_step_s": (first - state["started_at"]) if first else float("nan")}


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        etcd = EtcdServer()
        etcd.start()
        ring = Ring(Path(tmp) / "ring", etcd.endpoint, ttl=10.0)
        try:
            ring.start("solo", "--slots", "2")
            ring.wait_members(["solo"])
            gpt = ["--preset", "tiny"]
            rows.append(_run(ring, "gpt", "examples/train_gpt.py", gpt))
            rows.append(_run(ring, "gpt-again", "examples/train_gpt.py", gpt))
            rows.append(_run(ring, "gpt-lr", "examples/train_gpt.py", gpt + ["--lr", "1e-3"]))
            if importlib.util.find_spec("transformers") is not None:
                rows.append(_run(ring, "hf", "examples/train_hf.py", []))
        finally:
            ring.close()
            etcd.close()
    print(f"{'JOB':<10} {'STATE':<7} {'CALIBRATION_S':>14} {'PLAN_TO_FIRST_STEP_S':>21}")
    for r in rows:
        print(f"{r['job']:<10} {r['state']:<7} {r['calibration_s']:>14.1f} {r['to_first_step_s']:>21.1f}")
    by = {r["job"]: r["calibration_s"] for r in rows}
    print(f"bench calibration: gpt_s={by['gpt']:.1f} reused_s={by['gpt-again']:.1f} other_args_s={by['gpt-lr']:.1f} "
          f"hf_s={by.get('hf', float('nan')):.1f}")


if __name__ == "__main__":
    main()
