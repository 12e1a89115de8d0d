"""The JSON API's schema (``/api/v1/runs``, ``/api/v1/gpus``) and the snapshots that fill it.

Why this module is one module of about 650 lines: it is the API's schema, every model the
three views share with the field documentation ``/openapi.json`` serves (a rank, its goodput,
its hang evidence, a run and its merged hang view, a GPU), and the builders that fill them
from the state; a model and the builder that fills it change together.

These models are the view model every view shares: the API serves them, the status page
renders them and ``trainmon status`` parses the API's JSON back into them. The terminal
imports this module for the models alone, so the builders (:func:`snapshot`,
:func:`gpu_snapshot`) import what they read (the store, :mod:`~trainmon_exporter.derive`, the
NVML sampler) when they run, not with the module.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from trainmon_exporter import derive
    from trainmon_exporter.sampler import GpuSample, GpuSnapshot
    from trainmon_exporter.settings import AnalyticsSettings
    from trainmon_exporter.state.evidence import Evidence
    from trainmon_exporter.state.rank import RankState
    from trainmon_exporter.state.store import Store


class EventView(BaseModel):
    """One detector firing."""

    kind: str = Field(description="e.g. nonfinite_loss, loss_spike_severe, hang, crash")
    step: int | None = Field(description="last training step the exporter had seen")
    time: float = Field(description="when the exporter detected it (Unix s)")
    value: float | None = Field(description="the value that fired it, when there is one")
    count: int = Field(description="consecutive firings of this kind merged into this event")
    last_step: int | None = Field(description="step of the latest of those firings")


class TrendMark(BaseModel):
    """Something that happened on a point of a :class:`TrendView`."""

    index: int = Field(description="the point it falls on")
    kind: str = Field(
        description="nonfinite (a NaN or infinite loss), spike (a loss spike), hang (no step "
        "for longer than usual after this one) or restart (a new process or a rollback)"
    )
    step: int = Field(description="the training step it happened at")


class TrendView(BaseModel):
    """A rank's recent logged steps for sparklines, oldest first, one entry per point.

    At most 60 points over the rank's last 240 logged steps (a point groups consecutive
    steps once there are more than 60).
    """

    steps: list[int] = Field(default=[], description="last training step of each point")
    loss: list[float | None] = Field(
        default=[], description="mean finite loss of the point; null: none (see marks)"
    )
    tokens_per_second: list[float | None] = Field(
        default=[], description="tokens / client wall time over the point's steps"
    )
    marks: list[TrendMark] = Field(default=[], description="by point index")
    goodput: list[float | None] = Field(
        default=[],
        description="the rank's goodput ratio so far at the point's last step, as "
        "goodput.ratio: (productive + uncheckpointed) / accounted seconds; null: none yet",
    )


class GoodputView(BaseModel):
    """Where a rank's wall-clock went since its ``init()`` (seconds; docs/goodput.md)."""

    ratio: float | None = Field(
        description="(productive + uncheckpointed) / everything accounted: the share that "
        "trained, counting uncheckpointed step time as good until a crash loses it"
    )
    productive_seconds: float = Field(description="step time kept by a checkpoint or a finish")
    uncheckpointed_seconds: float = Field(description="step time not yet kept")
    at_risk_seconds: float = Field(
        default=0.0,
        description="step time not yet kept of a process that ended without a clean finish: "
        "lost unless a restart here resumes past it (counted as wasted_progress in ratio)",
    )
    badput_seconds: dict[str, float] = Field(description="seconds by badput kind")
    largest_badput: str | None = Field(description="the badput kind with the most seconds")
    data_loading_measured: bool = Field(
        default=True,
        description="the rank reported its data waits (Run.timed, data_time); false: its data "
        "loading is inside its step time, not measured",
    )
    data_loading_share: float | None = Field(
        description="data waits over step time in the rate window (0..1)"
    )
    input_bound: bool | None = Field(description="data_loading_share above input_bound_ratio")


class FrameView(BaseModel):
    """One frame of a Python stack, as the trainer's interpreter names it."""

    file: str
    line: int
    function: str = Field(description="its qualified name (Python 3.11+), e.g. Trainer.fit")
    user: bool = Field(
        description="the user's code: not the standard library, site-packages or trainmon"
    )


