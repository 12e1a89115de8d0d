"""Building blocks of the exporter's tests: hand-made records, small stores, counter reads.

Packets are built with :mod:`trainmon_client._protocol`, as a trainer would send them; the
stores and rank states are the exporter's own, made small so tests can fill them by hand.
"""

from __future__ import annotations

import time
from typing import Any

from trainmon_client import _protocol as P
from trainmon_exporter.analytics import AnalyticsSettings, RankAnalytics
from trainmon_exporter.state.rank import RankState
from trainmon_exporter.state.store import Store

from ..conftest import InProcessExporter, connect, sample, wait_for

HELLO: dict[str, Any] = {
    "run": "raw",
    "rank": 0,
    "local_rank": 0,
    "world_size": 1,
    "hostname": "h",
    "pid": 1,
    "client_version": "test",
    "gpu_uuid": None,
    "started_at": 1.0,
    "flops_per_token": None,
    "dtype": "bf16",
}
"""A valid HELLO object (run ``raw``, rank 0 of 1)."""


def hello(**kw: Any) -> bytes:
    """A HELLO record: :data:`HELLO` with ``kw`` replacing or adding keys."""
    return P.encode_hello(HELLO | kw)


def pkt(*records: bytes) -> bytes:
    """A packet: the header, then ``records`` as they are."""
    return P.packet_header() + b"".join(records)


def step(n: int, ids: tuple[int, ...] = (1,), values: tuple[float, ...] = (1.0,)) -> bytes:
    """A STEP record of step ``n`` (wall time ``1 + n``, 0.1 s step time, 10 tokens a step)."""
    s = P.step_struct(len(ids))
    head = (n, n, 1.0 + n, 0.1, 10.0 * n, float(n), 0.0, 0, 0, 0)
    return s.pack(P.STEP, P.step_payload_length(len(ids)), *head, *ids, *values)


def invalid(ex: InProcessExporter, reason: str) -> float:
    """``trainmon_ingest_messages_invalid_total{reason}`` of ``ex`` now."""
    return sample(ex.metrics(), "trainmon_ingest_messages_invalid_total", reason=reason) or 0.0


def dropped(ex: InProcessExporter, reason: str) -> float:
    """``trainmon_ingest_values_dropped_total{reason}`` of ``ex`` now."""
    return sample(ex.metrics(), "trainmon_ingest_values_dropped_total", reason=reason) or 0.0


def store_of(ttl_s: float = 60, **limits: Any) -> Store:
    """A small store (8 ranks, 8 custom metrics, one histogram bucket); ``limits`` override."""
    kw: dict[str, Any] = {
        "max_ranks": 8,
        "max_custom_metrics": 8,
        "buckets": (1.0,),
        "window_s": 30,
        "ttl_s": ttl_s,
    }
    return Store(**(kw | limits))


def make_state(**analytics: Any) -> RankState:
    """A bare rank state (run ``r``, rank 0), for feeding synthetic records."""
    return RankState(
        run="r",
        rank=0,
        local_rank=0,
        world_size=1,
        hostname="h",
        pid=1,
        client_version="t",
        gpu_uuid=None,
        started_at=0.0,
        flops_per_token=None,
        dtype="bf16",
        buckets=(1.0,),
        analytics=RankAnalytics(AnalyticsSettings(**analytics)),
    )


def scripted_session(ex: InProcessExporter, run: str = "scripted", ranks: int = 2) -> None:
    """Two ranks of one run with every kind of record, a NaN, and rank 0 finished."""
    for rank in range(ranks):
        r = connect(ex, run, rank=rank, world_size=ranks, num_params=10_000)
        for i in range(20):
            r.log(
                i,
                loss=3.0 - 0.1 * i,
                lr=1e-3,
                grad_norm=0.7,
                tokens=512,
                samples=4,
                batch_size=4,
                seq_len=128,
                **{"opt/update_ratio": 1e-3, "moe.aux": 0.01},
            )
            time.sleep(0.03)  # 20 steps span 0.6 s: enough for rates
            if i == 9:
                with r.track("validation"):
                    r.eval(i, val_loss=2.5, accuracy=0.4)
                r.checkpoint(i, seconds=0.25)
        r.log(20, loss=float("nan"))
        if rank == 0:
            r.finish()
    wait_for(lambda: all((k := ex.rank(run, i)) and k["step"] == 20 for i in range(ranks)))
