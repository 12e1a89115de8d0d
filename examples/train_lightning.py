"""trainmon with Lightning: the byte-level transformer of train_char_transformer.py as a
``LightningModule``, learning the Python standard library's own source, on CPU.

    python examples/train_lightning.py --steps 60

The trainmon integration is one import and ``callbacks=[TrainmonCallback(...)]``; everything
else is an ordinary Lightning script. ``--inject-nan-at N`` returns a NaN loss at step N with
finite gradients; trainmon counts it (``trainmon_train_nonfinite_values_total``).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning
import torch
import torch.nn.functional as F

from trainmon_client.lightning import TrainmonCallback  # trainmon (1/2)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_char_transformer import (
    ByteTransformer,
    framework_parser,
    load_corpus,
    trainmon_summary,
)


class Windows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """(input, next-byte target) windows of ``seq_len`` bytes, every ``seq_len`` bytes."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = i * self.seq_len
        return self.data[s : s + self.seq_len], self.data[s + 1 : s + self.seq_len + 1]


class ByteLM(lightning.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.model = ByteTransformer(args.dim, args.layers, args.heads, args.seq_len)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x).view(-1, 256), y.view(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        if self.args.inject_nan_at and self.global_step + 1 == self.args.inject_nan_at:
            loss = loss + (math.nan - loss).detach()  # value NaN, gradient of the loss
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def build(args: argparse.Namespace, callbacks: list[Any]) -> tuple[lightning.Trainer, Any]:
    """The Trainer, module and data loaders; ``callbacks`` includes trainmon's or not."""
    lightning.seed_everything(0, verbose=False)
    data = load_corpus(args.corpus_bytes)
    split = int(len(data) * 0.95)
    train = torch.utils.data.DataLoader(
        Windows(data[:split], args.seq_len), batch_size=args.batch_size, shuffle=True
    )
    val = torch.utils.data.DataLoader(
        torch.utils.data.Subset(Windows(data[split:], args.seq_len), range(16)),
        batch_size=args.batch_size,
    )
    if args.checkpoint_every:
        callbacks = [
            *callbacks,
            lightning.pytorch.callbacks.ModelCheckpoint(
                dirpath=args.output_dir, every_n_train_steps=args.checkpoint_every, save_top_k=-1
            ),
        ]
    trainer = lightning.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        accumulate_grad_batches=args.grad_accum,
        gradient_clip_val=1.0,
        val_check_interval=args.eval_every or None,
        limit_val_batches=1.0 if args.eval_every else 0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        enable_checkpointing=bool(args.checkpoint_every),
        default_root_dir=args.output_dir,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    return trainer, (ByteLM(args), train, val)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = framework_parser(__doc__)
    p.add_argument("--devices", type=int, default=1, help="CPU processes (DDP over gloo)")
    p.add_argument("--eval-every", type=int, default=20, help="0: no validation")
    p.add_argument("--checkpoint-every", type=int, default=0, help="0: no checkpoints")
    args = p.parse_args(argv)
    args.output_dir = args.output_dir or tempfile.mkdtemp(prefix="trainmon-lightning-")
    return args


def main(argv: list[str] | None = None) -> lightning.Trainer:
    args = parse(argv)
    callbacks: list[Any] = []
    if not args.no_trainmon:
        n = sum(p.numel() for p in ByteLM(args).parameters())
        callbacks.append(  # trainmon (2/2)
            TrainmonCallback(args.run, count_tokens=lambda b: b[0].numel(), num_params=n)
        )
    trainer, (module, train, val) = build(args, callbacks)
    trainer.fit(module, train, val if args.eval_every else None)
    if trainer.global_rank == 0:
        print(
            trainmon_summary(callbacks[0].run if callbacks else None, args.status_url), flush=True
        )
    return trainer


if __name__ == "__main__":
    main()
