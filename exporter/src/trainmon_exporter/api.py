"""The JSON API's schema (``/api/v1/runs``) and the snapshot that fills it."""

from __future__ import annotations

import math
import time

from pydantic import BaseModel, Field

from trainmon_exporter.state import RankState, Store


class EventView(BaseModel):
    """One detector firing."""

    kind: str = Field(description="e.g. nonfinite_loss, loss_spike_severe, hang, crash")
    step: int | None = Field(description="last training step the exporter had seen")
    time: float = Field(description="when the exporter detected it (Unix s)")
    value: float | None = Field(description="the value that fired it, when there is one")
    count: int = Field(description="consecutive firings of this kind merged into this event")
    last_step: int | None = Field(description="step of the latest of those firings")


class RankView(BaseModel):
    """One rank as the API shows it. Times are Unix seconds; rates are per second."""

    rank: int
    local_rank: int
    world_size: int
    hostname: str
    gpu_uuid: str | None
    up: bool = Field(description="client connected now")
    status: str = Field(description="running, finished, failed (exception) or crashed")
    step: int | None
    last_step_time: float | None
    seconds_since_last_step: float | None
    steps_total: int
    tokens_total: float
    samples_total: float
    tokens_per_second: float | None
    samples_per_second: float | None
    client_overhead_ratio: float | None
    step_time_mean_seconds: float | None
    values: dict[str, float | None] = Field(description="last loss, lr, grad_norm, ...")
    custom: dict[str, float | None]
    nonfinite: dict[str, int]
    dropped: dict[str, int]
    refused_values: int
    crashes: int
    health: list[str] = Field(description="human-readable problems seen on this rank")
    events: list[EventView] = Field(description="recent detector firings, oldest first")


class RunView(BaseModel):
    """A run and its ranks."""

    run: str
    world_size: int
    ranks: list[RankView]


class RunsResponse(BaseModel):
    """Body of ``GET /api/v1/runs``."""

    time: float
    runs: list[RunView]


def _num(v: float | None) -> float | None:
    """JSON has no NaN/Inf: report them as null (the counters say they happened)."""
    return v if v is not None and math.isfinite(v) else None


def _rank_view(s: RankState, now: float, window_s: float) -> RankView:
    rates = s.rates(now, window_s)
    health = []
    if s.nonfinite["loss"] or s.nonfinite["grad_norm"]:
        health.append(
            f"non-finite values: loss x{s.nonfinite['loss']}, grad_norm x{s.nonfinite['grad_norm']}"
        )
    if s.status == "crashed":
        health.append("disconnected without finishing (crashed or killed)")
    elif s.status == "failed":
        health.append("finished with an uncaught exception")
    a = s.analytics
    if a.hung:
        health.append("hung: no step for longer than usual")
    if a.throughput_dropped:
        health.append("throughput dropped")
    if a.straggling:
        health.append("straggler")
    if s.dropped_disconnected or s.dropped_backpressure:
        health.append(f"client dropped {s.dropped_disconnected + s.dropped_backpressure} messages")
    return RankView(
        rank=s.rank,
        local_rank=s.local_rank,
        world_size=s.world_size,
        hostname=s.hostname,
        gpu_uuid=s.gpu_uuid,
        up=s.connected,
        status=s.status,
        step=s.step,
        last_step_time=s.last_step_time,
        seconds_since_last_step=None if s.last_step_time is None else now - s.last_step_time,
        steps_total=s.steps_total,
        tokens_total=s.tokens_total,
        samples_total=s.samples_total,
        tokens_per_second=None if rates is None else rates[0],
        samples_per_second=None if rates is None else rates[1],
        client_overhead_ratio=None if rates is None else rates[2],
        step_time_mean_seconds=s.hist_sum / s.hist_count if s.hist_count else None,
        values={k: _num(v) for k, v in s.values.items()},
        custom={k: _num(v) for k, v in s.custom.items()},
        nonfinite=dict(s.nonfinite),
        dropped={"disconnected": s.dropped_disconnected, "backpressure": s.dropped_backpressure},
        refused_values=s.refused_values,
        crashes=s.crashes,
        health=health,
        events=[
            EventView(
                kind=e.kind,
                step=e.step,
                time=e.time,
                value=_num(e.value),
                count=e.count,
                last_step=e.last_step,
            )
            for e in s.analytics.events
        ],
    )


def snapshot(store: Store) -> RunsResponse:
    """Every run with its ranks, sorted by run then rank (one lock hold)."""
    now = time.time()
    runs: dict[str, list[RankView]] = {}
    with store.lock:
        for (run, _rank), s in sorted(store.ranks.items()):
            runs.setdefault(run, []).append(_rank_view(s, now, store.window_s))
    return RunsResponse(
        time=now,
        runs=[
            RunView(run=r, world_size=max(v.world_size for v in ranks), ranks=ranks)
            for r, ranks in runs.items()
        ],
    )
