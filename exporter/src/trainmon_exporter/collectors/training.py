"""Per-(run, rank) training series, built from :class:`~trainmon_exporter.state.Store`.

Every series carries ``run`` and ``rank``; identity (hostname, GPU UUID, world size) lives in
``trainmon_rank_info``. Step-level events are counters (a NaN between two scrapes still moves
them); every event counter of a rank exists at 0 from its first message.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.metrics_core import Metric

from trainmon_exporter import derive
from trainmon_exporter.collectors import CollectorContext, register
from trainmon_exporter.state import NONFINITE_FIELDS, RankState

RL = ["run", "rank"]

# (name, help, value of a state or None to omit the sample)
_GAUGES: tuple[tuple[str, str, Callable[[RankState], float | None]], ...] = (
    (
        "trainmon_run_up",
        "1 while the rank's client is connected, 0 after it disconnected.",
        lambda s: 1.0 if s.connected else 0.0,
    ),
    (
        "trainmon_run_start_timestamp_seconds",
        "When the client process called init() (Unix s, client field started_at).",
        lambda s: s.started_at,
    ),
    (
        "trainmon_train_step",
        "Last step number the client logged (client field step).",
        lambda s: None if s.step is None else float(s.step),
    ),
    (
        "trainmon_train_last_step_timestamp_seconds",
        "Wall time of the last logged step's log() call (Unix s, client clock).",
        lambda s: s.last_step_time,
    ),
    (
        "trainmon_train_loss",
        "Last training loss (client field loss).",
        lambda s: s.values.get("loss"),
    ),
    (
        "trainmon_train_learning_rate",
        "Last learning rate (client field lr).",
        lambda s: s.values.get("lr"),
    ),
    (
        "trainmon_train_grad_norm",
        "Last global gradient L2 norm (client field grad_norm).",
        lambda s: s.values.get("grad_norm"),
    ),
    (
        "trainmon_train_memory_allocated_bytes",
        "Memory the rank's tensors hold (client field mem_allocated, e.g. "
        "torch.cuda.memory_allocated()).",
        lambda s: s.values.get("mem_allocated"),
    ),
    (
        "trainmon_train_memory_reserved_bytes",
        "Memory its allocator reserved (client field mem_reserved, e.g. "
        "torch.cuda.memory_reserved()).",
        lambda s: s.values.get("mem_reserved"),
    ),
    (
        "trainmon_train_memory_peak_bytes",
        "Peak memory the rank's tensors held since the process started (client field "
        "mem_peak; init(cuda_memory=True) sends torch.cuda.memory_stats() "
        "allocated_bytes.all.peak).",
        lambda s: s.values.get("mem_peak"),
    ),
    (
        "trainmon_train_batch_size",
        "Samples per step (client field batch_size).",
        lambda s: s.values.get("batch_size"),
    ),
    (
        "trainmon_train_sequence_length",
        "Tokens per sample (client field seq_len).",
        lambda s: s.values.get("seq_len"),
    ),
)

# Counters the client sends only when it reads the CUDA allocator (omitted otherwise).
_OPTIONAL_COUNTERS: tuple[tuple[str, str, str], ...] = (
    (
        "trainmon_train_allocator_retries",
        "alloc_retries",
        "cudaMalloc retries after the caching allocator freed its cache (client field "
        "alloc_retries; torch.cuda.memory_stats() num_alloc_retries): memory pressure before "
        "an OOM.",
    ),
    (
        "trainmon_train_oom_errors",
        "ooms",
        "CUDA out-of-memory errors the allocator raised (client field ooms; "
        "torch.cuda.memory_stats() num_ooms).",
    ),
)

_COUNTERS: tuple[tuple[str, str, Callable[[RankState], float]], ...] = (
    (
        "trainmon_train_steps",
        "Steps logged by the client process (cumulative on the wire).",
        lambda s: float(s.steps_total),
    ),
    (
        "trainmon_train_tokens",
        "Tokens processed: running sum of the client's per-step tokens (or batch_size x seq_len).",
        lambda s: s.tokens_total,
    ),
    (
        "trainmon_train_samples",
        "Samples processed: running sum of the client's per-step samples (or batch_size).",
        lambda s: s.samples_total,
    ),
    (
        "trainmon_client_overhead_seconds",
        "Seconds the client cost its trainer: wall time inside its calls plus its flusher "
        "thread's CPU time (s, cumulative on the wire).",
        lambda s: s.overhead_total,
    ),
    (
        "trainmon_client_sent_messages",
        "Steps, evaluations, checkpoints, tracked operations and watch checks the client "
        "handed to its socket, over every connection (client TOTALS record, cumulative).",
        lambda s: float(s.sent_total),
    ),
    (
        "trainmon_ingest_messages_unapplied",
        "Records the client reported sent on its connections to this exporter that this "
        "exporter never applied: refused, dropped or never received (client TOTALS record "
        "sent_connection less records applied; resets with the exporter).",
        lambda s: float(s.unapplied_total),
    ),
    (
        "trainmon_client_refused_values",
        "Values (or whole steps) the client refused: bad name, non-scalar value, bad step "
        "number (a string or bool too), a NaN, infinite or negative tokens or samples "
        "increment, over its name cap.",
        lambda s: float(s.refused_values),
    ),
    (
        "trainmon_run_crashes",
        "Times the rank ended without a clean finish: disconnected "
        "without a FINISH record, or finished with an uncaught exception.",
        lambda s: float(s.crashes),
    ),
    (
        "trainmon_run_restarts",
        "Times the rank restarted: its step number went backward (a checkpoint reload) or a "
        "new process resumed it. The loss, gradient, step-time and throughput statistics "
        "start over at each one, so a restart is not judged as a spike or a divergence.",
        lambda s: float(s.analytics.restarts),
    ),
)


@register("training")
class TrainingCollector:
    """Builds the training families from the store (one lock hold per scrape)."""

    name = "training"

    def __init__(self, ctx: CollectorContext) -> None:
        self.store = ctx.store
        self.window_s = ctx.settings.rate_window_seconds

    def collect(self) -> Iterable[Metric]:
        """Return every training family (types and units: docs/metrics.md)."""
        now = time.time()
        gauges = [(GaugeMetricFamily(n, h, labels=RL), f) for n, h, f in _GAUGES]
        counters = [(CounterMetricFamily(n, h, labels=RL), f) for n, h, f in _COUNTERS]
        optional = [(CounterMetricFamily(n, h, labels=RL), k) for n, k, h in _OPTIONAL_COUNTERS]
        rank_info = GaugeMetricFamily(
            "trainmon_rank_info",
            "Always 1; identity of a rank: node, local rank, world size, GPU UUID (NVML "
            "format, from the client), client version and training dtype. Join on uuid with "
            "GPU series.",
            labels=[
                "run",
                "rank",
                "local_rank",
                "world_size",
                "hostname",
                "uuid",
                "client_version",
                "dtype",
            ],
        )
        run_info = GaugeMetricFamily(
            "trainmon_run_info",
            "Always 1; one per run, with its world size.",
            labels=["run", "world_size"],
        )
        world_size = GaugeMetricFamily(
            "trainmon_run_world_size",
            "Ranks the run was launched with (count): the largest world size its ranks on this "
            "exporter reported (client WORLD_SIZE). Compare with the sum of trainmon_run_up.",
            labels=["run"],
        )
        tps = GaugeMetricFamily(
            "trainmon_train_tokens_per_second",
            "Tokens/s over rate_window_seconds: delta tokens / delta client wall time; 0 when "
            "no step arrived within the window.",
            labels=RL,
        )
        sps = GaugeMetricFamily(
            "trainmon_train_samples_per_second",
            "Samples/s over rate_window_seconds (as tokens/s).",
            labels=RL,
        )
        ovr = GaugeMetricFamily(
            "trainmon_client_overhead_ratio",
            "Share of wall time the client cost its trainer over rate_window_seconds "
            "(delta overhead s / delta wall s; budget: under 0.01).",
            labels=RL,
        )
        step_hist = HistogramMetricFamily(
            "trainmon_train_step_duration_seconds",
            "Time of one training step (s): the time between consecutive log() calls of a rank "
            "(client time.perf_counter) over the steps between them.",
            labels=RL,
        )
        nonfinite = CounterMetricFamily(
            "trainmon_train_nonfinite_values",
            "Logged values that were NaN or infinite, by field (loss, grad_norm, lr, or custom "
            "for any custom metric).",
            labels=["run", "rank", "field"],
        )
        dropped = CounterMetricFamily(
            "trainmon_client_dropped_messages",
            "Steps, evaluations, checkpoints and tracked operations the client could not "
            "deliver: reason=disconnected (no exporter reachable), backpressure (buffer full "
            "or finish() deadline), encode_error (a value out of range), in_flight (sent on a "
            "connection that ended before the exporter read them: an upper bound).",
            labels=["run", "rank", "reason"],
        )
        custom = GaugeMetricFamily(
            "trainmon_train_custom_value",
            "Last value of a custom scalar the client logged under that name (capped at "
            "max_custom_metrics names per rank).",
            labels=["run", "rank", "name"],
        )
        runs: dict[str, int] = {}
        buckets = self.store.buckets
        for s in self.store.iter_ranks():
            labels = [s.run, str(s.rank)]
            runs[s.run] = max(runs.get(s.run, 0), s.world_size)
            for fam, fn in gauges:
                v = fn(s)
                if v is not None:
                    fam.add_metric(labels, v)
            for cfam, cfn in counters:
                cfam.add_metric(labels, cfn(s))
            for ofam, key in optional:
                v = s.values.get(key)
                if v is not None:
                    ofam.add_metric(labels, v)
            rank_info.add_metric(
                [
                    s.run,
                    str(s.rank),
                    str(s.local_rank),
                    str(s.world_size),
                    s.hostname,
                    s.gpu_uuid or "",
                    s.client_version,
                    s.dtype,
                ],
                1.0,
            )
            rates = derive.rates(s, now, self.window_s)
            if rates is not None:
                tps.add_metric(labels, rates.tokens_per_second)
                sps.add_metric(labels, rates.samples_per_second)
                ovr.add_metric(labels, rates.client_overhead_ratio)
            step_hist.add_metric(labels, _cumulative(buckets, s.hist_counts), s.hist_sum)
            for field in NONFINITE_FIELDS:
                nonfinite.add_metric([*labels, field], float(s.nonfinite[field]))
            dropped.add_metric([*labels, "disconnected"], float(s.dropped_disconnected))
            dropped.add_metric([*labels, "backpressure"], float(s.dropped_backpressure))
            dropped.add_metric([*labels, "encode_error"], float(s.dropped_encode_error))
            dropped.add_metric([*labels, "in_flight"], float(s.dropped_in_flight))
            for name, v in s.custom.items():
                if v is not None:  # None: name bound, no value yet
                    custom.add_metric([*labels, name], v)
        for run, world in runs.items():
            run_info.add_metric([run, str(world)], 1.0)
            world_size.add_metric([run], float(world))
        out: list[Any] = [fam for fam, _ in gauges]
        out += [fam for fam, _ in counters]
        out += [fam for fam, _ in optional]
        out += [
            rank_info,
            run_info,
            world_size,
            tps,
            sps,
            ovr,
            step_hist,
            nonfinite,
            dropped,
            custom,
        ]
        return out


def _cumulative(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, float]]:
    """Prometheus histogram buckets from per-bucket counts (last entry: +Inf)."""
    out = []
    acc = 0
    for bound, n in zip(bounds, counts[:-1], strict=True):
        acc += n
        out.append((_fmt(bound), float(acc)))
    acc += counts[-1]
    out.append(("+Inf", float(acc)))
    return out


def _fmt(bound: float) -> str:
    return repr(float(bound))
