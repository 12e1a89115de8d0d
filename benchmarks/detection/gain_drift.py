"""Gradient-gain drift on healthy models: single checks against the rolling median.

    python benchmarks/detection/gain_drift.py            # about 15 s on 2 CPUs
    python benchmarks/detection/gain_drift.py --smoke    # seconds (CI)

A 2-layer MLP (byte embedding, Linear 128->64, ReLU, Linear 64->256) learns the next byte of
real text (the source of Python's ``collections`` module) with AdamW, for ``--steps`` steps,
per seed and check interval. Its two Linear layers give one layer pair: the noisiest mean
gain a watched model can have. Every ``every`` steps the per-layer gradient norms (weight
and bias, as ``Run.watch`` computes them) go to two analytics instances side by side:

- **single check**: each check's gain against the median of the first 5 checks, an episode
  at the first drifted check (``gain_window_checks=1, gain_drift_checks=1,
  gain_baseline_checks=5``);
- **defaults**: :class:`AnalyticsSettings` as shipped (rolling median over
  ``gain_window_checks``, ``gain_drift_checks`` in a row, ``gain_baseline_checks``).

Prints the drift episodes each counted per run (a healthy run should have none), then how
many checks after a 4x step change in a synthetic log-normal gain (sd 0.3 in ln) each finds
it, and the episodes each counted on that noise before the change.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import math
import random

import torch

from trainmon_exporter.analytics import AnalyticsSettings, RankAnalytics

SINGLE = {"gain_window_checks": 1, "gain_drift_checks": 1, "gain_baseline_checks": 5}


def analytics() -> dict[str, RankAnalytics]:
    return {
        "single check": RankAnalytics(AnalyticsSettings(**SINGLE)),
        "defaults": RankAnalytics(AnalyticsSettings()),
    }


def healthy_run(seed: int, every: int, steps: int) -> tuple[dict[str, int], float]:
    """Episodes per judge on one clean run, and its final loss (nats)."""
    torch.manual_seed(seed)
    data = torch.tensor(list(inspect.getsource(collections).encode()), dtype=torch.long)
    model = torch.nn.Sequential(
        torch.nn.Embedding(256, 16),
        torch.nn.Flatten(),
        torch.nn.Linear(128, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 256),
    )
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    judges = analytics()
    loss = torch.tensor(0.0)
    for step in range(steps):
        idx = torch.randint(0, len(data) - 9, (32,))
        x = torch.stack([data[i : i + 8] for i in idx.tolist()])
        loss = torch.nn.functional.cross_entropy(model(x), data[idx + 8])
        opt.zero_grad()
        loss.backward()
        if step % every == 0:
            rows = []
            for i, layer in enumerate(linears):
                grads = torch.cat(
                    [p.grad.flatten() for p in layer.parameters() if p.grad is not None]
                )
                rows.append((f"l{i}", {1: float(torch.linalg.vector_norm(grads))}))
            for a in judges.values():
                a.observe_layers(rows)
        opt.step()
    return {k: a.gain_drifts for k, a in judges.items()}, loss.item()


def step_change(before: int, after: int, seed: int = 1) -> dict[str, tuple[int, int | None]]:
    """Per judge: episodes on ``before`` checks of noise, and checks until a 4x change is found."""
    rng = random.Random(seed)
    noise = [math.exp(rng.gauss(0, 0.3)) for _ in range(before)]
    shifted = [4 * math.exp(rng.gauss(0, 0.3)) for _ in range(after)]
    out: dict[str, tuple[int, int | None]] = {}
    for name, a in analytics().items():
        for g in noise:
            a.observe_layers([("l0", {1: g}), ("l1", {1: 1.0})])
        false_episodes = a.gain_drifts
        found = None
        for k, g in enumerate(shifted, 1):
            a.observe_layers([("l0", {1: g}), ("l1", {1: 1.0})])
            if a.gain_drifts > false_episodes:
                found = k
                break
        out[name] = (false_episodes, found)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="one seed, 200 steps")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.seeds = 200, 1
    torch.set_num_threads(1)
    print(f"healthy 2-layer MLP, {args.steps} steps per run: drift episodes counted")
    print(f"{'seed':>4} {'every':>5} {'final loss':>10} {'single check':>13} {'defaults':>9}")
    totals = {"single check": 0, "defaults": 0}
    for seed in range(args.seeds):
        for every in (1, 10):
            episodes, loss = healthy_run(seed, every, args.steps)
            for k in totals:
                totals[k] += episodes[k]
            print(
                f"{seed:>4} {every:>5} {loss:>10.3f} {episodes['single check']:>13} "
                f"{episodes['defaults']:>9}"
            )
    print(f"{'all':>4} {'':>5} {'':>10} {totals['single check']:>13} {totals['defaults']:>9}")
    print("\nsynthetic gain, log-normal noise (sd 0.3 in ln), then a 4x step change:")
    for name, (false_episodes, found) in step_change(500, 50).items():
        where = f"found {found} checks after it" if found else "not found in 50 checks"
        print(f"  {name:<13} {false_episodes} episodes on 500 checks of noise; change {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
