"""Training overhead of logging every step: steps/s with ``Run.log()`` vs without.

One process trains the example model; blocks of ``--block`` steps alternate A (log every step,
as the example does: loss and grad norm as tensors, lr, tokens, samples, plus five custom
scalars) and B (no trainmon call) in ABBA order, so drift (thermal, other load) cancels. A
real exporter listens on the socket.

    python benchmarks/training_overhead.py [--rounds 6 --block 40]

Prints the mean step time of A and B, the overhead (A - B) / B with its spread over rounds,
and the client's own measured time inside log() as a share of A's wall time (goal: < 1 %).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import trainmon_client
from trainmon_exporter.local import LocalExporter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from train_char_transformer import ByteTransformer, load_corpus, train_step  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6, help="ABBA rounds")
    ap.add_argument("--block", type=int, default=40, help="steps per block")
    ap.add_argument(
        "--watch",
        action="store_true",
        help="both arms log; arm A also runs run.watch(every=--watch-every), arm B pauses it",
    )
    ap.add_argument("--watch-every", type=int, default=100)
    ap.add_argument(
        "--control",
        action="store_true",
        help="A/A control: arm A does not log either (shows the method's own noise and bias)",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="seconds: 2 rounds of 4 steps (figures not meaningful)"
    )
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.block = 2, 4
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (the spread needs two rounds)")
    torch.manual_seed(0)
    with LocalExporter() as exporter:
        data = load_corpus(1_000_000)
        model = ByteTransformer(128, 2, 4, 128)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = trainmon_client.init(run="overhead", socket_path=exporter.socket)
        watcher = run.watch(model, opt, every=args.watch_every) if args.watch else None
        B, T = 16, 128
        step = 0

        def block(arm_a: bool) -> float:
            nonlocal step
            with_log = arm_a or args.watch
            if watcher is not None:
                watcher.enabled = arm_a and not args.control
            t0 = time.perf_counter()
            for _ in range(args.block):
                loss, gn = train_step(model, opt, data, B, T)
                if with_log and not args.control:
                    run.log(
                        step,
                        loss=loss,
                        lr=1e-3,
                        grad_norm=gn,
                        tokens=B * T,
                        samples=B,
                        m1=0.1,
                        m2=0.2,
                        m3=0.3,
                        m4=0.4,
                        m5=0.5,
                    )
                step += 1
            return (time.perf_counter() - t0) / args.block

        block(True)  # warm-up: connect, first plan, caches
        block(False)
        a_times: list[float] = []
        b_times: list[float] = []
        overheads: list[float] = []
        wall_a = 0.0
        ovh0 = run.overhead_seconds
        for _ in range(args.rounds):
            a1 = block(True)
            b1 = block(False)
            b2 = block(False)
            a2 = block(True)
            a_times += [a1, a2]
            b_times += [b1, b2]
            wall_a += (a1 + a2) * args.block
            overheads.append(((a1 + a2) - (b1 + b2)) / (b1 + b2))
        in_log = run.overhead_seconds - ovh0
        logged_steps = len(a_times) * args.block * (2 if args.watch else 1)
        logged_wall = wall_a + (sum(b_times) * args.block if args.watch else 0.0)
        run.finish()
        a, b = statistics.mean(a_times), statistics.mean(b_times)
        mean_o = statistics.mean(overheads)
        half = 2 * statistics.stdev(overheads) / len(overheads) ** 0.5
        kind = "A/A CONTROL (A does not log)" if args.control else "ABBA"
        if args.watch:
            kind += f" with watch(every={args.watch_every}) in A, paused in B (both log)"
        print(f"{kind}: {args.rounds} rounds x 4 blocks x {args.block} steps of the example model")
        a_name = "A (log + watch)" if args.watch else "A (log every step)"
        b_name = "B (log, watch paused)" if args.watch else "B (no trainmon)"
        print(f"  {a_name:22s} {a * 1e3:8.2f} ms/step")
        print(f"  {b_name:22s} {b * 1e3:8.2f} ms/step")
        print(
            f"  overhead (A-B)/B:   {(a - b) / b * 100:+.2f} % "
            f"(per round: median {statistics.median(overheads) * 100:+.2f} %, "
            f"min {min(overheads) * 100:+.2f} %, max {max(overheads) * 100:+.2f} %)"
        )
        print(
            f"  mean of rounds:     {mean_o * 100:+.2f} % +- {half * 100:.2f} % (2 standard errors)"
        )
        print(
            f"  client overhead:   {in_log / logged_wall * 100:.3f} % of the logging blocks' "
            f"wall time ({in_log / logged_steps * 1e6:.1f} us per step, flusher thread included)"
        )
        if watcher is not None:
            print(
                f"  watch: {watcher.checks} checks, {watcher.seconds_total * 1e3:.1f} ms in all "
                f"= {watcher.seconds_total / wall_a * 100:.3f} % of A's wall time; every is now "
                f"{watcher.every}"
            )
        print(f"  dropped: {run.dropped}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
