"""Plan GPT-2 8.3B on V100 fleets like the Varuna paper's, from public figures only.

    python benchmarks/paper_scale.py

The calibration is derived, not measured. Sources and assumptions:

* Model (Megatron-LM's GPT-2 8.3B, Shoeybi et al. 2019, table 1): 72 layers, hidden h=3072,
  32 heads, sequence s=1024, vocabulary 50257 (padded 51200 in Megatron; we keep 50257).
  Parameters per layer 12h^2 + 13h = 113.3 M; embedding 50257 x 3072 = 154 M (+ 3 M positions);
  72 layers + embedding = 8.3 B. The LM head reuses the embedding; a pipeline keeps a copy on
  the last stage, so the last segment carries 154 M parameters too.
* Compute: training FLOPs per token ~ 6 x parameters (Kaplan et al. 2020): forward 2N, backward
  4N, plus attention's 4 s h per layer and token forward. Per layer and token forward:
  24 h^2 + 4 s h = 239 MFLOP; the LM head 2 h V = 309 MFLOP. Recompute = forward.
* Device: V100 16 GB (Azure NC24s_v3-class: 4 GPUs per VM, PCIe), 125 TFLOP/s fp16 tensor
  peak; training reaches 30-40 % of it (Megatron-LM reports 15.1 PFLOP/s on 512 V100s, i.e.
  ~30 %); we take 35 %. Assumption (ours, not a published figure): small micro-batches use the
  GPU less, efficiency x b/(b + 0.25) for micro-batch size b.
* Memory (mixed precision with Adam, Rajbhandari et al. 2020, ZeRO section 3.1): 2 bytes fp16
  weights + 2 bytes fp16 gradients + 12 bytes fp32 master weights and Adam moments = 16 bytes per
  parameter. Activations kept by autograd per layer and sample, s h (34 + 5 a s / h) bytes
  (Korthikanti et al. 2022, no tensor parallelism) = 275 MB; the boundary tensor s h 2 bytes.
* Network: ~10 Gbps between VMs (the paper's commodity VMs), 50 us latency; inside a VM PCIe
  at ~10 GB/s. All-reduce with NCCL's ring over the same links.
* Optimizer step: memory-bound Adam, ~36 bytes moved per parameter at ~450 GB/s effective.

The paper (Athlur et al., EuroSys 2022) trains the 8.3B model on 108 GPUs as 18 x 6 (P x D)
with a global batch of 8192. 8192 is not a multiple of 6, so our planner (which keeps every
micro-batch whole) cannot pick D=6; we show 18 x 6 simulated with per-replica batch
ceil(8192/6) = 1366 (a global batch of 8196) beside the plan.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.planning.calibration import Calibration, LinkCost, SegmentCost, SegmentProfile  # noqa: E402
from trainer.planning.planner import Slot, plan  # noqa: E402
from trainer.planning.schedule import build_table  # noqa: E402
from trainer.planning.simulator import simulate, stage_costs  # noqa: E402

GiB = 2**30
LAYERS, H, HEADS, SEQ, VOCAB = 72, 3072, 32, 1024, 50257
PEAK_FLOPS, EFFICIENCY = 125e12, 0.35
GPU_MEMORY = 16 * GiB
GPUS_PER_VM = 4
SIZES = (1, 2, 4, 8)
LINKS = {"intra": LinkCost(10e-6, 10e9), "inter": LinkCost(50e-6, 10e9 / 8)}
GLOBAL_BATCH = 8192


def _flops_rate(b: int) -> float:
    return PEAK_FLOPS * EFFICIENCY * b / (b + 0.25)


def gpt2_8b_calibration() -> Calibration:
    layer_params = 12 * H * H + 13 * H
    embed_params = VOCAB * H + SEQ * H
    layer_fwd = (24 * H * H + 4 * SEQ * H) * SEQ  # per sample
    head_fwd = 2 * H * VOCAB * SEQ
    act_keep = SEQ * H * (34 + 5 * HEADS * SEQ / H)
    boundary = SEQ * H * 2
    segments = []
    for k in range(LAYERS):
        params = layer_params + (embed_params if k in (0, LAYERS - 1) else 0)
        fwd = layer_fwd + (head_fwd if k == LAYERS - 1 else 0)
        costs = tuple(
            SegmentCost(
                forward_s=fwd * b / _flops_rate(b),
                backward_s=2 * fwd * b / _flops_rate(b),
                recompute_s=fwd * b / _flops_rate(b),
                activation_bytes=boundary * b,
                peak_activation_bytes=int(act_keep * b + (4 * SEQ * VOCAB * b if k == LAYERS - 1 else 0)),
            )
            for b in SIZES
        )
        segments.append(SegmentProfile(2 * params, 12 * params, params * 36 / 450e9, costs))
    return Calibration(
        model="gpt2-8.3b(derived)", device_kind="v100-16g", micro_batch_sizes=SIZES,
        input_bytes=tuple(8 * SEQ * b for b in SIZES), segments=tuple(segments), links=LINKS, allreduce=LINKS,
    )


def fleet(gpus: int) -> list[Slot]:
    return [Slot(f"vm{i // GPUS_PER_VM:03d}/gpu{i % GPUS_PER_VM}", f"vm{i // GPUS_PER_VM:03d}", "v100-16g",
                 GPU_MEMORY) for i in range(gpus)]


def fixed_config(cal: Calibration, P: int, D: int, mbs: int, per_replica: int) -> tuple[float, int]:
    """Simulate P x D with balanced layers and neighbour stages packed 4 to a VM."""
    m = math.ceil(per_replica / mbs)
    bounds = [round(i * LAYERS / P) for i in range(P + 1)]
    links = ["intra" if (s + 1) % GPUS_PER_VM else "inter" for s in range(P - 1)]
    costs = stage_costs([cal] * P, bounds, mbs, D, links, ["inter"] * P)
    result = simulate(build_table("varuna", P, m, True), costs)
    return result.minibatch_s, max(result.peak_bytes)


def main() -> None:
    cal = gpt2_8b_calibration()
    per_sample = sum(s.costs[0].forward_s + s.costs[0].backward_s for s in cal.segments)
    params = sum(s.param_bytes for s in cal.segments) / 2
    print(f"GPT-2 8.3B (derived): {params / 1e9:.2f} B parameters incl. the LM head copy; forward+backward "
          f"{per_sample:.2f} s per sample on one V100 at micro-batch 1; "
          f"{cal.segments[1].static_bytes / GiB:.2f} GiB static per layer")
    for gpus in (108, 300):
        t0 = time.perf_counter()
        p = plan(fleet(gpus), GLOBAL_BATCH, [cal])
        took = time.perf_counter() - t0
        print(f"\n=== {gpus} GPUs ({gpus // GPUS_PER_VM} VMs x {GPUS_PER_VM}), global batch {GLOBAL_BATCH}; "
              f"planned in {took * 1000:.0f} ms ===")
        print(p.explain())
        ideal = 8 * params * GLOBAL_BATCH * SEQ / (gpus * PEAK_FLOPS * EFFICIENCY)
        print(f"lower bound from FLOPs alone (8N per token with recompute, all {gpus} GPUs busy): {ideal:.1f} s")
        if gpus == 108:
            print("paper's configuration 18 x 6 (global batch 8192 -> 1366 per replica):")
            for mbs in SIZES:
                t, peak = fixed_config(cal, 18, 6, mbs, math.ceil(GLOBAL_BATCH / 6))
                fits = "fits" if peak <= GPU_MEMORY * 0.9 else "does NOT fit"
                print(f"  micro-batch {mbs}: simulated {t:7.1f} s, peak {peak / GiB:5.1f} GiB ({fits})")


if __name__ == "__main__":
    main()
