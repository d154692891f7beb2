"""The job the daemon tests submit with varunactl: the tiny GPT of tests/workers/train_check.py
(dropout 0, SGD with momentum), written as a plain Varuna script that reads its steps and batch
from the job (VARUNA_STEPS, VARUNA_BATCH_SIZE), so `tests/support/reference.py` predicts every loss.

--step-sleep slows each step down so that a test can act while the job runs. With
VARUNA_PROFILE set (a calibration run), it writes a synthetic calibration of the model's five
segments there and exits, standing in for the profiler hook.
"""

import argparse
import os
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--chunk-size", type=int, default=4)
p.add_argument("--fail-at", type=int, default=None, help="exit 3 after this step (tests of failures)")
p.add_argument("--stop-at", type=int, default=None, help="leave the loop before this step and exit 0 (a script "
               "that ignores the job's step count)")
p.add_argument("--stop-rank", type=int, default=None, help="--stop-at holds for this rank only: the others train "
               "on (a break on some ranks only, one replica's data running out)")
p.add_argument("--linger-file", default=None, help="once its job is trained and closed, rank 0 writes its PID "
               "here (unless the file exists) and sleeps, so that a test can kill it after the last checkpoint")
p.add_argument("--save-at", type=int, default=None, help="after this many steps the script saves a checkpoint "
               "itself (Varuna.checkpoint into the job's store), as a Varuna script may")
p.add_argument("--script-batch", type=int, default=None, help="pass this global batch to Varuna instead of the job's")
p.add_argument("--dropout", type=float, default=0.0, help="the GPT's dropout (tests/support/reference.py's "
               "keyed_reference_run predicts the losses)")
p.add_argument("--lr", type=float, default=0.1, help="SGD's learning rate (1e30: the loss is NaN from the second "
               "step on, a diverged run)")
p.add_argument("--cheap-allreduce", action="store_true", help="calibrate all-reduces as nearly free: the planner "
               "then runs 4 slots as 2x2 (replicas to recover from) instead of 4x1")
p.add_argument("--timed-calibration", action="store_true", help="scale the synthetic calibration's times by how long "
               "a fixed piece of work takes on this slot: a slot held to a share of a core calibrates slower")
args = p.parse_args()

if os.environ.get("VARUNA_PROFILE"):
    from trainer.planning.calibration import Calibration, LinkCost, SegmentCost, SegmentProfile

    # Five equal segments (the tiny GPT has four cut points) whose weights and optimizer state
    # take 300 MB each: a daemon started with --memory 1073741824 cannot hold the whole model,
    # so the planner must pipeline it: 2 slots run 2x1, 3 slots 3x1, 4 slots 4x1 (2x2 with
    # --cheap-allreduce).
    links = {"intra": LinkCost(50e-6, 5e9), "inter": LinkCost(200e-6, 1e9)}
    allreduce = {"intra": LinkCost(50e-6, 1e11), "inter": LinkCost(1e-6, 1e11)} if args.cheap_allreduce else links
    sizes = (1, 2, 3, 4, 6)
    scale = 1.0
    if args.timed_calibration:
        # the faster of two runs of a fixed loop, in tenths of a second: only the kinds' ratio
        # matters, and a fixed "free core" time is no machine's (this loop took 0.25 s on one CI
        # host, 0.09 s on another, where clamping at that reference hid a quarter-core quota);
        # 8M squares are a few periods of the kernel's CPU quota (100 ms) even on a fast core
        runs = []
        for _ in range(2):
            t0 = time.perf_counter()
            sum(i * i for i in range(8_000_000))
            runs.append(time.perf_counter() - t0)
        scale = min(runs) / 0.1
        print(f"timed calibration: scale {scale:.2f}", flush=True)
    costs = tuple(SegmentCost(scale * (1e-3 + 1e-3 * b), scale * (2e-3 + 2e-3 * b), scale * (1e-3 + 1e-3 * b),
                              1000 * b, 1000 * b) for b in sizes)
    Calibration(model="tiny-gpt", device_kind="cpu", micro_batch_sizes=sizes, input_bytes=tuple(100 * b for b in sizes),
                segments=(SegmentProfile(100_000_000, 100_000_000, 0.0, costs),) * 5, links=links,
                allreduce=allreduce).save(os.environ["VARUNA_PROFILE"])
    sys.exit(0)

import torch  # noqa: E402

from trainer import GlobalBatches, Varuna  # noqa: E402
from trainer.data import TextDataset  # noqa: E402
from trainer.models.gpt import GPT, GPTConfig  # noqa: E402
from trainer.worker_env import job_setting  # noqa: E402

steps = job_setting("steps", 5)
batch_size = job_setting("batch_size", 12)
started = time.time()
torch.manual_seed(1234)
cfg = GPTConfig.preset("tiny", dropout=args.dropout)
model = GPT(cfg, seed=0)
data = TextDataset(cfg.seq_len, num_examples=256, seed=0)
varuna = Varuna(model, None, data.sample_batch, args.script_batch or batch_size, args.chunk_size)
opt = torch.optim.SGD(varuna.parameters(), lr=args.lr, momentum=0.9)
before_load = time.time()
varuna.set_optimizer(opt)
loaded = time.time()
print(f"TIMING start={started:.6f} before_load={before_load:.6f} loaded={loaded:.6f} "
      f"resumed_at={varuna.iteration}", flush=True)
batches = GlobalBatches(len(data), batch_size, seed=0)
stop_here = args.stop_at is not None and args.stop_rank in (None, varuna.rank)
while varuna.iteration < (min(steps, args.stop_at) if stop_here else steps):
    idx = batches.shard(varuna.iteration, varuna.replica, varuna.data_depth)
    loss, _ = varuna.step(data.batch(idx))
    if varuna.rank == 0:
        print(f"step {varuna.iteration - 1} loss {loss:.6f} t={time.time():.6f}", flush=True)
    if args.save_at is not None and varuna.iteration == args.save_at:
        varuna.checkpoint(varuna.assignment.store)
    if args.fail_at is not None and varuna.iteration > args.fail_at and varuna.rank == 0:
        print("failing on purpose", file=sys.stderr, flush=True)
        sys.exit(3)
    if args.step_sleep:
        time.sleep(args.step_sleep)
varuna.close()
if args.linger_file and varuna.rank == 0 and not os.path.exists(args.linger_file):
    with open(args.linger_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(args.linger_file + ".tmp", args.linger_file)
    time.sleep(120)
