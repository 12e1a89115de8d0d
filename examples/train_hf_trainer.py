"""trainmon with a Hugging Face ``Trainer``: a tiny Llama built from a config (no downloaded
weights) learns the bytes of the Python standard library's own source, on CPU.

    python examples/train_hf_trainer.py --steps 60

The trainmon integration is one import and ``callbacks=[TrainmonCallback()]``; everything else
is an ordinary Trainer script. ``--inject-nan-at N`` makes the model return a NaN loss at step
N while its gradients stay finite. The Trainer's ``logging_nan_inf_filter`` hides it from its
own logs; trainmon still counts it (``trainmon_train_nonfinite_values_total{field="loss"}``).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from trainmon_client.hf import TrainmonCallback  # trainmon (1/2)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_char_transformer import framework_parser, load_corpus, trainmon_summary


class ByteBlocks(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Consecutive ``seq_len``-byte blocks of the corpus, as causal-LM examples."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return len(self.data) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.data[i * self.seq_len : (i + 1) * self.seq_len]
        return {"input_ids": x, "labels": x}


class InjectNaN(TrainerCallback):  # type: ignore[misc]
    """Make the model's loss NaN for one step, with finite gradients (a value-only NaN)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.handle: Any = None

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any):
        if state.global_step + 1 == self.step and model is not None:
            self.handle = model.register_forward_hook(self._nan, prepend=True)

    def _nan(self, module: Any, inputs: Any, output: Any) -> Any:
        loss = output["loss"]
        output["loss"] = loss + (math.nan - loss).detach()  # value NaN, gradient of loss
        self.handle.remove()
        return output


def build(args: argparse.Namespace, callbacks: list[Any]) -> Trainer:
    """The model, data and Trainer; ``callbacks`` includes trainmon's or not."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.dim,
        intermediate_size=4 * args.dim,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq_len,
    )
    model = LlamaForCausalLM(config)
    data = load_corpus(args.corpus_bytes)
    split = int(len(data) * 0.95)
    training = TrainingArguments(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="trainmon-hf-"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.steps // 10),
        logging_steps=args.logging_steps,
        eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps or None,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    if args.inject_nan_at:
        callbacks = [*callbacks, InjectNaN(args.inject_nan_at)]
    return Trainer(
        model=model,
        args=training,
        train_dataset=ByteBlocks(data[:split], args.seq_len),
        eval_dataset=torch.utils.data.Subset(ByteBlocks(data[split:], args.seq_len), range(16)),
        callbacks=callbacks,
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = framework_parser(__doc__)
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--eval-steps", type=int, default=20, help="0: no evaluation")
    p.add_argument("--save-steps", type=int, default=0, help="0: no checkpoints")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Trainer:
    args = parse(argv)
    callbacks = [] if args.no_trainmon else [TrainmonCallback(args.run)]  # trainmon (2/2)
    trainer = build(args, callbacks)
    trainer.train()
    if trainer.is_world_process_zero():
        print(
            trainmon_summary(callbacks[0].run if callbacks else None, args.status_url), flush=True
        )
    return trainer


if __name__ == "__main__":
    main()
