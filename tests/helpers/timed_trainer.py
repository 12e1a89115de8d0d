"""A scripted trainer with known times, for the time accounting's end-to-end test.

    python tests/helpers/timed_trainer.py --socket S --run R --truth FILE --first 1 --last 15 ...

It sleeps where a real trainer would work (start-up, waiting for a batch through
``Run.timed()``, a step's compute, a checkpoint save or load, a stall), and appends what it
measured itself to ``--truth``, one JSON object a line, stamped with ``time.monotonic()``
(one clock for every process of the machine): ``init``, each ``step`` with its ``wait``
and ``compute``, each ``save`` and ``restore`` with its ``seconds``, a ``pause``, then
``kill`` (just before it SIGKILLs itself, ``--kill-after``) or ``finish``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import trainmon_client


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--truth", required=True)
    ap.add_argument("--first", type=int, required=True, help="first step this process runs")
    ap.add_argument("--last", type=int, required=True, help="last step (then finish)")
    ap.add_argument("--startup", type=float, default=1.0, help="s from init() to the loop")
    ap.add_argument("--restore", type=float, default=0.0, help="s to load the checkpoint")
    ap.add_argument("--data", type=float, default=0.05, help="s waited for each batch")
    ap.add_argument("--compute", type=float, default=0.1, help="s of each step's work")
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--save", type=float, default=0.3, help="s of each checkpoint save")
    ap.add_argument("--pause-at", type=int, default=-1, help="stall after this step")
    ap.add_argument("--pause", type=float, default=0.0, help="s of the stall")
    ap.add_argument("--kill-after", type=int, default=-1, help="SIGKILL itself after this step")
    args = ap.parse_args()
    out = open(args.truth, "a", buffering=1)  # noqa: SIM115 (kept open until the process dies)

    def note(event: str, **fields: Any) -> None:
        out.write(json.dumps({"ev": event, "t": time.monotonic(), **fields}) + "\n")
        out.flush()
        os.fsync(out.fileno())

    note("init")
    run = trainmon_client.init(
        run=args.run, rank=0, world_size=1, socket_path=args.socket, flush_interval=0.0
    )
    time.sleep(args.startup)
    if args.restore:
        t0 = time.monotonic()
        time.sleep(args.restore)
        seconds = time.monotonic() - t0
        run.checkpoint(args.first - 1, seconds=seconds, restore=True)
        note("restore", seconds=seconds, step=args.first - 1)
    waits: list[float] = []

    def loader() -> Iterator[int]:
        step = args.first
        while True:
            t0 = time.monotonic()
            time.sleep(args.data)
            waits.append(time.monotonic() - t0)
            yield step
            step += 1

    for step in run.timed(loader()):
        t0 = time.monotonic()
        time.sleep(args.compute)
        compute = time.monotonic() - t0
        run.log(step, loss=1.0 / step)
        note("step", step=step, wait=waits[-1], compute=compute)
        if step % args.save_every == 0:
            t0 = time.monotonic()
            time.sleep(args.save)
            seconds = time.monotonic() - t0
            run.checkpoint(step, seconds=seconds)
            note("save", step=step, seconds=seconds)
        if step == args.pause_at:
            time.sleep(args.pause)
            note("pause", seconds=args.pause)
        if step == args.kill_after:
            time.sleep(0.2)  # the step reaches the exporter (flush_interval 0 sends at once)
            note("kill")
            os.kill(os.getpid(), signal.SIGKILL)
        if step >= args.last:
            break
    run.finish()
    note("finish")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
