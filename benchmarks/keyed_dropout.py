"""A training step with keyed random ops vs the same step with torch's own dropout.

The engine runs the captured graph, whose random ops draw from the counter-based generator
(trainer.graph.keyed_rng) keyed by (seed, step, example, op). Contenders, on the same captured
graph of the same model, differing only in that:

- torch   the capture with its random ops left as torch emitted them (torch's generator)
- keyed   the capture as the engine runs it

Models: Hugging Face GPT-2 (dropout 0.1 on embeddings, residuals and attention weights; the
keyed attention-weight dropout runs attention as plain matmul + softmax, where torch's SDPA
drops inside its kernel) and the project's GPT (trainer.models.gpt, nn.Dropout 0.1 after the
embeddings and each residual branch, none on attention weights). A step is forward + backward of
`--micro` micro-batches and an SGD step, without recompute and with it (each micro-batch's
forward run once without a graph, then again with one before its backward, as the executor's
recompute does).

Timing: contenders alternate, `--iters` timed steps each after `--warmup`, median per step. On a
CPU the time is the process's CPU time with one torch thread (it hardly moves with other load on
a shared machine); on CUDA it is wall time after a synchronize.

Run:  python benchmarks/keyed_dropout.py [--device cuda] [--quick]
The last line is `bench keyed_dropout: ratio=<worst keyed / torch over the rows> device=<device>`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from trainer.graph import capture as capture_module  # noqa: E402
from trainer.graph.keyed_rng import keyed_randomness  # noqa: E402
from trainer.models.hf import CausalLM  # noqa: E402

__all__ = ["main"]


def _models(quick: bool):
    import transformers as tf

    from trainer.models.gpt import GPT, GPTConfig
    tf.logging.set_verbosity_error()
    width, layers, seq = (128, 2, 64) if quick else (256, 4, 128)
    vocab = 1024
    gpt2 = CausalLM(tf.GPT2LMHeadModel(tf.GPT2Config(
        n_embd=width, n_layer=layers, n_head=4, vocab_size=vocab, n_positions=seq, resid_pdrop=0.1,
        embd_pdrop=0.1, attn_pdrop=0.1, use_cache=False)))
    ours = GPT(GPTConfig(vocab_size=vocab, seq_len=seq, n_embd=width, n_layer=layers, n_head=4, dropout=0.1))
    batch = {"input_ids": torch.randint(0, vocab, (8, seq))}
    ours_batch = {"input_ids": batch["input_ids"], "targets": torch.roll(batch["input_ids"], -1, 1)}
    return [("hf-gpt2", gpt2, batch), ("gpt", ours, ours_batch)]


def _capture(model: nn.Module, sample, keyed: bool):
    if keyed:
        return capture_module.capture_model(model, sample).graph_module
    original = capture_module.key_random_ops
    capture_module.key_random_ops = lambda gm: {}
    try:
        return capture_module.capture_model(model, sample).graph_module
    finally:
        capture_module.key_random_ops = original


def _step(gm, opt, micro, recompute: bool, step: int) -> None:
    opt.zero_grad(set_to_none=True)
    for i, batch in enumerate(micro):
        with keyed_randomness(0, step, i * 8):
            if recompute:
                rng = torch.get_rng_state()
                with torch.no_grad():
                    gm(**batch)
                torch.set_rng_state(rng)
            loss = gm(**batch) / len(micro)
        loss.backward()
    opt.step()


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return time.process_time()


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    if args.quick:
        args.iters, args.warmup = 4, 1
    rows, worst = [], 0.0
    for name, model, batch in _models(args.quick):
        model.to(device).train()
        sample = {k: v[:2].to(device) for k, v in batch.items()}
        # both graphs train the model's own parameters: only their random ops differ
        graphs = {kind: _capture(model, sample, kind == "keyed") for kind in ("torch", "keyed")}
        opts = {kind: torch.optim.SGD(gm.parameters(), lr=1e-4) for kind, gm in graphs.items()}
        micro = [{k: v.to(device) for k, v in batch.items()} for _ in range(args.micro)]
        for recompute in (False, True):
            times: dict[str, list[float]] = {"torch": [], "keyed": []}
            for it in range(args.warmup + args.iters):
                for kind in (("torch", "keyed") if it % 2 else ("keyed", "torch")):
                    start = _clock(device)
                    _step(graphs[kind], opts[kind], micro, recompute, it)
                    if it >= args.warmup:
                        times[kind].append(_clock(device) - start)
            t, k = statistics.median(times["torch"]), statistics.median(times["keyed"])
            worst = max(worst, k / t)
            rows.append((name, "on" if recompute else "off", t * 1e3, k * 1e3, k / t))
    print(f"{'model':<8} {'recompute':>9} {'torch ms':>9} {'keyed ms':>9} {'ratio':>6}")
    for name, rc, t, k, r in rows:
        print(f"{name:<8} {rc:>9} {t:>9.1f} {k:>9.1f} {r:>6.3f}")
    print(f"bench keyed_dropout: ratio={worst:.3f} device={device.type}")
    return worst


if __name__ == "__main__":
    main()