class ThreadView(BaseModel):
    """One thread of a hung rank's process when its capture was taken."""

    name: str
    id: int = Field(description="threading.get_ident()")
    training: bool = Field(description="the thread that calls Run.log()")
    state: str | None = Field(description="scheduler state: R running, S sleeping, D disk")
    cpu: float | None = Field(description="share of a core it used over 0.1 s before the capture")
    frames: list[FrameView] = Field(description="outermost first")
    omitted: int = Field(description="outermost frames left out (at most 128 kept)")


class PendingCollectiveView(BaseModel):
    """The oldest collective of a process group that had not completed (Flight Recorder)."""

    seq: int = Field(description="its sequence id (p2p: the point-to-point one)")
    op: str = Field(description="e.g. nccl:all_reduce, gloo:all_reduce")
    p2p: bool
    sizes: list[list[int]] = Field(description="input tensor shapes")
    out_sizes: list[list[int]] = Field(description="output tensor shapes")
    dtypes: list[str]
    state: str = Field(description="the recorder's: scheduled, started")
    seconds: float | None = Field(description="since it was enqueued, at the capture")


class ProcessGroupView(BaseModel):
    """One process group in a hung rank's Flight Recorder (-1: a state it does not track)."""

    id: str
    name: str = Field(description="its description, e.g. default_pg")
    enqueued: int = Field(description="last collective sequence id enqueued")
    started: int = Field(description="last started (-1 under gloo)")
    completed: int = Field(description="last completed")
    pending: PendingCollectiveView | None


class HangView(BaseModel):
    """A rank's last hang episode: what it answered when asked (docs/hangs.md).

    Kept after the rank recovers, finishes or crashes, until it expires.
    """

    hung: bool = Field(description="the rank is hung now")
    status: str = Field(description="pending (asked), captured, or no_answer")
    step: int | None = Field(description="its last step when it was judged hung")
    requested_at: float = Field(description="when it was asked (Unix s)")
    answered_at: float | None
    frame: str | None = Field(
        description="the training thread's innermost frame in the user's code, as "
        "trainmon_hang_frame_info's frame label: function (file:line), or (no answer)"
    )
    collective: str = Field(description="the collective it waits in, or empty")
    threads: list[ThreadView] = Field(description="the training thread first")
    threads_omitted: int
    distributed: str | None = Field(
        description="torch.distributed's Flight Recorder: ok, recorder_off, error; null when "
        "torch.distributed was not in use"
    )
    distributed_detail: str
    groups: list[ProcessGroupView]
    notes: list[str] = Field(description="what could not be captured and why")
    capture_seconds: float | None = Field(description="what the capture cost the trainer")
    gpu_power_watts: float | None = Field(description="its GPU's power when it answered")
    gpu_power_limit_watts: float | None
    gpu_sm_active_ratio: float | None = Field(description="GPM SM activity when it answered")
    native: str | None = Field(description="py-spy dump --native (hang_native_stacks)")


class StackView(BaseModel):
    """One distinct stack of a hung run's training threads, with the ranks in it."""

    headline: str = Field(description='e.g. "3 ranks in all_reduce, 1 not"')
    ranks: list[int]
    not_in: int = Field(description="ranks of the run not in this stack")
    function: str = Field(description="its innermost function, or (no answer)")
    frame: str | None = Field(description="its innermost frame in the user's code")
    collective: str = Field(description="the collective most of its ranks wait in, or empty")
    suspect: bool = Field(description="its ranks are suspects")
    frames: list[FrameView] = Field(description="outermost first")


class RunHangView(BaseModel):
    """A hung run's merged view: each distinct stack once, the suspects first.

    Suspects, as the recording rules name them: a rank whose last collective sequence id
    (started, else enqueued) lags the maximum of its process group among the ranks seen, or
    whose frame differs from the one frame most of them share.
    """

    state: str = Field(description="hung (a rank is hung now), recovered, or ended")
    since: float = Field(description="when the first of its ranks was asked (Unix s)")
    hung: int = Field(description="its ranks hung now")
    seen: int = Field(description="its ranks with evidence here")
    world_size: int
    suspects: list[int]
    frame: str | None = Field(description="the frame most of its ranks share")
    collective: str | None = Field(description="the collective most of its ranks wait in")
    stacks: list[StackView]


