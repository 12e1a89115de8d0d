"""Detection-quality benchmark: real training, real client, real exporter, injected faults.

    python benchmarks/detection/run.py [--clean-steps 2000 --clean-runs 3]
    python benchmarks/detection/run.py --smoke   # seconds: one short clean run and one NaN run

Runs ``scenario.py`` in every scenario against one exporter. That exporter uses the default
detector settings, except ``hang_grace_seconds=2`` so the hang scenario takes seconds rather
than the default 30 s. It polls ``/api/v1/runs`` while each run goes on and matches the
detector events against the injections each scenario printed. Prints, per detector:
- injections, detections, recall;
- detection latency in steps (the event's step minus the injected step) and in seconds
  (exporter event time minus injection time);
- false alarms per 1,000 steps of the clean runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainmon_exporter.local import LocalExporter

HERE = Path(__file__).resolve().parent
SCENARIO = HERE / "scenario.py"

# detector -> (event kinds that count as detecting it, scenario that injects it)
DETECTORS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "NaN/Inf loss": (("nonfinite_loss",), "nan"),
    "loss spike (any)": (("loss_spike_minor", "loss_spike_major", "loss_spike_severe"), "spike"),
    "loss spike (major+)": (("loss_spike_major", "loss_spike_severe"), "spike"),
    "gradient explosion": (("grad_explosion",), "explosion"),
    "hang": (("hang",), "hang"),
    "crash": (("crash",), "crash"),
    "throughput drop": (("throughput_drop",), "slowdown"),
    "straggler": (("straggler",), "straggler"),
    "memory leak": (("memory_leak",), "leak"),
    "grad-norm spike (any)": (
        ("grad_norm_spike_minor", "grad_norm_spike_major", "grad_norm_spike_severe"),
        None,
    ),
    "grad-norm spike (major+)": (("grad_norm_spike_major", "grad_norm_spike_severe"), None),
}
ALARM_KINDS = {k for kinds, _ in DETECTORS.values() for k in kinds} | {
    "nonfinite_grad_norm",
    "grad_vanishing",
    "failed",
}


@dataclass
class Outcome:
    injections: list[dict[str, Any]] = field(default_factory=list)
    events: dict[tuple[int, str, int | None], dict[str, Any]] = field(default_factory=dict)
    steps: int = 0


def poll_events(ex: LocalExporter, run: str, out: Outcome) -> None:
    for r in ex.get_json("/api/v1/runs")["runs"]:
        if r["run"] != run:
            continue
        for rank in r["ranks"]:
            out.steps = max(out.steps, rank["steps_total"])
            for e in rank["events"]:
                out.events.setdefault(
                    (rank["rank"], e["kind"], e["step"]), e | {"rank": rank["rank"]}
                )


def run_scenario(
    ex: LocalExporter,
    name: str,
    run: str,
    *extra: str,
    ranks: int = 1,
    wait_kind: str | None = None,
    timeout: float = 300,
) -> Outcome:
    out = Outcome()
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, TRAINMON_SOCKET=ex.socket, PYTHONUNBUFFERED="1")
        if ranks > 1:
            env |= {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks)}
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCENARIO), "--scenario", name, "--run", run, *extra],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
        )

    def read(p: subprocess.Popen[str]) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            if line.startswith("{"):
                out.injections.append(json.loads(line))

    readers = [threading.Thread(target=read, args=(p,), daemon=True) for p in procs]
    for t in readers:
        t.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        poll_events(ex, run, out)
        if wait_kind and any(k[1] == wait_kind for k in out.events):
            break
        if all(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    for t in readers:
        t.join(5)
    time.sleep(0.5)
    poll_events(ex, run, out)
    return out


MAX_LAG_STEPS = 50
"""A step-matched event later than this many steps after an injection does not count."""
BY_TIME = {"hang", "crash", "throughput_drop", "straggler", "memory_leak"}
"""Matched by time (within MAX_LAG_SECONDS), not by step.

- Hang and crash: a hung or killed loop never flushes its last steps (up to 0.5 s of them), so
  the exporter's last step, which the event carries, is before the injected one. Their
  latency in steps is not meaningful.
- Throughput drop, straggler and memory leak: judged on the exporter's 1 s tick, so their
  event step trails the injection by up to a second of steps.
