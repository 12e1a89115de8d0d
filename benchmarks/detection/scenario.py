"""One training run of the detection benchmark, with a fault injected for real.

The model and data are the example's (a byte-level transformer on the standard library's
source), in a small configuration so thousands of steps take seconds on a CPU. The run logs
through the real client. Each injection is printed as a JSON line
``{"inject": KIND, "step": N, "time": UNIX_S}`` so the harness can score detection.

Scenarios:
- ``clean``: nothing injected.
- ``nan``: the loss is multiplied by NaN at ``--at``, poisoning the weights from there on.
- ``spike``: bad batches (a share of random bytes) every ``--every`` steps after ``--at``.
- ``explosion``: the learning rate is multiplied by 1e4 at ``--at``.
- ``hang``: the loop sleeps for an hour at ``--at``.
- ``stall``: the loop sleeps ``--stall-seconds`` at ``--at``, then goes on (a hang that
  recovers).
- ``crash``: the process SIGKILLs itself at ``--at``.
- ``slowdown``: from ``--at`` every step takes about twice as long.
- ``straggler``: like slowdown, for the rank given by ``--slow-rank`` only.
- ``leak``: from ``--at`` every step keeps 512 KiB of tensors alive for good.

Every step also reports ``mem_allocated``: the process's resident memory from
``/proc/self/statm``. On a GPU one would pass ``torch.cuda.memory_allocated()``; there is no
CUDA here, so the real, measured CPU footprint stands in.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import trainmon_client

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from train_char_transformer import ByteTransformer, load_corpus  # noqa: E402

B, T = 8, 32


PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> float:
    with open("/proc/self/statm") as f:
        return float(int(f.read().split()[1]) * PAGE)


def mark(kind: str, step: int) -> None:
    print(json.dumps({"inject": kind, "step": step, "time": time.time()}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", help="required, except with --smoke (nan)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--at", type=int, default=400, help="step of the (first) injection")
    ap.add_argument("--every", type=int, default=100, help="spike: steps between bad batches")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run", default="detection-scenario")
    ap.add_argument("--slow-rank", type=int, default=1)
    ap.add_argument("--stall-seconds", type=float, default=90.0)
    ap.add_argument(
        "--watch",
        type=int,
        default=0,
        help="Run.watch(model, opt, every=N): per-layer statistics every N steps (0: off)",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="seconds: 20 steps, injection at step 10 (nan)"
    )
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.at, args.stall_seconds = 20, 10, 0.5
        args.scenario = args.scenario or "nan"
    if args.scenario is None:
        ap.error("--scenario is required")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    data = load_corpus(300_000)
    model = ByteTransformer(32, 1, 2, T)
    lr = 3e-3
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(args.seed)
    run = trainmon_client.init(run=args.run)
    if args.watch:
        run.watch(model, opt, every=args.watch)
    slow = args.scenario == "slowdown" or (
        args.scenario == "straggler" and run.rank == args.slow_rank
    )
    spikes = 0
    leaked: list[torch.Tensor] = []
    for step in range(args.steps):
        ix = torch.randint(len(data) - T - 1, (B,), generator=gen)
        x = torch.stack([data[i : i + T] for i in ix.tolist()])
        y = torch.stack([data[i + 1 : i + T + 1] for i in ix.tolist()])
        at = step == args.at
        if args.scenario == "spike" and step >= args.at and (step - args.at) % args.every == 0:
            share = (0.25, 0.5, 1.0)[spikes % 3]  # a quarter, half or all of the batch is junk
            rows = max(1, int(B * share))
            x[:rows] = torch.randint(0, 256, (rows, T), generator=gen)
            y[:rows] = torch.randint(0, 256, (rows, T), generator=gen)
            spikes += 1
            mark("spike", step)
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).view(-1, 256), y.view(-1))
        if args.scenario == "nan" and at:
            loss = loss * float("nan")
            mark("nan", step)
        if args.scenario == "explosion" and at:
            for g in opt.param_groups:
                g["lr"] = lr * 1e4
            mark("explosion", step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if slow and step >= args.at:
            if step == args.at:
                mark(args.scenario, step)
            time.sleep(time.perf_counter() - t0)  # the step takes twice as long
        if args.scenario == "leak" and step >= args.at:
            if step == args.at:
                mark("leak", step)
            leaked.append(torch.ones(128 * 1024))  # 512 KiB that is never freed
        run.log(
            step,
            loss=loss.detach(),
            grad_norm=grad_norm,
            lr=lr,
            tokens=B * T,
            samples=B,
            mem_allocated=resident_bytes(),
        )
        if args.scenario == "hang" and at:
            mark("hang", step)
            time.sleep(3600)
        if args.scenario == "stall" and at:
            mark("stall", step)
            time.sleep(args.stall_seconds)
        if args.scenario == "crash" and at:
            mark("crash", step)
            os.kill(os.getpid(), signal.SIGKILL)
    run.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
