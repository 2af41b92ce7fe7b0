"""Placeholder quick example until the full demo lands: float16 autocast with lossscale.GradScaler."""

from __future__ import annotations

import argparse

import torch

from lossscale import GradScaler


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lossscale demo")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="demo-out")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = GradScaler(init_scale=2.0**20, growth_interval=20)
    x = torch.randn(1024, 32)
    y = x[:, :1] * 2 - x[:, 1:2]
    skipped = 0
    for step in range(args.steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        skipped += int(not bool(scaler.step(opt).stepped))
        scaler.update()
    print(f"final loss {loss.item():.4f}, scale {scaler.get_scale():g}, skipped steps {skipped}")
    return 0