class RankView(BaseModel):
    """One rank as the API shows it. Times are Unix seconds; rates are per second."""

    rank: int
    local_rank: int
    world_size: int
    hostname: str
    gpu_uuid: str | None
    gpu: int | None = Field(description="NVML index of the rank's GPU, joined on gpu_uuid")
    dtype: str = Field(description="training dtype MFU is judged against")
    up: bool = Field(description="client connected now")
    status: str = Field(description="running, finished, failed (exception) or crashed")
    step: int | None
    last_step_time: float | None
    seconds_since_last_step: float | None
    steps_total: int
    tokens_total: float
    samples_total: float
    tokens_per_second: float | None = Field(
        description="over rate_window_seconds; null before a rate means anything and once the "
        "rank no longer runs (finished, failed, crashed or disconnected: see status and up)"
    )
    samples_per_second: float | None = Field(description="as tokens_per_second")
    client_overhead_ratio: float | None = Field(description="as tokens_per_second")
    step_time_mean_seconds: float | None
    model_flops_per_second: float | None = Field(description="tokens/s x flops_per_token")
    mfu_ratio: float | None = Field(description="model FLOP/s / peak dense FLOP/s")
    mfu_unavailable_reason: str | None = Field(description="why mfu_ratio is null")
    gpu_memory_used_bytes: float | None = Field(description="NVML memory of the rank's process")
    loss_ema: float | None = Field(description="EMA of the loss (analytics ema_decay)")
    values: dict[str, float | None] = Field(description="last loss, lr, grad_norm, ...")
    custom: dict[str, float | None]
    nonfinite: dict[str, int]
    dropped: dict[str, int]
    refused_values: int
    crashes: int
    health: list[str] = Field(description="human-readable problems seen on this rank")
    events: list[EventView] = Field(description="recent detector firings, oldest first")
    goodput: GoodputView | None = Field(
        default=None, description="where the rank's time went (null from older exporters)"
    )
    trend: TrendView = Field(
        default_factory=TrendView, description="recent steps for the views' sparklines"
    )
    hang: HangView | None = Field(
        default=None, description="its last hang episode's evidence (null: none)"
    )


class JobView(BaseModel):
    """The whole job across nodes, from the recording rules (docs/goodput.md#the-whole-job)."""

    goodput_ratio: float | None = Field(
        default=None, description="run:trainmon_train_goodput:ratio, over the run's life"
    )
    goodput_ratio_1h: float | None = Field(
        default=None, description="run:trainmon_train_goodput:ratio_1h, over the last hour"
    )
    badput_seconds: dict[str, float] = Field(
        default={}, description="run:trainmon_train_badput_seconds:sum, rank-seconds by kind"
    )
    waits_on_rank: int | None = Field(
        default=None,
        description="the rank the job waits on for its input over the last 5 minutes "
        "(run:trainmon_train_badput_seconds:data_loading_critical_rank)",
    )
    waits_on_hostname: str | None = Field(default=None, description="where that rank runs")


