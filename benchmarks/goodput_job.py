"""Goodput for the whole job against the trainers' own clocks: five scenarios, real processes.

    python benchmarks/goodput_job.py [--scenarios moved,ttl,exporter_restart,gloo4,lightning]

Each scenario runs real trainers against real exporters, scraped by a real Prometheus that
evaluates the shipped recording rules every second (``tests/helpers/goodput_lab.py`` says
what each does and how the truth is measured): a rank killed and restarted on a second
exporter, a restart after longer than the series TTL, the exporter killed and restarted
mid-run, four gloo ranks with one slow loader, and Lightning with a slow dataset. Prints, per
scenario, the job's goodput and each badput kind (seconds per rank) as the trainers measured
them, as the rules record them, as the JSON API shows them (its ``job``, read from
Prometheus) and as the API computes them over the ranks of one exporter; then whether each is
within the promise: goodput within 3 points, each badput kind of a second or more within
15 %. Exits 1 when one is not. The figures of docs/goodput.md come from here.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers.goodput_lab import SCENARIOS, run_scenarios  # noqa: E402

FULL = {"steps": 60}
"""Steps of each trainer (the ``ttl`` and ``moved`` scenarios kill after a third and a half)."""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--smoke", action="store_true", help="seconds: one short scenario, unjudged")
    args = ap.parse_args()
    names = tuple(args.scenarios.split(","))
    sizes = FULL
    if args.smoke:
        names, sizes = ("exporter_restart",), {"steps": 12}
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenarios {sorted(unknown)}; choose from {SCENARIOS}")
    print("| scenario | figure | trainers measured | rules | API (job) | API (this node) |")
    print("|---|---|---:|---:|---:|---:|")
    problems: list[str] = []
    t0 = time.monotonic()
    for result in run_scenarios(names, **sizes):
        print(result.table(), flush=True)
        problems += result.problems()
    print(f"\n{len(names)} scenario(s) in {time.monotonic() - t0:.0f} s")
    if args.smoke:
        return 0
    for line in problems:
        print("NOT KEPT:", line)
    print("every figure within its promise" if not problems else f"{len(problems)} not kept")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
