"""A Lightning fit with a slow dataset, checkpoints and validation, that measures itself.

    python tests/helpers/lightning_trainer.py --socket S --run R --truth FILE --steps 40

The dataset sleeps ``--item`` seconds per item (in the main process: no workers), so every
batch waits ``--batch`` times that; ``ModelCheckpoint`` saves every ``--save-every`` steps
(the checkpoint I/O sleeps ``--save`` seconds on top of the write); validation runs every
``--eval-every`` steps over ``--eval-batches`` batches. The trainer reports through
``TrainmonCallback``. What it measures itself, independently of the callback, goes to
``--truth`` (one JSON object a line, ``time.monotonic()``): ``init`` (at ``setup``), each
training batch's ``fetch`` (the dataset's time) and ``batch`` (``on_train_batch_start`` to
``on_train_batch_end``), each ``save`` (the checkpoint I/O's), each ``eval`` (validation
start to end), ``finish`` (at ``on_train_end``).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import lightning
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from trainmon_client.lightning import TrainmonCallback


class SlowItems(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Items that each take ``delay`` seconds to load; the time spent is added to ``spent``."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay, self.spent = n, delay, 0.0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.monotonic()
        time.sleep(self.delay)
        x = torch.full((16,), float(i % 7))
        self.spent += time.monotonic() - t0
        return x, x.sum(0, keepdim=True)


class Tiny(lightning.LightningModule):
    def __init__(self, compute: float) -> None:
        super().__init__()
        self.net = torch.nn.Linear(16, 1)
        self.compute = compute

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        time.sleep(self.compute)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


class Truth(Callback):  # type: ignore[misc]
    """Measures the fit from its own hooks and from the dataset and the checkpoint I/O."""

    def __init__(self, path: str, train: SlowItems, save: float) -> None:
        self.out = open(path, "a", buffering=1)  # noqa: SIM115 (closed at the end)
        self.train, self.save = train, save
        self.t_batch = 0.0
        self.t_eval = 0.0
        self.seen = 0.0

    def note(self, event: str, **fields: Any) -> None:
        self.out.write(json.dumps({"ev": event, "t": time.monotonic(), **fields}) + "\n")

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.note("init")  # with the callback's init() (the callback before this one)
        io = trainer.strategy.checkpoint_io
        write = io.save_checkpoint

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic()
            time.sleep(self.save)  # a checkpoint that takes its time to write
            out = write(*args, **kwargs)
            self.note("save", seconds=time.monotonic() - t0)
            return out

        io.save_checkpoint = timed

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        self.note("fetch", seconds=self.train.spent - self.seen, step=trainer.global_step + 1)
        self.seen = self.train.spent
        self.t_batch = time.monotonic()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.note("batch", seconds=time.monotonic() - self.t_batch, step=trainer.global_step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.note("finish")  # with the callback's finish() (the callback before this one)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.t_eval = time.monotonic()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.note("eval", seconds=time.monotonic() - self.t_eval)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--truth", required=True)
    ap.add_argument("--dir", required=True, help="where checkpoints go")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--item", type=float, default=0.02, help="s to load one item")
    ap.add_argument("--compute", type=float, default=0.05, help="s of each step's work")
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--save", type=float, default=0.2, help="s a checkpoint takes to write")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--eval-batches", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    train = SlowItems(args.steps * args.batch, args.item)
    truth = Truth(args.truth, train, args.save)
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        val_check_interval=args.eval_every,
        limit_val_batches=args.eval_batches,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            TrainmonCallback(run=args.run, socket_path=args.socket, flush_interval=0.0),
            ModelCheckpoint(dirpath=args.dir, every_n_train_steps=args.save_every, save_top_k=-1),
            truth,
        ],
    )
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch)
    val = torch.utils.data.DataLoader(SlowItems(args.eval_batches * args.batch, args.item / 4))
    trainer.fit(Tiny(args.compute), loader, val)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
