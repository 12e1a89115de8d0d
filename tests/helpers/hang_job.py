"""One rank of a torch.distributed gloo job on CPU that hangs: the hangs' end-to-end test.

    python tests/helpers/hang_job.py --rank R --world 4 --port P --socket S --run ID \\
        --stuck 2 --at 25 --how sleep|spin

Every rank steps (a data-loading function, then an all-reduce, then ``Run.log()``). At step
``--at`` rank ``--stuck`` never gets its batch: ``load_batch`` waits in a C call that
released the GIL (``--how sleep``) or spins in pure Python holding it (``--how spin``), so
the other ranks wait inside the all-reduce for it. Each rank prints one JSON line when it
reaches the hang (``{"rank": R, "hung_at": step}``) and then runs until it is killed.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import trainmon_client

HOURS = 3600.0


def load_batch(step: int, stuck: bool, how: str) -> torch.Tensor:
    """The data loader: a batch a step, or, for the stuck rank, none ever."""
    if stuck and how == "sleep":
        time.sleep(HOURS)  # a read that never returns (a C call that released the GIL)
    elif stuck:
        n = 0
        while True:  # a loop that never ends, in pure Python: it holds the GIL
            n += 1
    time.sleep(0.03)
    return torch.full((256,), float(step))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--local-rank", type=int, default=0)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--stuck", type=int, required=True)
    ap.add_argument("--at", type=int, default=25)
    ap.add_argument("--how", choices=("sleep", "spin"), default="sleep")
    args = ap.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    run = trainmon_client.init(
        run=args.run,
        rank=args.rank,
        local_rank=args.local_rank,
        world_size=args.world,
        socket_path=args.socket,
        flush_interval=0.2,
        dtype="fp32",
    )
    for step in range(10_000):
        if step == args.at:
            print(json.dumps({"rank": args.rank, "hung_at": step}), flush=True)
        batch = load_batch(step, args.rank == args.stuck and step >= args.at, args.how)
        dist.all_reduce(batch)
        run.log(step, loss=1.0 / (1 + step), tokens=256)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