"""
MAX_LAG_SECONDS = 30.0
NO_STEP_LATENCY = {"hang", "crash"}


def match(out: Outcome, kinds: tuple[str, ...]) -> list[tuple[int | None, float] | None]:
    """For each injection: (latency steps, latency s) of the first matching event, or None."""
    results: list[tuple[int | None, float] | None] = []
    by_time = bool(BY_TIME & set(kinds))
    for inj in out.injections:
        hits = []
        for e in out.events.values():
            if e["kind"] not in kinds or e["time"] < inj["time"] - 1.0:
                continue
            if by_time:
                ok = e["time"] - inj["time"] <= MAX_LAG_SECONDS
            else:
                ok = e["step"] is not None and 0 <= e["step"] - inj["step"] <= MAX_LAG_STEPS
            if ok:
                hits.append(e)
        if not hits:
            results.append(None)
            continue
        first = min(hits, key=lambda e: e["time"])
        no_steps = bool(NO_STEP_LATENCY & set(kinds)) or first["step"] is None
        lag = None if no_steps else int(first["step"]) - inj["step"]
        results.append((lag, max(0.0, first["time"] - inj["time"])))
    return results


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clean-steps", type=int, default=2000)
    ap.add_argument("--clean-runs", type=int, default=3)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="seconds: one 60-step clean run and one NaN run (figures not meaningful)",
    )
    args = ap.parse_args()
    if args.smoke:
        args.clean_runs, args.clean_steps = 1, 60
    os.environ["TRAINMON_ANALYTICS__HANG_GRACE_SECONDS"] = "2"
    stamp = int(time.time())
    with LocalExporter() as ex:
        clean_steps = 0
        clean_alarms: dict[str, int] = {}
        for seed in range(args.clean_runs):
            o = run_scenario(
                ex,
                "clean",
                f"clean-{stamp}-{seed}",
                "--steps",
                str(args.clean_steps),
                "--seed",
                str(seed),
            )
            clean_steps += o.steps
            for (_, kind, _), e in o.events.items():
                clean_alarms[kind] = clean_alarms.get(kind, 0) + e.get("count", 1)
        if args.smoke:
            outcomes = {
                "nan": run_scenario(ex, "nan", f"nan-{stamp}", "--steps", "80", "--at", "40")
            }
        else:
            outcomes = {
                "nan": run_scenario(ex, "nan", f"nan-{stamp}", "--steps", "700"),
                "spike": run_scenario(
                    ex, "spike", f"spike-{stamp}", "--steps", "1650", "--every", "100"
                ),
                "explosion": run_scenario(ex, "explosion", f"explosion-{stamp}", "--steps", "700"),
                "hang": run_scenario(
                    ex, "hang", f"hang-{stamp}", "--steps", "700", wait_kind="hang", timeout=60
                ),
                "crash": run_scenario(
                    ex, "crash", f"crash-{stamp}", "--steps", "700", wait_kind="crash"
                ),
                "slowdown": run_scenario(ex, "slowdown", f"slow-{stamp}", "--steps", "1500"),
                "straggler": run_scenario(
                    ex, "straggler", f"strag-{stamp}", "--steps", "3000", ranks=2
                ),
                "leak": run_scenario(ex, "leak", f"leak-{stamp}", "--steps", "1200"),
            }
        step_time = None
        for r in ex.get_json("/api/v1/runs")["runs"]:
            if r["run"] == f"clean-{stamp}-0":
                step_time = r["ranks"][0]["step_time_mean_seconds"]
    print(
        f"\nclean runs: {args.clean_runs} x {args.clean_steps} steps ({clean_steps} received), "
        f"mean step {step_time * 1e3 if step_time else float('nan'):.1f} ms; "
        f"hang_grace_seconds=2, other settings default\n"
    )
    header = (
        f"{'detector':24s} {'injected':>8s} {'found':>6s} {'recall':>7s} "
        f"{'steps med/max':>14s} {'seconds med/max':>16s} {'false/1k clean':>15s}"
    )
    print(header)
    print("-" * len(header))
    for name, (kinds, scenario) in DETECTORS.items():
        if scenario is not None and scenario not in outcomes:  # --smoke runs only some
            print(f"{name:24s} (not run)")
            continue
        res = match(outcomes[scenario], kinds) if scenario else []
        found = [r for r in res if r is not None]
        recall = f"{len(found) / len(res) * 100:.0f}%" if res else "n/a"
        steps = [r[0] for r in found if r[0] is not None]
        secs = [r[1] for r in found]
        alarms = sum(clean_alarms.get(k, 0) for k in kinds)
        lat_steps = f"{statistics.median(steps):.0f}/{max(steps)}" if steps else "n/a"
        lat_secs = f"{statistics.median(secs):.2f}/{max(secs):.2f}" if secs else "-"
        print(
            f"{name:24s} {len(res):8d} {len(found):6d} {recall:>7s} "
            f"{lat_steps:>14s} {lat_secs:>16s} {alarms / clean_steps * 1000:15.2f}"
        )
    listed = {x for ks, _ in DETECTORS.values() for x in ks}
    others = {k: v for k, v in clean_alarms.items() if k not in listed}
    print(f"\nclean-run events by kind: {clean_alarms or 'none'}")
    print(f"clean-run events of kinds not in the table: {others or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
