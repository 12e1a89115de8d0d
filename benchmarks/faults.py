"""``log()`` and ``finish()`` under each delivery fault, and where every step went.

Each fault runs a real client against a real exporter subprocess (or a socket that never
reads) and logs ``--steps`` steps at about 1 kHz, timing every ``log()`` call
(``time.perf_counter``), then ``finish()``:

- ``healthy``: the baseline, same run: an exporter that reads.
- ``none``: no exporter listening at all.
- ``mute``: a listener that accepts and never reads (alive but not reading).
- ``frozen``: the exporter SIGSTOPped a third of the way, SIGKILLed two thirds of the way,
  a new one started; the client reconnects.
- ``refused``: the rank is already connected from another process: the HELLO is refused.

Prints per fault: ``log()`` p50, p99 and worst (us), ``finish()`` (ms), and the client's
accounting: sent, dropped by reason, and whether every step is accounted for.

    python benchmarks/faults.py [healthy none mute frozen refused] [--steps 3000]
    python benchmarks/faults.py --smoke     # seconds: every fault with 300 steps
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import Exporter

import trainmon_client

FAULTS = ("healthy", "none", "mute", "frozen", "refused")


def drive(run: trainmon_client.Run, steps: int, at: dict[int, Any] | None = None) -> list[float]:
    """Log ``steps`` steps about 1 ms apart; ``at[i]()`` runs before step i. Returns log() s."""
    times = []
    fields = {f"m{i}": float(i) for i in range(8)}
    for i in range(steps):
        if at and i in at:
            at[i]()
        t0 = time.perf_counter()
        run.log(i, loss=2.0, lr=1e-4, grad_norm=1.0, tokens=4096, **fields)
        times.append(time.perf_counter() - t0)
        time.sleep(0.001)
    return times


def report(name: str, run: trainmon_client.Run, times: list[float], fin: float, steps: int) -> None:
    q = statistics.quantiles(times, n=100)
    d = run.dropped
    accounted = run.sent + d["disconnected"] + d["backpressure"] + d["encode_error"]
    print(
        f"{name:<8} log() p50 {q[49] * 1e6:6.1f} us  p99 {q[98] * 1e6:6.1f} us  "
        f"worst {max(times) * 1e6:8.1f} us  finish() {fin * 1e3:6.1f} ms  | sent {run.sent:5d}  "
        f"disconnected {d['disconnected']:5d}  backpressure {d['backpressure']:5d}  "
        f"in_flight {d['in_flight']:5d}  accounted {accounted}/{steps}",
        flush=True,
    )


def client(path: str, run_id: str, **kw: Any) -> trainmon_client.Run:
    return trainmon_client.init(
        run=run_id, rank=0, world_size=1, local_rank=0, socket_path=path, **kw
    )


def finish(run: trainmon_client.Run) -> float:
    t0 = time.perf_counter()
    run.finish()
    return time.perf_counter() - t0


def fault(name: str, steps: int) -> None:
    if name == "healthy":
        ex = Exporter()
        try:
            run = client(ex.socket, "healthy")
            times = drive(run, steps)
            report(name, run, times, finish(run), steps)
        finally:
            ex.close()
    elif name == "none":
        run = client("/nonexistent/trainmon.sock", "none")
        times = drive(run, steps)
        report(name, run, times, finish(run), steps)
    elif name == "mute":
        d = Path(tempfile.mkdtemp(prefix="tm-f-", dir="/tmp"))
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        srv.bind(str(d / "m.sock"))
        srv.listen(8)
        run = client(str(d / "m.sock"), "mute")
        times = drive(run, steps)
        report(name, run, times, finish(run), steps)
        srv.close()
    elif name == "frozen":
        ex = Exporter()
        second: list[Exporter] = []
        run = client(ex.socket, "frozen")

        def restart() -> None:
            assert ex.proc is not None
            os.kill(ex.proc.pid, signal.SIGKILL)
            ex.proc.wait()
            second.append(Exporter("--socket", ex.socket))

        at = {
            steps // 3: lambda: os.kill(ex.proc.pid, signal.SIGSTOP),  # type: ignore[union-attr]
            2 * steps // 3: restart,
        }
        try:
            times = drive(run, steps, at)
            report(name, run, times, finish(run), steps)
        finally:
            for e in second:
                e.close()
            ex.close()
    elif name == "refused":
        ex = Exporter()
        try:
            owner = client(ex.socket, "refused", flush_interval=0.0)
            owner.log(0, loss=1.0)
            time.sleep(0.5)
            run = client(ex.socket, "refused")
            times = drive(run, steps)
            report(name, run, times, finish(run), steps)
            owner.finish()
        finally:
            ex.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("faults", nargs="*", help=" ".join(FAULTS))
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--smoke", action="store_true", help="seconds: every fault, 300 steps")
    args = ap.parse_args()
    steps = 300 if args.smoke else args.steps
    for name in args.faults or FAULTS:
        fault(name, steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