class RunView(BaseModel):
    """A run and its ranks."""

    run: str
    namespace: str = Field(
        default="",
        description="the Kubernetes namespace its clients reported; a run is its namespace's "
        '(another namespace\'s run of the same id is another run); "" off Kubernetes',
    )
    world_size: int
    owner_uid: int | None = Field(
        description="uid of the process that opened the run (SO_PEERCRED, in the exporter's "
        "user namespace); only that uid may add or resume its ranks"
    )
    goodput_ratio: float | None = Field(
        default=None,
        description="the job's goodput over the ranks this exporter holds (and those it keeps "
        "after they left): good step time over everything accounted, at the job's critical "
        "path (docs/goodput.md); the whole job across nodes: run:trainmon_train_goodput:ratio",
    )
    largest_badput: str | None = Field(
        default=None, description="the badput kind with the most seconds"
    )
    badput_seconds: dict[str, float] = Field(
        default={}, description="the job's badput by kind, in rank-seconds, as goodput_ratio"
    )
    collective_wait_seconds: float = Field(
        default=0.0,
        description="rank-seconds fast ranks waited in a collective for the slowest loader: the "
        "job's data_loading, not good step time",
    )
    waits_on_rank: int | None = Field(
        default=None,
        description="the rank with the largest share of its time waiting for data over the "
        "rate window: the one a synchronous job waits on",
    )
    data_loading_unmeasured: list[int] = Field(
        default=[], description="ranks that never reported their data waits"
    )
    departed_ranks: list[int] = Field(
        default=[],
        description="ranks that left without a clean finish whose accounting this exporter "
        "keeps (goodput_retention_seconds), counted in goodput_ratio",
    )
    job: JobView | None = Field(
        default=None,
        description="the whole job's figures across nodes, read from the Prometheus at "
        "prometheus_url; null: not set, not answering, or no figures yet",
    )
    ranks: list[RankView]
    hang: RunHangView | None = Field(
        default=None, description="the merged view of its ranks' hang evidence (null: none)"
    )

    @property
    def label(self) -> str:
        """The run as the views show it: ``namespace/run`` in a namespace, else the id."""
        return f"{self.namespace}/{self.run}" if self.namespace else self.run


class RunsResponse(BaseModel):
    """Body of ``GET /api/v1/runs``."""

    time: float
    runs: list[RunView]


def _num(v: float | None) -> float | None:
    """JSON has no NaN/Inf: report them as null (the counters say they happened)."""
    return v if v is not None and math.isfinite(v) else None


