"""A synchronous data-parallel trainer over gloo whose one rank has a slow input pipeline.

    RANK=r WORLD_SIZE=n python tests/helpers/gloo_trainer.py --socket S --run R --truth FILE \\
        --port P --steps 40 --slow-rank 3 --slow-data 0.15

Each rank waits for its batch through ``Run.timed()`` (``--data`` seconds, ``--slow-data`` on
``--slow-rank``), computes (a small torch model, and ``--compute`` seconds of sleep), then
all-reduces its gradients over gloo, which makes the fast ranks wait for the slow one in the
collective, as a real job does. Every ``--save-every`` steps rank 0 saves (``--save`` seconds)
while the others wait at a barrier; every rank reports the checkpoint. Each rank appends what
it measured to ``--truth``, one JSON object a line stamped with ``time.monotonic()``: ``init``,
each ``step`` (its ``wait``, ``compute``, ``collective``), each ``save``, ``finish``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import trainmon_client


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--truth", required=True)
    ap.add_argument("--port", type=int, required=True, help="the rendezvous TCP port")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--data", type=float, default=0.01, help="s each rank waits for a batch")
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-data", type=float, default=0.15, help="the slow rank's wait (s)")
    ap.add_argument("--compute", type=float, default=0.05, help="s of each step's work")
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--save", type=float, default=0.2, help="s rank 0 takes to save")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = open(args.truth, "a", buffering=1)  # noqa: SIM115 (kept open until the end)

    def note(event: str, **fields: Any) -> None:
        out.write(json.dumps({"ev": event, "rank": rank, "t": time.monotonic(), **fields}) + "\n")

    note("init")
    run = trainmon_client.init(
        run=args.run, rank=rank, world_size=world, socket_path=args.socket, flush_interval=0.0
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world
    )
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    wait = args.slow_data if rank == args.slow_rank else args.data
    waits: list[float] = []

    def loader() -> Iterator[torch.Tensor]:
        while True:
            t0 = time.monotonic()
            time.sleep(wait)
            waits.append(time.monotonic() - t0)
            yield torch.randn(16, 64)

    for step, batch in enumerate(run.timed(loader()), start=1):
        t0 = time.monotonic()
        loss = model(batch).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        time.sleep(args.compute)
        compute = time.monotonic() - t0
        t1 = time.monotonic()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
        collective = time.monotonic() - t1
        opt.step()
        run.log(step, loss=float(loss))
        note("step", step=step, wait=waits[-1], compute=compute, collective=collective)
        if step % args.save_every == 0:
            t0 = time.monotonic()
            if rank == 0:
                time.sleep(args.save)
            dist.barrier()
            seconds = time.monotonic() - t0
            run.checkpoint(step, seconds=seconds)
            note("save", step=step, seconds=seconds)
        if step >= args.steps:
            break
    dist.barrier()
    run.finish()
    note("finish")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
