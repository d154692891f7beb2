"""Train a small CNN on synthetic images with Varuna.

    python -m trainer.launch --stages 3 --replicas 1 examples/train_cnn.py --steps 40

The CNN declares no CutPoint: its body is an nn.Sequential and Varuna cuts between the
Sequential's blocks. Otherwise this is the same loop as examples/train_gpt.py.
"""

from __future__ import annotations

import argparse

import torch

from trainer import GlobalBatches, Varuna
from trainer.data import ImageDataset
from trainer.models.cnn import CNN, PRESETS, CNNConfig
from trainer.worker_env import job_setting


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="tiny: 1x16x16 images, cifar: 3x32x32 (default tiny)")
    p.add_argument("--steps", type=int, default=job_setting("steps", 40), help="optimizer steps to train to")
    p.add_argument("--batch-size", type=int, default=job_setting("batch_size", 64),
                   help="global batch (images per step, all replicas)")
    p.add_argument("--chunk-size", type=int, default=8, help="micro-batch size")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0, help="fixes the weights and the data")
    p.add_argument("--examples", type=int, default=4096, help="images in the synthetic dataset")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    cfg = CNNConfig.preset(args.preset)
    ds = ImageDataset(args.examples, channels=cfg.in_channels, image_size=cfg.image_size,
                      num_classes=cfg.num_classes, seed=args.seed)
    model = CNN(cfg, seed=args.seed)

    def get_batch_fn(size, device):
        return ds.sample_batch(size, device)

    varuna = Varuna(model, None, get_batch_fn, batch_size=args.batch_size, chunk_size=args.chunk_size)
    opt = torch.optim.AdamW(varuna.parameters(), lr=args.lr)
    varuna.set_optimizer(opt)

    batches = GlobalBatches(len(ds), args.batch_size, args.seed)
    while varuna.iteration < args.steps:
        step = varuna.iteration   # the step's index: what status, plots and the loss history call it
        idx = batches.shard(step, varuna.replica, varuna.data_depth)
        loss, overflow = varuna.step(ds.batch(idx))
        if varuna.rank == 0:
            print(f"step {step} loss {loss:.4f}", flush=True)
    varuna.close()


if __name__ == "__main__":
    main()