def _rank_view(
    s: RankState,
    now: float,
    window_s: float,
    gpus: dict[str, GpuSample],
    pids: dict[int, float],
    override: float | None,
    cfg: AnalyticsSettings,
) -> RankView:
    from trainmon_exporter import derive

    # A rank that stopped has no current rate (null, not the 0 the exported gauge reads).
    rates = None if derive.stopped(s) else derive.rates(s, now, window_s)
    m, g = derive.mfu(s, None if rates is None else rates.tokens_per_second, gpus, override)
    return RankView(
        rank=s.rank,
        local_rank=s.local_rank,
        world_size=s.world_size,
        hostname=s.hostname,
        gpu_uuid=s.gpu_uuid,
        gpu=None if g is None else g.index,
        dtype=s.dtype,
        up=s.connected,
        status=s.status,
        step=s.step,
        last_step_time=s.last_step_time,
        seconds_since_last_step=None if s.last_step_time is None else now - s.last_step_time,
        steps_total=s.steps_total,
        tokens_total=s.tokens_total,
        samples_total=s.samples_total,
        tokens_per_second=None if rates is None else rates.tokens_per_second,
        samples_per_second=None if rates is None else rates.samples_per_second,
        client_overhead_ratio=None if rates is None else rates.client_overhead_ratio,
        step_time_mean_seconds=s.hist_sum / s.hist_count if s.hist_count else None,
        model_flops_per_second=m.model_flops,
        mfu_ratio=m.mfu,
        mfu_unavailable_reason=m.reason or None,
        loss_ema=_num(s.analytics.ema),
        gpu_memory_used_bytes=pids.get(derive.process_pid(s)),
        values={k: _num(v) for k, v in s.values.items()},
        custom={k: _num(v) for k, v in s.custom.items()},
        nonfinite=dict(s.nonfinite),
        dropped={
            "disconnected": s.dropped_disconnected,
            "backpressure": s.dropped_backpressure,
            "encode_error": s.dropped_encode_error,
            "in_flight": s.dropped_in_flight,
        },
        refused_values=s.refused_values,
        crashes=s.crashes,
        health=derive.findings(s, m),
        goodput=_goodput_view(s, window_s, cfg),
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


def hang_view(ev: Evidence, hung: bool) -> HangView:
    """The API view of a rank's hang :class:`~trainmon_exporter.state.evidence.Evidence`."""
    c = ev.capture
    threads = [] if c is None else c.threads
    dist = None if c is None else c.collectives
    gpu = ev.gpu
    notes = [] if c is None else list(c.notes)
    if ev.note:
        notes.insert(0, ev.note)
    return HangView(
        hung=hung,
        status=ev.status,
        step=ev.step,
        requested_at=ev.requested_at,
        answered_at=ev.answered_at,
        frame=ev.label(),
        collective=ev.collective(),
        threads=[
            ThreadView(
                name=t.name,
                id=t.id,
                training=t.training,
                state=t.state,
                cpu=t.cpu,
                frames=[FrameView(file=f, line=n, function=fn, user=u) for f, n, fn, u in t.frames],
                omitted=t.omitted,
            )
            for t in threads
        ],
        threads_omitted=0 if c is None else c.threads_omitted,
        distributed=None if dist is None else dist.state,
        distributed_detail="" if dist is None else dist.detail,
        groups=[
            ProcessGroupView(
                id=g.id,
                name=g.name,
                enqueued=g.enqueued,
                started=g.started,
                completed=g.completed,
                pending=None
                if g.pending is None
                else PendingCollectiveView(**g.pending.model_dump()),
            )
            for g in ([] if dist is None else dist.groups)
        ],
        notes=notes,
        capture_seconds=None if c is None else c.seconds,
        gpu_power_watts=None if gpu is None else gpu.power_watts,
        gpu_power_limit_watts=None if gpu is None else gpu.power_limit_watts,
        gpu_sm_active_ratio=None if gpu is None else gpu.sm_active_ratio,
        native=ev.native,
    )


def _goodput_view(s: RankState, window_s: float, cfg: AnalyticsSettings) -> GoodputView:
    from trainmon_exporter import derive

    g = s.goodput
    largest = g.largest_badput()
    return GoodputView(
        ratio=g.optimistic_ratio(),
        productive_seconds=g.productive,
        uncheckpointed_seconds=g.uncheckpointed,
        at_risk_seconds=g.at_risk,
        badput_seconds=dict(g.badput),
        largest_badput=None if largest is None else largest[0],
        data_loading_measured=g.data_seen,
        data_loading_share=g.data_share(time.monotonic(), window_s),
        input_bound=derive.input_bound(s, window_s, cfg),
    )


def trend_view(t: derive.Trend) -> TrendView:
    """The API view of a rank's :func:`~trainmon_exporter.derive.trend`."""
    return TrendView(
        steps=t.steps,
        loss=[_num(v) for v in t.loss],
        tokens_per_second=[_num(v) for v in t.tokens_per_second],
        marks=[TrendMark(index=i, kind=k, step=st) for i, k, st in t.marks],
        goodput=[_num(v) for v in t.goodput],
    )


def snapshot(
    store: Store, gpus: GpuSnapshot | None = None, peak_flops: float | None = None
) -> RunsResponse:
    """Every run with its ranks, sorted by run then rank.

    The store's lock is held a few ranks at a time; the trends are drawn from copies, and
    the hang evidence's views built, after it is released.

    ``gpus`` is the NVML sampler's latest pass (for the rank ↔ GPU join and MFU; ``None``:
    not sampled); ``peak_flops`` the MFU override setting.
    """
    from trainmon_exporter import derive
    from trainmon_exporter.analytics.job import RankTime, job_goodput
    from trainmon_exporter.sampler import NOT_STARTED
    from trainmon_exporter.views.hangs import merged

    if gpus is None:
        gpus = NOT_STARTED
    now = time.time()
    by_uuid = gpus.by_uuid()
    pids = gpus.process_memory()
    runs: dict[tuple[str, str], list[RankView]] = {}
    owners: dict[tuple[str, str], int | None] = {}
    times: dict[tuple[str, str], list[RankTime]] = {}
    copied: list[tuple[RankView, derive.TrendInput]] = []
    mono = time.monotonic()
    evidence: list[tuple[RankView, Evidence, bool]] = []
    for s in store.iter_ranks():
        view = _rank_view(s, now, store.window_s, by_uuid, pids, peak_flops, store.analytics)
        key = (s.namespace, s.run)
        runs.setdefault(key, []).append(view)
        copied.append((view, derive.trend_input(s)))  # a copy: the trend is drawn unlocked
        if s.hang is not None:  # an episode's answer is never changed once in: read unlocked
            evidence.append((view, s.hang, s.analytics.hung and s.connected))
        owners.setdefault(key, s.owner_uid)
        times.setdefault(key, []).append(
            RankTime.of(
                s.rank,
                s.goodput,
                s.connected and s.analytics.is_straggling(),
                s.goodput.data_share(mono, store.window_s) if s.connected else None,
            )
        )
    departed: dict[tuple[str, str], list[int]] = {}
    with store.lock:
        for d in store.ledger:
            key = (d.namespace, d.run)
            if key in runs:
                departed.setdefault(key, []).append(d.rank)
                times[key].append(RankTime.of(d.rank, d.goodput))
    for view, given in copied:
        view.trend = trend_view(derive.trend(given))
    for view, ev, hung in evidence:
        view.hang = hang_view(ev, hung)
    for views in runs.values():
        views.sort(key=lambda v: v.rank)
    return RunsResponse(
        time=now,
        runs=[
            RunView(
                run=r[1],
                namespace=r[0],
                world_size=world,
                owner_uid=owners[r],
                goodput_ratio=job.ratio,
                largest_badput=job.largest,
                badput_seconds=job.badput,
                collective_wait_seconds=job.collective_wait,
                waits_on_rank=job.waits_on,
                data_loading_unmeasured=sorted(job.unmeasured),
                departed_ranks=sorted(departed.get(r, [])),
                ranks=ranks,
                hang=merged(ranks, world),
            )
            for r, ranks in sorted(runs.items())
            for job in (job_goodput(times[r]),)
            for world in (max(v.world_size for v in ranks),)
        ],
    )


class GpuView(BaseModel):
    """One GPU's last NVML sample, in base units (see docs/metrics.md for each source)."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    utilization_ratio: float | None
    memory_used_bytes: float | None
    memory_size_bytes: float | None
    power_usage_watts: float | None
    temperature_celsius: float | None
    sm_clock_hertz: float | None
    tensor_active_ratio: float | None = Field(description="GPM, Hopper and newer")
    slowdown_reasons: list[str] = Field(description="active clock-event reasons that slow it")
    xid_errors: int = Field(description="XID critical errors since the exporter started")


class GpusResponse(BaseModel):
    """Body of ``GET /api/v1/gpus``."""

    time: float
    ok: bool = Field(description="NVML usable")
    error: str = Field(description="why not, when ok is false")
    hint: str = Field(description="what to do about it")
    driver_version: str
    lost_total: int = Field(description="GPUs NVML reported lost; their series are dropped")
    sample_seconds: float = Field(description="wall time of the last sampling pass")
    gpus: list[GpuView]


def gpu_snapshot(snap: GpuSnapshot) -> GpusResponse:
    """The API view of the sampler's latest pass."""
    from trainmon_exporter.nvml import SLOWDOWN_REASONS

    views = []
    for g in snap.gpus:
        r = g.readings
        views.append(
            GpuView(
                index=g.index,
                uuid=g.uuid,
                name=g.name,
                pci_bus_id=g.pci_bus_id,
                utilization_ratio=r.utilization_ratio,
                memory_used_bytes=r.memory_used_bytes,
                memory_size_bytes=r.memory_total_bytes,
                power_usage_watts=r.power_usage_watts,
                temperature_celsius=r.temperature_celsius,
                sm_clock_hertz=r.sm_clock_hertz,
                tensor_active_ratio=r.tensor_active_ratio,
                slowdown_reasons=[r for r in SLOWDOWN_REASONS if g.clock_events.get(r)],
                xid_errors=sum(g.xid.values()),
            )
        )
    return GpusResponse(
        time=time.time(),
        ok=snap.ok,
        error=snap.error,
        hint=snap.hint,
        driver_version=snap.driver_version,
        lost_total=snap.lost_total,
        sample_seconds=snap.sample_seconds,
        gpus=views,
    )
