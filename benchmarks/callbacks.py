"""Overhead of the Hugging Face and Lightning callbacks per training step.

    python benchmarks/callbacks.py [--rounds 4 --block 30 --frameworks hf,lightning]

For each framework, one process alternates blocks of ``--block`` optimizer steps in ABBA order:
A trains with ``TrainmonCallback`` reporting to a real exporter, B trains the same model
without it. Each block is one ``train()``/``fit()`` call on a Trainer built for it (the same
model, data and settings as examples/train_hf_trainer.py and examples/train_lightning.py, at
dim 128, 2 layers, 128 tokens x 16 samples); its steps are timed by a minimal timing callback
present in both arms, and the first two intervals of a block (set-up, connect) are left out.

Prints per framework: the mean step time of A and B, the overhead (A - B) / B (mean of rounds,
2 standard errors), and the callback's own time (every hook method and the forward hook,
timed with ``time.perf_counter``) per step and as a share of A's step time. Goal: < 1 %.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from trainmon_exporter.local import LocalExporter  # noqa: E402

MODEL = ["--dim", "128", "--layers", "2", "--heads", "4", "--seq-len", "128"]
MODEL += ["--batch-size", "16", "--corpus-bytes", "1000000"]


class SelfTime:
    """Wraps a callback's methods to add up the time spent inside them (in all, and each)."""

    def __init__(self, callback: Any, names: list[str]) -> None:
        self.seconds = 0.0
        self.by_method = dict.fromkeys(names, 0.0)
        for name in names:
            setattr(callback, name, self._timed(name, getattr(callback, name)))

    def _timed(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self.seconds += dt
                self.by_method[name] += dt

        return timed


def step_times(stamps: list[float]) -> list[float]:
    """Intervals between consecutive step ends, without the first two of the block."""
    return [b - a for a, b in itertools.pairwise(stamps[2:])]


def hf_arms(socket: str, block: int) -> tuple[Any, Any, int]:
    """Two block runners for transformers: (run A, run B, steps timed per block)."""
    from train_hf_trainer import build, parse
    from transformers import TrainerCallback

    from trainmon_client.hf import TrainmonCallback

    class Stamps(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.t: list[float] = []

        def on_step_end(self, *a: Any, **k: Any) -> None:
            self.t.append(time.perf_counter())

    args = parse([*MODEL, "--steps", str(block), "--eval-steps", "0", "--logging-steps", "10"])
    trainer = build(args, [])  # the model and data, built once
    cb = TrainmonCallback("bench-hf", socket_path=socket)
    timer = SelfTime(
        cb,
        [
            "_forward",
            "on_step_begin",
            "on_step_end",
            "on_log",
            "on_optimizer_step",
            "on_train_begin",
            "on_train_end",
        ],
    )

    def run(with_callback: bool) -> list[float]:
        stamps = Stamps()
        trainer.callback_handler.callbacks = [
            c for c in trainer.callback_handler.callbacks if not isinstance(c, (Stamps, type(cb)))
        ]
        trainer.add_callback(stamps)
        if with_callback:
            trainer.add_callback(cb)
        trainer.train()
        return step_times(stamps.t)

    return run, timer, block - 3


def lightning_arms(socket: str, block: int) -> tuple[Any, Any, int]:
    """Two block runners for Lightning: (run A, run B, steps timed per block)."""
    import lightning
    from train_lightning import build, parse

    from trainmon_client.lightning import TrainmonCallback

    class Stamps(lightning.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.t: list[float] = []

        def on_train_batch_end(self, *a: Any, **k: Any) -> None:
            self.t.append(time.perf_counter())

    args = parse([*MODEL, "--steps", str(block), "--eval-every", "0"])
    _, (module, train, _) = build(args, [])
    n = sum(p.numel() for p in module.parameters())
    cb = TrainmonCallback(
        "bench-lightning", socket_path=socket, count_tokens=lambda b: b[0].numel(), num_params=n
    )
    timer = SelfTime(
        cb, ["on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end", "setup"]
    )

    def run(with_callback: bool) -> list[float]:
        stamps = Stamps()
        trainer, _ = build(args, [stamps, cb] if with_callback else [stamps])
        trainer.fit(module, train)
        return step_times(stamps.t)

    return run, timer, block - 3


def abba(name: str, arms: Any, rounds: int, block: int, socket: str) -> None:
    run, timer, timed = arms(socket, block)
    run(True)  # warm-up of both arms (imports, first plans, allocator)
    run(False)
    a_all: list[float] = []
    b_all: list[float] = []
    overheads: list[float] = []
    self0 = timer.seconds
    by0 = dict(timer.by_method)
    for _ in range(rounds):
        a1, b1, b2, a2 = run(True), run(False), run(False), run(True)
        a_all += a1 + a2
        b_all += b1 + b2
        ma = statistics.mean(a1 + a2)
        mb = statistics.mean(b1 + b2)
        overheads.append((ma - mb) / mb)
    a, b = statistics.mean(a_all), statistics.mean(b_all)
    half = 2 * statistics.stdev(overheads) / len(overheads) ** 0.5
    # The timer also ran during the warm-up block of A; count only the measured rounds.
    per_step = (timer.seconds - self0) / (rounds * 2 * block)
    print(f"{name}: ABBA, {rounds} rounds x 4 blocks x {block} steps ({timed} timed per block)")
    print(f"  A (with TrainmonCallback) {a * 1e3:8.2f} ms/step")
    print(f"  B (without)               {b * 1e3:8.2f} ms/step")
    print(
        f"  overhead (A-B)/B:         {(a - b) / b * 100:+.2f} %   mean of rounds "
        f"{statistics.mean(overheads) * 100:+.2f} % +- {half * 100:.2f} % (2 SE)"
    )
    print(
        f"  callback's own time:      {per_step * 1e6:.1f} us/step = "
        f"{per_step / a * 100:.3f} % of A's step time (goal < 1 %)"
    )
    parts = ", ".join(
        f"{k} {(v - by0[k]) / (rounds * 2 * block) * 1e6:.1f}"
        for k, v in timer.by_method.items()
        if v > by0[k]
    )
    print(f"    per method, us/step:    {parts}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--block", type=int, default=30, help="optimizer steps per block")
    ap.add_argument("--frameworks", default="hf,lightning")
    ap.add_argument(
        "--smoke", action="store_true", help="seconds: 2 rounds of 6 steps (figures not meaningful)"
    )
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.block = 2, 6
    if args.rounds < 2 or args.block < 6:
        ap.error("--rounds >= 2 and --block >= 6")
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.INFO)  # Lightning's banners at every fit()
    with LocalExporter("--no-collectors.gpu", "--no-collectors.rank-gpu") as exporter:
        for name in args.frameworks.split(","):
            arms = {"hf": hf_arms, "lightning": lightning_arms}[name]
            abba(name, arms, args.rounds, args.block, exporter.socket)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
