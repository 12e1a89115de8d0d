"""A Ray Train script (``TorchTrainer``, CPU workers); trainmon from its callback or trainmon-run.

    python examples/train_ray.py --workers 2 --trainmon-callback    # RunConfig(callbacks=[...])
    trainmon-run -- python examples/train_ray.py --workers 2         # no change to the code

Each worker trains a small MLP under DDP (gloo), reports ``step``, ``loss`` and ``lr`` with
``ray.train.report`` every step, and a checkpoint every ``--checkpoint-every`` steps.
``--losses DIR`` has each worker write its losses to ``DIR/rank-N.jsonl``, for the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import ray
import torch
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


def loop(config: dict[str, Any]) -> None:
    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(
        torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    out = None
    if config["losses"]:
        out = open(Path(config["losses"]) / f"rank-{rank}.jsonl", "w")  # noqa: SIM115
    for step in range(1, config["steps"] + 1):
        x = torch.randn(16, 8, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).tanh())
        opt.zero_grad()
        loss.backward()
        opt.step()
        metrics = {"step": step, "loss": loss.item(), "lr": opt.param_groups[0]["lr"]}
        if out is not None:
            out.write(json.dumps(metrics) + "\n")
            out.flush()
        every = config["checkpoint_every"]
        if every and step % every == 0:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    torch.save(model.state_dict(), os.path.join(d, "model.pt"))
                ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d))
        else:
            ray.train.report(metrics)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--storage", default=None, help="RunConfig storage_path")
    p.add_argument("--losses", default=None)
    p.add_argument("--trainmon-callback", action="store_true")
    args = p.parse_args(argv)
    callbacks = []
    if args.trainmon_callback:
        from trainmon_client.ray import TrainmonCallback

        callbacks.append(TrainmonCallback())
    ray.init(num_cpus=args.workers, include_dashboard=False)
    trainer = TorchTrainer(
        loop,
        train_loop_config={
            "steps": args.steps,
            "checkpoint_every": args.checkpoint_every,
            "losses": args.losses,
        },
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
        run_config=RunConfig(
            name="ray-example",
            storage_path=args.storage or tempfile.mkdtemp(prefix="ray-example-"),
            callbacks=callbacks,
        ),
    )
    trainer.fit()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
