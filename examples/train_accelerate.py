"""An Accelerate training script; trainmon comes from ``trainmon-run`` or from its tracker.

    trainmon-run -- python examples/train_accelerate.py --steps 100     # no change to the code
    python examples/train_accelerate.py --steps 100 --trainmon-tracker  # log_with=TrainmonTracker()

``accelerator.backward``, gradient accumulation (``accelerator.accumulate``),
``accelerator.clip_grad_norm_``, a prepared ``DataLoader`` and ``save_state`` checkpoints: the
usual Accelerate loop, on a small MLP on CPU. It logs ``loss`` and ``lr`` with
``accelerator.log`` (which reaches only the trackers given to ``log_with``). ``--losses
FILE`` writes each step's loss as computed (JSON lines), for the tests.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset


class Slow(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, delay: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(2048, 16, generator=g)
        self.y = torch.tanh(self.x.sum(1, keepdim=True))
        self.delay = delay

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay)
        return self.x[i], self.y[i]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--data-delay", type=float, default=0.0)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--output-dir", default="/tmp/accelerate-example")
    p.add_argument("--losses", default=None)
    p.add_argument("--trainmon-tracker", action="store_true", help="log_with=TrainmonTracker()")
    args = p.parse_args(argv)
    log_with = None
    if args.trainmon_tracker:
        from trainmon_client.accelerate import TrainmonTracker

        log_with = [TrainmonTracker()]
    accelerator = Accelerator(gradient_accumulation_steps=args.accum, log_with=log_with)
    accelerator.init_trackers("accelerate-example")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(Slow(args.data_delay), batch_size=8, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    out = open(args.losses, "w") if args.losses else None  # noqa: SIM115
    step, step_loss, batches = 0, 0.0, iter(loader)
    while step < args.steps:
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            continue
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            step_loss += loss.item() / args.accum
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            accelerator.log({"loss": step_loss, "lr": opt.param_groups[0]["lr"]}, step=step)
            if out is not None:
                out.write(json.dumps({"step": step, "loss": step_loss}) + "\n")
            step_loss = 0.0
            if args.save_every and step % args.save_every == 0:
                accelerator.save_state(f"{args.output_dir}/step-{step}")
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
