"""A plain PyTorch training loop that knows nothing of trainmon: run it under ``trainmon-run``.

    trainmon-run -- python examples/train_plain_loop.py --steps 200
    trainmon-run -- torchrun --standalone --nproc-per-node 2 examples/train_plain_loop.py

A small MLP learns a fixed random function of its input: a ``DataLoader`` over a dataset that
takes ``--data-delay`` seconds per sample (a slow input pipeline), gradient accumulation,
``clip_grad_norm_``, an ``AdamW`` optimizer with a learning-rate schedule, a validation pass
under ``torch.no_grad()`` and ``torch.save`` checkpoints that ``--resume`` loads. Under
torchrun it trains with DDP over gloo. Nothing in it imports trainmon.

``--losses FILE`` writes one JSON line per optimizer step with the loss it computed (the sum of
the micro-batches' losses as passed to ``backward()``), so that a test can compare it with what
trainmon reported and with a run without trainmon.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset


class Regression(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``n`` samples of ``y = tanh(x @ w)``, each taking ``delay`` seconds to load."""

    def __init__(self, n: int, dim: int, delay: float, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        w = torch.randn(dim, 1, generator=torch.Generator().manual_seed(1234))
        self.y = torch.tanh(self.x @ w)
        self.delay = delay

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay:
            time.sleep(self.delay)
        return self.x[i], self.y[i]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data-delay", type=float, default=0.0, help="seconds to load one sample")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--eval-every", type=int, default=0, help="validate every N steps (0: off)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (0: off)")
    p.add_argument("--checkpoint-dir", default=None, help="where checkpoints go (last.pt)")
    p.add_argument("--resume", action="store_true", help="continue from checkpoint-dir/last.pt")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--losses", default=None, help="write each step's loss here (JSON lines)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exit-code", type=int, default=0, help="exit with this status at the end")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(args.seed)
    data = Regression(4096, args.dim, args.data_delay, args.seed + rank)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    held_out = DataLoader(Regression(256, args.dim, 0.0, 99), batch_size=64)
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(args.dim, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    step = 0
    ckpt = Path(args.checkpoint_dir) / "last.pt" if args.checkpoint_dir else None
    if args.resume and ckpt is not None and ckpt.exists():
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step = state["step"]
        torch.manual_seed(args.seed + step)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    trained = torch.compile(model) if args.compile else model
    out = open(args.losses, "a") if args.losses else None  # noqa: SIM115
    batches = iter(loader)
    while step < args.steps:
        step_loss = 0.0
        for _ in range(args.accum):
            try:
                x, y = next(batches)
            except StopIteration:
                batches = iter(loader)
                x, y = next(batches)
            loss = torch.nn.functional.mse_loss(trained(x), y) / args.accum
            loss.backward()
            step_loss += loss.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if out is not None:
            line = {"step": step, "loss": step_loss, "grad_norm": grad_norm.item(), "lr": lr}
            out.write(json.dumps(line) + "\n")
            out.flush()
        if args.eval_every and step % args.eval_every == 0:
            with torch.no_grad():
                total = sum(torch.nn.functional.mse_loss(trained(x), y).item() for x, y in held_out)
            if rank == 0:
                print(f"step {step}: validation loss {total / len(held_out):.4f}", flush=True)
        if ckpt is not None and args.checkpoint_every and step % args.checkpoint_every == 0:
            if rank == 0:
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                inner = model.module if world > 1 else model
                torch.save(
                    {
                        "model": inner.state_dict(),
                        "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(),
                        "step": step,
                    },
                    ckpt,
                )
            if world > 1:
                dist.barrier()
    if rank == 0:
        print(f"pid {os.getpid()}: done at step {step}", flush=True)
    if world > 1:
        dist.barrier()  # every rank done before the group goes (gloo tears down cleanly)
        dist.destroy_process_group()
    return args.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
