"""A real training job for trainmon: a small byte-level transformer trained on the Python
standard library's own source code (nothing to download), on CPU.

Single process::

    python examples/train_char_transformer.py --steps 300

Two ranks with DDP over gloo (each rank is a separate series in trainmon)::

    torchrun --standalone --nproc_per_node=2 examples/train_char_transformer.py --steps 200

The trainmon integration is the two marked lines. Validation (``run.track`` and ``run.eval``)
and checkpoints (``run.checkpoint``) show the optional calls; everything else is an ordinary
loop.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import trainmon_client


def load_corpus(max_bytes: int) -> torch.Tensor:
    """Bytes of the standard library's .py files (sorted, so every rank sees the same text)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class ByteTransformer(nn.Module):
    """A GPT-style decoder over bytes (vocabulary 256)."""

    def __init__(self, dim: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256, bias=False)
        mask = torch.triu(torch.full((seq_len, seq_len), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: torch.Tensor,
    batch_size: int,
    seq_len: int,
    gen: torch.Generator | None = None,
    params: nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on a random batch; returns (loss, grad norm before clipping to 1).

    ``model`` may be the DDP wrapper; ``params`` is the module whose parameters are clipped.
    """
    ix = torch.randint(len(data) - seq_len - 1, (batch_size,), generator=gen)
    x = torch.stack([data[i : i + seq_len] for i in ix.tolist()])
    y = torch.stack([data[i + 1 : i + seq_len + 1] for i in ix.tolist()])
    loss = F.cross_entropy(model(x).view(-1, 256), y.view(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_((params or model).parameters(), 1.0)
    opt.step()
    return loss.detach(), grad_norm


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, batch_size: int, seq_len: int) -> float:
    """Mean loss over 4 fixed batches of held-out text."""
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(4):
        ix = torch.randint(len(data) - seq_len - 1, (batch_size,), generator=gen)
        x = torch.stack([data[i : i + seq_len] for i in ix.tolist()])
        y = torch.stack([data[i + 1 : i + seq_len + 1] for i in ix.tolist()])
        losses.append(F.cross_entropy(model(x).view(-1, 256), y.view(-1)).item())
    model.train()
    return sum(losses) / len(losses)


STATUS_URL = "http://127.0.0.1:9478"
"""The exporter's address when it runs with its defaults (``trainmon-exporter``)."""


def trainmon_summary(run: trainmon_client.Run | None, status_url: str = STATUS_URL) -> str:
    """One closing line: what trainmon sent, to which socket, and where to look at it
    (``status_url``: the exporter's HTTP address, ``--status-url``)."""
    if run is None or (run.closed and run.sent == 0 and not any(run.dropped.values())):
        return "trainmon: off"
    dropped = sum(run.dropped.values())
    line = (
        f"trainmon: run {run.run_id!r} rank {run.rank}: {run.sent} records sent to "
        f"{run.socket_path}, {dropped} dropped"
    )
    if run.refused_reason:
        return (
            line + f" (the exporter refused this run: {run.refused_reason}; see the warning above)"
        )
    if run.sent == 0:
        try:
            os.stat(run.socket_path)
            denied = not os.access(run.socket_path, os.W_OK)
        except PermissionError:  # its directory does not let this user in
            denied = True
        except OSError:
            denied = False
        if denied:
            return (
                line
                + " (permission denied: this user may not connect there; see the warning above)"
            )
        return line + " (no exporter listened there: start `trainmon-exporter` first)"
    status = "trainmon status" + ("" if status_url == STATUS_URL else f" --url {status_url}")
    return line + f"; see the exporter's status page ({status_url}/) or `{status}`"


def framework_parser(doc: str) -> argparse.ArgumentParser:
    """The flags the Hugging Face and Lightning examples share (model, data, trainmon)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--run", default=None, help="trainmon run id (default: detected)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--corpus-bytes", type=int, default=400_000)
    p.add_argument("--output-dir", default=None)
    p.add_argument("--inject-nan-at", type=int, default=0, help="a NaN loss at this step")
    p.add_argument("--no-trainmon", action="store_true", help="the same run without trainmon")
    p.add_argument(
        "--status-url",
        default=STATUS_URL,
        help="the exporter's HTTP address, for the closing line (default %(default)s)",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (0: until Ctrl-C)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--corpus-bytes", type=int, default=2_000_000)
    p.add_argument("--eval-every", type=int, default=100, help="validate every N steps (0: off)")
    p.add_argument("--checkpoint-every", type=int, default=200, help="save every N steps (0: off)")
    p.add_argument("--run", default=None, help="trainmon run id (default: from the launcher)")
    p.add_argument("--no-trainmon", action="store_true", help="train without reporting")
    p.add_argument("--inject-nan-at", type=int, default=-1, help="report a NaN loss at this step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--status-url",
        default=STATUS_URL,
        help="the exporter's HTTP address, for the closing line (default %(default)s)",
    )
    p.add_argument(
        "--watch", type=int, default=0, help="per-layer statistics every N steps (0: off)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(args.seed)  # same initial weights on every rank

    corpus = load_corpus(args.corpus_bytes)
    split = int(len(corpus) * 0.9)
    data, held_out = corpus[:split], corpus[split:]  # the last 10 % is never trained on
    ckpt_dir = Path(tempfile.mkdtemp(prefix="trainmon-example-"))
    model = ByteTransformer(args.dim, args.layers, args.heads, args.seq_len)
    n_params = sum(p.numel() for p in model.parameters())
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches
    B, T = args.batch_size, args.seq_len

    # --- trainmon, line 1 of 2 -----------------------------------------------------------
    run = trainmon_client.init(run=args.run, num_params=n_params, enabled=not args.no_trainmon)
    if args.watch and not args.no_trainmon:
        run.watch(model, opt, every=args.watch)  # optional: per-layer gradients and updates

    if rank == 0:
        print(
            f"model: {n_params / 1e6:.2f}M params, corpus {len(data) / 1e6:.1f} MB, "
            f"world size {world}, run {run.run_id!r}",
            flush=True,
        )
    step, t_start = 0, time.perf_counter()
    try:
        while args.steps == 0 or step < args.steps:
            lr = args.lr * min(1.0, (step + 1) / args.warmup)
            lr *= 0.5 * (
                1 + math.cos(math.pi * min(step, args.steps or step + 1) / max(args.steps, 1))
            )
            for group in opt.param_groups:
                group["lr"] = lr
            loss, grad_norm = train_step(ddp, opt, data, B, T, gen, params=model)
            reported = loss
            if step == args.inject_nan_at:
                reported = torch.tensor(float("nan"))

            # --- trainmon, line 2 of 2 -------------------------------------------------------
            run.log(step, loss=reported, lr=lr, grad_norm=grad_norm, tokens=B * T, samples=B)

            if args.eval_every and step % args.eval_every == args.eval_every - 1:
                with run.track("validation"):  # timed; the rank is busy, not hung
                    val_loss = evaluate(model, held_out, B, T)
                run.eval(step, val_loss=val_loss)
            if rank == 0 and args.checkpoint_every and step % args.checkpoint_every == 0 and step:
                t0 = time.perf_counter()
                torch.save({"model": model.state_dict(), "step": step}, ckpt_dir / "last.pt")
                run.checkpoint(step, seconds=time.perf_counter() - t0)
            if rank == 0 and step % 50 == 0:
                print(
                    f"step {step:5d}  loss {loss.item():.3f}  lr {lr:.2e}  "
                    f"grad norm {grad_norm.item():.2f}",
                    flush=True,
                )
            step += 1
    except KeyboardInterrupt:
        if rank == 0:
            print("interrupted", flush=True)
    run.finish()
    if rank == 0:
        elapsed = time.perf_counter() - t_start
        tps = step * B * T * world / elapsed
        print(
            f"done: {step} steps in {elapsed:.1f}s ({tps:,.0f} tokens/s), "
            f"trainmon dropped {sum(run.dropped.values())} messages",
            flush=True,
        )
        print(trainmon_summary(None if args.no_trainmon else run, args.status_url), flush=True)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
