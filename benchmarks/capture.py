"""Graph capture: what torch.export costs once, and what the exported stages cost per step.

Model: Hugging Face GPT2LMHeadModel from GPT2Config() (GPT-2 small: 12 layers, 768 wide,
vocabulary 50257, ~124M parameters; random init, nothing downloaded), wrapped so that
forward(input_ids, labels) returns the loss, dropout 0. `--quick`: 4 layers, 256 wide, a
vocabulary of 8192.

Measured in one process, one after another:
- capture   trainer.graph.capture.capture_model (torch.export, non-strict, dynamic batch) on a
            sample batch, and the split of the captured graph into P=4 stages (slice_stages
            at the block boundaries balance would pick for equal blocks)
- step      forward + backward of one micro-batch (`--micro` sequences of `--seq` tokens):
            eager = the user's model called as is (the peer);
            exported/P1 = the one-stage module (the whole captured graph);
            exported/P4 = the four stage modules chained, each stage's backward given the
            next one's input gradient, as the executor runs them (times added)
  Contenders alternate (eager, P1, P4, eager, ...) for `--iters` rounds after `--warmup`;
  the median per contender is reported, with CPU time (process_time, all threads) next to
  wall time since CPU time moves less with other load on a shared machine.

Run:  python benchmarks/capture.py [--quick] [--iters N] [--micro B] [--seq T]
The last line is  `bench capture: capture_s=<export> split_s=<split into 4> step_ratio_p1=<exported
P1 / eager> step_ratio_p4=<exported P4 / eager> params_m=<millions>` (ratios of CPU time;
below 1 means the exported stages are cheaper than eager).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn

from trainer.graph.capture import capture_model
from trainer.graph.partition import ACTIVATION, slice_stages


class LossOf(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, labels=labels).loss


def build(quick: bool) -> nn.Module:
    try:
        import transformers
    except ImportError:
        sys.exit("benchmarks/capture.py needs transformers: pip install -e .[test]")
    transformers.logging.set_verbosity_error()
    kw = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    if quick:
        kw.update(n_layer=4, n_embd=256, n_head=4, vocab_size=8192)
    torch.manual_seed(0)
    return LossOf(transformers.GPT2LMHeadModel(transformers.GPT2Config(**kw)))


def timed(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    ns = p.parse_args()
    iters = ns.iters or (5 if ns.quick else 7)
    model = build(ns.quick)
    params_m = sum(t.numel() for t in model.parameters()) / 1e6
    vocab = model.lm.config.vocab_size
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, vocab, (ns.micro, ns.seq), generator=g)}
    batch["labels"] = batch["input_ids"]

    capture_wall, capture_cpu = timed(lambda: setattr(ns, "traced", capture_model(model, batch)))
    traced = ns.traced
    n_blocks = len(traced.markers) + 1
    per = n_blocks / 4
    cuts = sorted({round(per * k) - 1 for k in (1, 2, 3)})
    split_wall, split_cpu = timed(lambda: setattr(ns, "p4", slice_stages(traced, cuts)))
    p1, p4 = slice_stages(traced, []), ns.p4

    def eager():
        model(**batch).backward()

    def exported_p1():
        p1[0].module(**{k: batch[k] for k in p1[0].input_names}).backward()

    def exported_p4():
        outs, ins, x = [], [], None
        for sl in p4:
            kw = {k: batch[k] for k in sl.input_names}
            if sl.takes_activation:
                x = x.detach().requires_grad_(True)
                kw[ACTIVATION] = x
            ins.append(x)
            x = sl.module(**kw)
            outs.append(x)
        grad = None
        for k in reversed(range(len(p4))):
            outs[k].backward(grad) if grad is not None else outs[k].backward()
            grad = ins[k].grad if ins[k] is not None else None

    contenders = {"eager": eager, "exported/P1": exported_p1, "exported/P4": exported_p4}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in contenders}
    for i in range(ns.warmup + iters):
        for name, fn in contenders.items():
            model.zero_grad(set_to_none=True)
            t = timed(fn)
            if i >= ns.warmup:
                times[name].append(t)
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}

    print(f"GPT2LMHeadModel, {params_m:.1f}M parameters, {n_blocks} blocks; micro-batch {ns.micro} x {ns.seq} "
          f"tokens; {torch.get_num_threads()} threads; {iters} timed rounds")
    print(f"{'what':<28}{'wall s':>10}{'cpu s':>10}{'cpu / eager':>14}")
    print(f"{'capture (torch.export)':<28}{capture_wall:>10.3f}{capture_cpu:>10.3f}{capture_cpu / med['eager'][1]:>13.1f}x")
    print(f"{'split into 4 stages':<28}{split_wall:>10.3f}{split_cpu:>10.3f}{split_cpu / med['eager'][1]:>13.2f}x")
    for name, (w, c) in med.items():
        print(f"{'step ' + name:<28}{w:>10.3f}{c:>10.3f}{c / med['eager'][1]:>14.3f}")
    print(f"bench capture: capture_s={capture_wall:.2f} split_s={split_wall:.3f} "
          f"step_ratio_p1={med['exported/P1'][1] / med['eager'][1]:.3f} "
          f"step_ratio_p4={med['exported/P4'][1] / med['eager'][1]:.3f} params_m={params_m:.0f}")


if __name__ == "__main__":
    main()
