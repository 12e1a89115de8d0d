"""A DeepSpeed training script (one CPU process, ZeRO stage 0); trainmon from ``trainmon-run``.

    DS_ACCELERATOR=cpu trainmon-run -- python examples/train_deepspeed.py --steps 20

DeepSpeed has no plug-in API for metric backends; ``trainmon-run`` reports it through its
hooks and the engine's own (``engine.backward``, ``engine.step``, ``save_checkpoint``): every
optimizer step with its loss, lr and gradient norm, and the checkpoint. Gradient accumulation
and ``gradient_clipping`` are on. ``--losses FILE`` writes each step's mean loss as computed
(JSON lines), for the tests. The process group is gloo on 127.0.0.1 when no launcher set one.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1")):
    os.environ.setdefault(key, value)
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("MASTER_PORT", "29561")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--save-dir", default=None, help="save_checkpoint here at the end")
    p.add_argument("--losses", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0},
    }
    deepspeed.init_distributed(dist_backend="gloo")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    out = open(args.losses, "w") if args.losses else None  # noqa: SIM115
    g = torch.Generator().manual_seed(1)
    total = 0.0
    for micro in range(args.steps * args.accum):
        x = torch.randn(8, 8, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), x.sum(1, keepdim=True).tanh())
        engine.backward(loss)
        engine.step()
        total += loss.item() / args.accum
        if (micro + 1) % args.accum == 0:
            if out is not None:
                out.write(json.dumps({"step": engine.global_steps, "loss": total}) + "\n")
            total = 0.0
    if args.save_dir:
        engine.save_checkpoint(args.save_dir, tag="last")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
