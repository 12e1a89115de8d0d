"""In-situ cost of ``trainmon-run``'s hooks per step, beside ``Run.log()`` and its baseline.

One process trains the example byte transformer (benchmarks/client_log.py's model) with a
plain loop: a ``DataLoader``, ``loss.backward()``, ``clip_grad_norm_``, ``optimizer.step()``.
The hooks are installed as ``trainmon-run``'s ``sitecustomize`` installs them, and the arms
alternate step by step so that every arm sees the same conditions:

- **hooks**: the hooks report the step (loss and grad norm as tensors, lr, data time,
  samples); timed is everything they spend in the step, the DataLoader's ``next()``, the
  ``backward()`` and ``clip_grad_norm_`` wrappers and both optimizer hooks, their ``log()``
  included (``Instrumenter.seconds``);
- **log()**: the hooks idle (installed, each returning at its first check), and the loop's own
  ``run.log(step, loss=, lr=, grad_norm=)``, the two lines, is timed;
- **baseline**: ten ``prometheus_client`` ``Gauge.set`` (the published budget of ``log()``:
  p50 at most 0.5x and p99 at most 1.0x of it, docs/performance.md).

A real exporter listens on the socket. Prints p50 / p90 / p99 / max in microseconds per step
and the ratios of the hooks against ``log()`` and against the baseline.

    python benchmarks/trainmon_run.py [--steps 1200] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from prometheus_client import CollectorRegistry, Gauge

import trainmon_client
from trainmon_client import _autorun
from trainmon_exporter.local import LocalExporter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from train_char_transformer import ByteTransformer, load_corpus  # noqa: E402

B, T = 16, 128


class Windows(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = (i * 7919) % (len(self.data) - T - 1)
        return self.data[j : j + T], self.data[j + 1 : j + T + 1]


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument(
        "--smoke", action="store_true", help="seconds: 45 steps (figures not meaningful)"
    )
    args = ap.parse_args()
    dim, corpus = 128, 1_000_000
    if args.smoke:
        args.steps, dim, corpus = 12, 32, 100_000
    torch.manual_seed(0)
    exporter = LocalExporter().start()
    os.environ["TRAINMON_SOCKET"] = exporter.socket
    os.environ["TRAINMON_RUN"] = "bench-hooks"
    ins = _autorun.install({"TRAINMON_AUTORUN": "1"})
    assert ins is not None
    try:
        model = ByteTransformer(dim, 2, 4, T)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = torch.utils.data.DataLoader(Windows(load_corpus(corpus)), batch_size=B)
        run = trainmon_client.init(run="bench-log", socket_path=exporter.socket)
        reg = CollectorRegistry()
        gauges = [Gauge(f"bench_{i}", "x", registry=reg) for i in range(10)]
        t_hooks: list[float] = []
        t_log: list[float] = []
        t_gauge: list[float] = []
        batches = iter(loader)
        for step in range(args.steps):
            which = step % 3
            ins.active = which == 0
            before = ins.seconds
            x, y = next(batches)
            loss = F.cross_entropy(model(x).view(-1, 256), y.view(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            lr = opt.param_groups[0]["lr"]
            opt.step()
            if which == 0:
                t_hooks.append(ins.seconds - before)
                continue
            start = time.perf_counter()
            if which == 1:
                run.log(step, loss=loss.detach(), lr=lr, grad_norm=grad_norm, samples=B)
                t_log.append(time.perf_counter() - start)
            else:
                value = loss.item()
                for g in gauges:
                    g.set(value)
                t_gauge.append(time.perf_counter() - start)
        hooks_run = ins.run
        run.finish()
        if hooks_run is not None:
            hooks_run.finish()
        skip = min(20, len(t_log) // 4)  # warm-up
        t_hooks, t_log, t_gauge = t_hooks[skip:], t_log[skip:], t_gauge[skip:]
        print(
            f"in-situ, {args.steps} real training steps, {len(t_hooks)} per arm; torch threads "
            f"{torch.get_num_threads()}, {os.cpu_count()} CPUs"
        )
        print(f"{'per step':52s} {'p50 us':>8s} {'p90 us':>8s} {'p99 us':>8s} {'max us':>9s}")
        for name, xs in (
            ("trainmon-run hooks (everything, log() included)", t_hooks),
            ("the two lines: Run.log() with the same values", t_log),
            ("baseline: 10 x prometheus_client Gauge.set", t_gauge),
        ):
            print(
                f"{name:52s} {pct(xs, 0.5):8.1f} {pct(xs, 0.9):8.1f} {pct(xs, 0.99):8.1f} "
                f"{max(xs) * 1e6:9.1f}"
            )
        print(
            f"hooks / baseline: p50 {pct(t_hooks, 0.5) / pct(t_gauge, 0.5):.2f}x (log()'s budget "
            f"<= 0.5x), p99 {pct(t_hooks, 0.99) / pct(t_gauge, 0.99):.2f}x (budget <= 1.0x); "
            f"hooks / log(): p50 {pct(t_hooks, 0.5) / pct(t_log, 0.5):.2f}x"
        )
        print(
            f"hooks' run: {hooks_run.sent if hooks_run else 0} records sent, "
            f"{sum(hooks_run.dropped.values()) if hooks_run else 0} dropped, "
            f"{hooks_run.internal_errors if hooks_run else 0} internal errors"
        )
        return 0
    finally:
        ins.uninstall()
        exporter.stop()


if __name__ == "__main__":
    raise SystemExit(main())
