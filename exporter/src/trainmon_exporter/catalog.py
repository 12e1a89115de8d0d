"""The metric catalog: every family the exporter exposes, defined once.

Why this module is one module of over 2,000 lines: it is data, one ``Family`` row per
family with the reference text of docs/metrics.md, and its purpose is to be the single place a
metric is defined. Rows are grouped by collector under section comments; the code is the
``Family`` class and the table renderer at the ends.

A :class:`Family` row is what a metric *is*: its name, type, HELP text and labels, plus what
the reference (docs/metrics.md) says about it: its unit and its meaning and source. The
collectors, the ingest counters and the HTTP and log counters build their families from these
rows and supply only the values, so a name, a HELP string or a label set is spelled here and
nowhere else in the exporter. docs/metrics.md's tables are generated from the rows
(``python scripts/build_metrics_doc.py``), and the tests check the rule files and dashboards
against :data:`ALL`.

Names follow the Prometheus conventions: base units, ``_ratio`` for 0-1, ``_total`` only on
counters (a counter's :attr:`Family.name` is given without it, as prometheus-client takes it),
``_info`` gauges equal to 1. Rows are grouped as the reference groups them
(:data:`SECTIONS`), which is not always the collector that emits them
(:attr:`Family.collector`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.samples import Sample

MetricType = Literal["gauge", "counter", "histogram"]
GAUGE: MetricType = "gauge"
COUNTER: MetricType = "counter"
HISTOGRAM: MetricType = "histogram"

NAMESPACE = "namespace"
"""The label of a client's Kubernetes namespace: left out of a sample where it is empty."""
RANK = (NAMESPACE, "run", "rank")
"""Labels of every per-rank series; identity (host, GPU UUID, world size) is in RANK_INFO.
``namespace`` is the client's Kubernetes namespace (``trainmon_client._env.detect_pod``) and is
left out off Kubernetes, as Prometheus stores an empty label anyway: with the monitor's
``honorLabels`` it is the namespace rules key a run by, not the exporter's own."""
GPU = ("gpu", "uuid")
"""Labels of every per-GPU series: the NVML index and the UUID, as in dcgm-exporter."""
LAYER = (*RANK, "layer")
"""Labels of the per-layer series of ``Run.watch``."""


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family.

    ``name`` is the family name as prometheus-client takes it (a counter's without
    ``_total``); ``help`` the exact HELP text; ``labels`` the label names in order (a
    histogram's ``le`` is implied). ``unit`` and ``doc`` are the reference's unit column and
    its meaning-and-source text (Markdown). ``collector`` is what emits the family: a
    collector's settings toggle (``training``, ``health``, ``layers``, ``rank_gpu``, ``gpu``,
    ``exporter``, ``process``) or an instrument that is always on (``ingest``, ``http``,
    ``log``, ``scrape``, ``exposition``).
    """

    name: str
    type: MetricType
    help: str
    labels: tuple[str, ...]
    unit: str
    collector: str
    doc: str

    @property
    def exposed(self) -> str:
        """The name in the exposition: a counter's with ``_total``."""
        return f"{self.name}_total" if self.type == COUNTER else self.name

    @property
    def optional(self) -> bool:
        """Whether a label of :data:`OPTIONAL_LABELS` is left out of samples where empty."""
        return any(n in OPTIONAL_LABELS for n in self.labels)

    @property
    def series(self) -> tuple[str, ...]:
        """Every sample name the family can show (a histogram's three)."""
        if self.type == HISTOGRAM:
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.exposed,)

    def gauge(self) -> GaugeMetricFamily:
        """A new, empty gauge family of this row (for a collector's scrape)."""
        self._expect(GAUGE)
        if self.optional:
            return _OptionalGauge(self.name, self.help, labels=self.labels)
        return GaugeMetricFamily(self.name, self.help, labels=self.labels)

    def counter(self) -> CounterMetricFamily:
        """A new, empty counter family of this row."""
        self._expect(COUNTER)
        if self.optional:
            return _OptionalCounter(self.name, self.help, labels=self.labels)
        return CounterMetricFamily(self.name, self.help, labels=self.labels)

    def histogram(self) -> HistogramMetricFamily:
        """A new, empty histogram family of this row."""
        self._expect(HISTOGRAM)
        if self.optional:
            return _OptionalHistogram(self.name, self.help, labels=self.labels)
        return HistogramMetricFamily(self.name, self.help, labels=self.labels)

    def _expect(self, kind: MetricType) -> None:
        if self.type != kind:
            raise TypeError(f"{self.name} is a {self.type}, not a {kind}")


OPTIONAL_LABELS = (NAMESPACE, "pod", "uid")
"""Labels left out of a sample where they are empty (Kubernetes identity, absent elsewhere; a
tenant's ``uid`` where the tenant is a namespace)."""


class _Optional:
    """Leaves :data:`OPTIONAL_LABELS` out of each new sample where its value is empty.

    Prometheus stores a label with an empty value as no label at all; leaving it out keeps
    the exposition off Kubernetes as it was. The usual case, ``namespace`` first and empty,
    costs one slice: the library's own ``add_metric`` runs on the names and values without it.
    """

    samples: list[Sample]
    _labelnames: tuple[str, ...]

    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        super().__init__(name, documentation, labels=labels)  # type: ignore[call-arg]
        self._names = tuple(labels)
        labelnames = self._names
        self._rest = labelnames[1:]
        self._where = [(i, n) for i, n in enumerate(labelnames) if n in OPTIONAL_LABELS]
        self._first_only = [i for i, _ in self._where] == [0]

    def _cut(self, labels: Sequence[str]) -> Sequence[str] | None:
        """``labels`` for the names now in ``_labelnames``; None when the general path runs."""
        if self._first_only:
            if labels[0]:
                return labels
            self._labelnames = self._rest
            return labels[1:]
        return None

    def _drop_empty(self, labels: Sequence[str], first: int) -> None:
        self._labelnames = self._names
        if self._first_only:
            return
        for i, name in self._where:
            if not labels[i]:
                for j in range(first, len(self.samples)):
                    del self.samples[j].labels[name]


class _OptionalGauge(_Optional, GaugeMetricFamily):
    def add_metric(self, labels: Sequence[str], value: float, timestamp: Any = None) -> None:
        n = len(self.samples)
        try:
            super().add_metric(self._cut(labels) or labels, value, timestamp)
        finally:
            self._drop_empty(labels, n)


class _OptionalCounter(_Optional, CounterMetricFamily):
    def add_metric(
        self,
        labels: Sequence[str],
        value: float,
        created: float | None = None,
        timestamp: Any = None,
        exemplar: Any = None,
    ) -> None:
        n = len(self.samples)
        try:
            super().add_metric(self._cut(labels) or labels, value, created, timestamp, exemplar)
        finally:
            self._drop_empty(labels, n)


class _OptionalHistogram(_Optional, HistogramMetricFamily):
    def add_metric(
        self,
        labels: Sequence[str],
        buckets: Sequence[Any],
        sum_value: float | None,
        timestamp: Any = None,
    ) -> None:
        n = len(self.samples)
        try:
            super().add_metric(self._cut(labels) or labels, buckets, sum_value, timestamp)
        finally:
            self._drop_empty(labels, n)


def _event_time(counter: Family, what: str, doc: str) -> Family:
    """The row of ``<counter>_last_timestamp_seconds``: when ``counter`` last grew.

    Same labels and collector as the counter; a series exists once its counter grew (never
    at 0). ``what`` completes the HELP line, ``doc`` is the reference's text.
    """
    return Family(
        f"{counter.name}_last_timestamp_seconds",
        GAUGE,
        f"When {counter.exposed} last grew: {what} (Unix s, exporter clock).",
        counter.labels,
        unit="Unix s",
        collector=counter.collector,
        doc=doc,
    )


# ---------- collector training: per-(run, rank) series from the client's records

RUN_UP = Family(
    "trainmon_run_up",
    GAUGE,
    "1 while the rank's client is connected, 0 after it disconnected.",
    RANK,
    unit="0/1",
    collector="training",
    doc=(
        "1 while the rank's client is connected; 0 after it disconnected, until the series expire."
    ),
)

RUN_START_TIMESTAMP_SECONDS = Family(
    "trainmon_run_start_timestamp_seconds",
    GAUGE,
    "When the client process called init() (Unix s, client field started_at).",
    RANK,
    unit="Unix s",
    collector="training",
    doc="When the client called `init()` (client `started_at`).",
)

TRAIN_STEP = Family(
    "trainmon_train_step",
    GAUGE,
    "Last step number the client logged (client field step).",
    RANK,
    unit="step",
    collector="training",
    doc="Last step number logged (client `step`).",
)

TRAIN_LAST_STEP_TIMESTAMP_SECONDS = Family(
    "trainmon_train_last_step_timestamp_seconds",
    GAUGE,
    "Wall time of the last logged step's log() call (Unix s, client clock).",
    RANK,
    unit="Unix s",
    collector="training",
    doc=(
        "Client `time.time()` at the last `log()`. `time() - this` is how long ago a step "
        "completed."
    ),
)

TRAIN_LOSS = Family(
    "trainmon_train_loss",
    GAUGE,
    "Last training loss (client field loss).",
    RANK,
    unit="–",
    collector="training",
    doc=(
        "Last `loss`. NaN when the last loss was NaN: alert on the counter below, not on this "
        "gauge."
    ),
)

TRAIN_LEARNING_RATE = Family(
    "trainmon_train_learning_rate",
    GAUGE,
    "Last learning rate (client field lr).",
    RANK,
    unit="–",
    collector="training",
    doc="Last `lr`.",
)

TRAIN_GRAD_NORM = Family(
    "trainmon_train_grad_norm",
    GAUGE,
    "Last global gradient L2 norm (client field grad_norm).",
    RANK,
    unit="–",
    collector="training",
    doc="Last `grad_norm` (global L2 norm, before clipping).",
)

TRAIN_MEMORY_ALLOCATED_BYTES = Family(
    "trainmon_train_memory_allocated_bytes",
    GAUGE,
    (
        "Memory the rank's tensors hold (client field mem_allocated, e.g. "
        "torch.cuda.memory_allocated())."
    ),
    RANK,
    unit="bytes",
    collector="training",
    doc="Last `mem_allocated` (e.g. `torch.cuda.memory_allocated()`).",
)

TRAIN_MEMORY_RESERVED_BYTES = Family(
    "trainmon_train_memory_reserved_bytes",
    GAUGE,
    (
        "Memory its allocator reserved (client field mem_reserved, e.g. "
        "torch.cuda.memory_reserved())."
    ),
    RANK,
    unit="bytes",
    collector="training",
    doc="Last `mem_reserved` (e.g. `torch.cuda.memory_reserved()`).",
)

TRAIN_MEMORY_PEAK_BYTES = Family(
    "trainmon_train_memory_peak_bytes",
    GAUGE,
    (
        "Peak memory the rank's tensors held since the process started (client field mem_peak; "
        "init(cuda_memory=True) sends torch.cuda.memory_stats() allocated_bytes.all.peak)."
    ),
    RANK,
    unit="bytes",
    collector="training",
    doc=(
        "Last `mem_peak`: with `init(cuda_memory=True)`, "
        '`torch.cuda.memory_stats()["allocated_bytes.all.peak"]`.'
    ),
)

TRAIN_BATCH_SIZE = Family(
    "trainmon_train_batch_size",
    GAUGE,
    "Samples per step (client field batch_size).",
    RANK,
    unit="samples",
    collector="training",
    doc="Last `batch_size`.",
)

TRAIN_SEQUENCE_LENGTH = Family(
    "trainmon_train_sequence_length",
    GAUGE,
    "Tokens per sample (client field seq_len).",
    RANK,
    unit="tokens",
    collector="training",
    doc="Last `seq_len`.",
)

TRAIN_STEPS = Family(
    "trainmon_train_steps",
    COUNTER,
    "Steps logged by the client process (cumulative on the wire).",
    RANK,
    unit="steps",
    collector="training",
    doc="Steps this client process logged (client `steps_total`).",
)

TRAIN_TOKENS = Family(
    "trainmon_train_tokens",
    COUNTER,
    "Tokens processed: running sum of the client's per-step tokens (or batch_size x seq_len).",
    RANK,
    unit="tokens",
    collector="training",
    doc="Running sum of per-step `tokens` (or `batch_size × seq_len`).",
)

TRAIN_SAMPLES = Family(
    "trainmon_train_samples",
    COUNTER,
    "Samples processed: running sum of the client's per-step samples (or batch_size).",
    RANK,
    unit="samples",
    collector="training",
    doc="Running sum of per-step `samples` (or `batch_size`).",
)

CLIENT_OVERHEAD_SECONDS = Family(
    "trainmon_client_overhead_seconds",
    COUNTER,
    (
        "Seconds the client cost its trainer: wall time inside its calls plus its flusher "
        "thread's CPU time (s, cumulative on the wire)."
    ),
    RANK,
    unit="s",
    collector="training",
    doc=(
        "Seconds the client cost the trainer: wall time inside `log()` and its other calls, plus "
        "its flusher thread's CPU time (client `overhead_seconds_total`)."
    ),
)

CLIENT_SENT_MESSAGES = Family(
    "trainmon_client_sent_messages",
    COUNTER,
    (
        "Steps, evaluations, checkpoints, tracked operations and watch checks the client handed "
        "to its socket, over every connection (client TOTALS record, cumulative)."
    ),
    RANK,
    unit="records",
    collector="training",
    doc=(
        "Records (steps, evaluations, checkpoints, tracked operations, watch checks) the client "
        "handed to its socket, over every connection (client TOTALS `sent_total`). Every record "
        "logged is sent, dropped with a reason, or refused."
    ),
)

INGEST_MESSAGES_UNAPPLIED = Family(
    "trainmon_ingest_messages_unapplied",
    COUNTER,
    (
        "Records the client reported sent on its connections to this exporter that this exporter "
        "never applied: refused, dropped or never received (client TOTALS record sent_connection "
        "less records applied; resets with the exporter)."
    ),
    RANK,
    unit="records",
    collector="training",
    doc=(
        "Records the client reported sent on its connections to *this* exporter that this "
        "exporter never applied: refused, dropped or never received (TOTALS `sent_connection` "
        "less the records applied from that connection). Starts at 0 with each exporter. Where it "
        "grows and `trainmon_ingest_messages_invalid_total` does not, records were lost between "
        "the sockets."
    ),
)

CLIENT_REFUSED_VALUES = Family(
    "trainmon_client_refused_values",
    COUNTER,
    (
        "Values (or whole steps) the client refused: bad name, non-scalar value, bad step number "
        "(a string or bool too), a NaN, infinite or negative tokens or samples increment, over "
        "its name cap."
    ),
    RANK,
    unit="values",
    collector="training",
    doc=(
        "Values the client refused: a bad name, a value that is not a real scalar, a bad step "
        "number (negative, non-integral, a string such as `'5'`, a boolean such as `True`), a "
        "`tokens` or `samples` increment that is NaN, infinite or negative (it never enters the "
        "running total), or a name past its 1,024-name cap."
    ),
)

RUN_CRASHES = Family(
    "trainmon_run_crashes",
    COUNTER,
    (
        "Times the rank ended without a clean finish: disconnected without a FINISH record, or "
        "finished with an uncaught exception."
    ),
    RANK,
    unit="1",
    collector="training",
    doc=(
        "Ends without a clean finish: EOF without a FINISH record (killed, segfault, OOM-killer), "
        "or FINISH with the failed status (uncaught exception)."
    ),
)

RUN_CRASHES_LAST_TIMESTAMP_SECONDS = _event_time(
    RUN_CRASHES,
    "the rank's last crash or failed finish",
    (
        "When this exporter saw the rank's last crash: its connection ended without a "
        "FINISH record, or FINISH said failed. Absent until the first one. Event "
        "alerts fire on `time() - this` under their window "
        "([alerting.md](alerting.md#event-alerts)): a time does not change when "
        "Prometheus misses scrapes or restarts, so an event pages once."
    ),
)

RUN_RESTARTS = Family(
    "trainmon_run_restarts",
    COUNTER,
    (
        "Times the rank restarted: its step number went backward (a checkpoint reload) or a new "
        "process resumed it. The loss, gradient, step-time and throughput statistics start over "
        "at each one, so a restart is not judged as a spike or a divergence."
    ),
    RANK,
    unit="1",
    collector="training",
    doc=(
        "Times the rank restarted: the step number went backward (a checkpoint reload in the same "
        "process) or a new process resumed the rank (its `steps_total` started over). The rank's "
        "loss, grad-norm, step-time, throughput, memory and gradient-gain statistics start over "
        "at each restart, so a rolled-back loss is not a spike and its EMA trend is not a "
        "divergence. A rank that had finished cleanly and is opened again is a new run under a "
        "used id: it starts from fresh state instead (every counter at 0)."
    ),
)

TRAIN_STEP_ROLLBACKS = Family(
    "trainmon_train_step_rollbacks",
    COUNTER,
    (
        "Times the rank's step number went backward within one client process (a checkpoint "
        "reload); each is also a restart. Repeated ones keep the spike detectors starting over."
    ),
    RANK,
    unit="1",
    collector="training",
    doc=(
        "Times the step number went backward within one client process (a checkpoint reload, "
        "or a loop that logs lower steps): the rollbacks among `trainmon_run_restarts_total`. "
        "Each one starts the rank's statistics over, so a rank that steps back every few steps "
        "keeps its loss and gradient spike detectors from ever judging; repeated rollbacks are "
        "a finding of their own (`TrainmonRepeatedRollbacks`). Exists at 0 from the rank's "
        "first message."
    ),
)

TRAIN_STEP_ROLLBACKS_REPEAT_TIMESTAMP_SECONDS = Family(
    "trainmon_train_step_rollbacks_repeat_timestamp_seconds",
    GAUGE,
    (
        "Time of the rank's rollback_repeats-th latest rollback (Unix s, exporter clock): that "
        "many rollbacks happened since. Absent until the rank rolled back that often."
    ),
    RANK,
    unit="Unix s",
    collector="training",
    doc=(
        "When the rank's `rollback_repeats`-th latest rollback (the 3rd by default) "
        "happened: `time() - this < w` means that many rollbacks within `w` seconds, "
        "what `TrainmonRepeatedRollbacks` asks, without counting a counter's increase "
        "over a window that a scrape gap or a Prometheus restart can cut. Absent "
        "until the rank rolled back that often."
    ),
)

TRAIN_ALLOCATOR_RETRIES = Family(
    "trainmon_train_allocator_retries",
    COUNTER,
    (
        "cudaMalloc retries after the caching allocator freed its cache (client field "
        "alloc_retries; torch.cuda.memory_stats() num_alloc_retries): memory pressure before an "
        "OOM."
    ),
    RANK,
    unit="retries",
    collector="training",
    doc=(
        "Last `alloc_retries`: with `init(cuda_memory=True)`, `num_alloc_retries`, the times the "
        "caching allocator had to free its cache and retry `cudaMalloc`. Rising means "
        "fragmentation and an OOM on the way. Absent unless sent."
    ),
)

TRAIN_ALLOCATOR_RETRIES_LAST_TIMESTAMP_SECONDS = _event_time(
    TRAIN_ALLOCATOR_RETRIES,
    "the client's alloc_retries total rose",
    (
        "When this exporter saw the client's `alloc_retries` rise. The client keeps "
        "the total for its process's life: the first total of a process that started "
        "before this exporter (one that reconnected after an exporter restart) is a "
        "baseline, not a rise; for a process that started after, a value above 0 is "
        "one. Absent until the first one. Event alerts fire on `time() - this` under "
        "their window ([alerting.md](alerting.md#event-alerts)): a time does not "
        "change when Prometheus misses scrapes or restarts, so an event pages once."
    ),
)

TRAIN_OOM_ERRORS = Family(
    "trainmon_train_oom_errors",
    COUNTER,
    (
        "CUDA out-of-memory errors the allocator raised (client field ooms; "
        "torch.cuda.memory_stats() num_ooms)."
    ),
    RANK,
    unit="errors",
    collector="training",
    doc=(
        "Last `ooms`: with `init(cuda_memory=True)`, `num_ooms`, the CUDA out-of-memory errors "
        "the allocator raised. Absent unless sent."
    ),
)

TRAIN_OOM_ERRORS_LAST_TIMESTAMP_SECONDS = _event_time(
    TRAIN_OOM_ERRORS,
    "the client's ooms total rose",
    (
        "When this exporter saw the client's `ooms` rise (judged as for allocator "
        "retries). Absent until the first one. Event alerts fire on `time() - this` "
        "under their window ([alerting.md](alerting.md#event-alerts)): a time does "
        "not change when Prometheus misses scrapes or restarts, so an event pages "
        "once."
    ),
)

RANK_INFO = Family(
    "trainmon_rank_info",
    GAUGE,
    (
        "Always 1; identity of a rank: node, local rank, world size, GPU UUID (NVML format, from "
        "the client), client version and training dtype. Join on uuid with GPU series."
    ),
    (*RANK, "local_rank", "world_size", "hostname", "uuid", "client_version", "dtype", "pod"),
    unit="1",
    collector="training",
    doc=(
        "Identity of a rank. `uuid` is the rank's GPU UUID in NVML's `GPU-…` form, as the client "
        'reports it (`torch.cuda.get_device_properties(i).uuid`), and `""` without CUDA. Join GPU '
        "series `on(uuid)`. `dtype` is the training dtype MFU is judged against (`init(dtype=…)`, "
        "default `bf16`)."
    ),
)

RUN_INFO = Family(
    "trainmon_run_info",
    GAUGE,
    "Always 1; one per run, with its world size.",
    (NAMESPACE, "run", "world_size"),
    unit="1",
    collector="training",
    doc="One per run.",
)

RUN_WORLD_SIZE = Family(
    "trainmon_run_world_size",
    GAUGE,
    (
        "Ranks the run was launched with (count): the largest world size its ranks on this "
        "exporter reported (client WORLD_SIZE). Compare with the sum of trainmon_run_up."
    ),
    (NAMESPACE, "run"),
    unit="ranks",
    collector="training",
    doc=(
        "The run's world size as a value (the largest client `world_size` of its ranks on this "
        "exporter), so rules can compare it with `sum(trainmon_run_up)`: a label cannot be "
        "compared with a number in PromQL."
    ),
)

TRAIN_TOKENS_PER_SECOND = Family(
    "trainmon_train_tokens_per_second",
    GAUGE,
    (
        "Tokens/s over rate_window_seconds: delta tokens / delta client wall time; 0 when no step "
        "arrived within the window or the rank no longer runs (finished, failed, crashed or "
        "disconnected)."
    ),
    RANK,
    unit="tokens/s",
    collector="training",
    doc=(
        "Δ`tokens_total` / Δclient wall time between the oldest and newest step within "
        "`rate_window_seconds` (30 s). 0 when no step arrived within the window, and from the "
        "moment the rank no longer runs (finished, failed, crashed or disconnected), not the "
        "speed it last had."
    ),
)

TRAIN_SAMPLES_PER_SECOND = Family(
    "trainmon_train_samples_per_second",
    GAUGE,
    "Samples/s over rate_window_seconds (as tokens/s).",
    RANK,
    unit="samples/s",
    collector="training",
    doc="The same for samples.",
)

CLIENT_OVERHEAD_RATIO = Family(
    "trainmon_client_overhead_ratio",
    GAUGE,
    (
        "Share of wall time the client cost its trainer over rate_window_seconds (delta overhead "
        "s / delta wall s; budget: under 0.01)."
    ),
    RANK,
    unit="ratio",
    collector="training",
    doc=(
        "Δoverhead / Δwall over the rate window: the share of training time spent in trainmon. "
        "The budget is 0.01."
    ),
)

TRAIN_STEP_DURATION_SECONDS = Family(
    "trainmon_train_step_duration_seconds",
    HISTOGRAM,
    (
        "Time of one training step (s): the time between consecutive log() calls of a rank "
        "(client time.perf_counter) over the steps between them."
    ),
    RANK,
    unit="s",
    collector="training",
    doc=(
        "Time of one training step: the time between consecutive `log()` calls of a rank (client "
        "`time.perf_counter()` difference, immune to wall-clock steps) divided by the steps "
        "between them, so a rank that logs every 100th step observes its per-step time once per "
        "call. Buckets: `step_duration_buckets`."
    ),
)

TRAIN_NONFINITE_VALUES = Family(
    "trainmon_train_nonfinite_values",
    COUNTER,
    (
        "Logged values that were NaN or infinite, by field (loss, grad_norm, lr, or custom for "
        "any custom metric)."
    ),
    (*RANK, "field"),
    unit="values",
    collector="training",
    doc=(
        "Logged values that were NaN or ±Inf. `field` is one of `loss`, `grad_norm`, `lr`, or "
        "`custom` (any custom metric). Counted for every step, so a NaN between two scrapes still "
        "shows."
    ),
)

TRAIN_NONFINITE_VALUES_LAST_TIMESTAMP_SECONDS = _event_time(
    TRAIN_NONFINITE_VALUES,
    "a NaN or infinite value of the field arrived",
    (
        "When this exporter received the last NaN or ±Inf value of `field`. Absent "
        "until the first one. Event alerts fire on `time() - this` under their window "
        "([alerting.md](alerting.md#event-alerts)): a time does not change when "
        "Prometheus misses scrapes or restarts, so an event pages once."
    ),
)

CLIENT_DROPPED_MESSAGES = Family(
    "trainmon_client_dropped_messages",
    COUNTER,
    (
        "Steps, evaluations, checkpoints and tracked operations the client could not deliver: "
        "reason=disconnected (no exporter reachable), backpressure (buffer full or finish() "
        "deadline), encode_error (a value out of range), in_flight (sent on a connection that "
        "ended before the exporter read them: an upper bound)."
    ),
    (*RANK, "reason"),
    unit="records",
    collector="training",
    doc=(
        "Steps, evaluations, checkpoints and tracked operations the client could not deliver. "
        '`reason="disconnected"`: no exporter was reachable. `reason="backpressure"`: the socket '
        'buffer was full, or `finish()` ran out of its 1 s deadline. `reason="encode_error"`: a '
        "step with a value that cannot be encoded (an int beyond a float's range). "
        '`reason="in_flight"`: records sent on a connection that ended before the exporter was '
        "seen to read them (an exporter frozen, killed or restarted; an upper bound). Reported "
        "in-band (STEP and TOTALS records), so drops made while disconnected show up after the "
        "reconnect. See [reliability.md](reliability.md)."
    ),
)

CLIENT_DROPPED_MESSAGES_LAST_TIMESTAMP_SECONDS = _event_time(
    CLIENT_DROPPED_MESSAGES,
    "the client's total of drops of that reason rose",
    (
        "When this exporter saw the client's total of drops of `reason` rise. The "
        "first totals of a client process that started before this exporter are a "
        "baseline, not a rise: the drops an exporter restart causes (records sent "
        "while no exporter listened, or in flight when the old one stopped) arrive "
        "after the reconnect and are not the trainer's doing. For a process that "
        "started after this exporter, any drop is a rise. Absent until the first one. "
        "Event alerts fire on `time() - this` under their window "
        "([alerting.md](alerting.md#event-alerts)): a time does not change when "
        "Prometheus misses scrapes or restarts, so an event pages once."
    ),
)

TRAIN_CUSTOM_VALUE = Family(
    "trainmon_train_custom_value",
    GAUGE,
    (
        "Last value of a custom scalar the client logged under that name (capped at "
        "max_custom_metrics names per rank)."
    ),
    (*RANK, "name"),
    unit="–",
    collector="training",
    doc="Last value of each custom scalar, at most `max_custom_metrics` names per rank.",
)


# ---------- collector health: the detectors of trainmon_exporter.analytics, per rank

TRAIN_LOSS_EMA = Family(
    "trainmon_train_loss_ema",
    GAUGE,
    (
        "EMA of the loss: ema = d*ema + (1-d)*loss, d = ema_decay (default 0.99), started at "
        "the first finite loss."
    ),
    RANK,
    unit="–",
    collector="health",
    doc="`ema = 0.99·ema + 0.01·loss`, started at the first finite loss.",
)

TRAIN_LOSS_MEAN = Family(
    "trainmon_train_loss_mean",
    GAUGE,
    "Mean of the last window_steps finite losses.",
    RANK,
    unit="–",
    collector="health",
    doc="Rolling mean of the last 100 finite losses.",
)

TRAIN_LOSS_STDDEV = Family(
    "trainmon_train_loss_stddev",
    GAUGE,
    "Standard deviation of the last window_steps finite losses.",
    RANK,
    unit="–",
    collector="health",
    doc="Rolling standard deviation of the last 100 finite losses.",
)

TRAIN_LOSS_ZSCORE = Family(
    "trainmon_train_loss_zscore",
    GAUGE,
    "z-score of the last loss against the preceding window.",
    RANK,
    unit="σ",
    collector="health",
    doc="z-score of the last loss against the preceding window.",
)

TRAIN_LOSS_TO_AVERAGE_RATIO = Family(
    "trainmon_train_loss_to_average_ratio",
    GAUGE,
    (
        "Last loss divided by the mean of the preceding window (10 means ten times the moving "
        "average)."
    ),
    RANK,
    unit="ratio",
    collector="health",
    doc="Last loss / mean of the preceding window.",
)

TRAIN_GRAD_NORM_MEAN = Family(
    "trainmon_train_grad_norm_mean",
    GAUGE,
    "Mean of the last window_steps finite grad norms.",
    RANK,
    unit="–",
    collector="health",
    doc="Rolling mean of the last 100 finite grad norms.",
)

TRAIN_GRAD_NORM_STDDEV = Family(
    "trainmon_train_grad_norm_stddev",
    GAUGE,
    "Standard deviation of the last window_steps grad norms.",
    RANK,
    unit="–",
    collector="health",
    doc="Rolling standard deviation of the last 100 finite grad norms.",
)

TRAIN_GRAD_NORM_ZSCORE = Family(
    "trainmon_train_grad_norm_zscore",
    GAUGE,
    "z-score of the last grad norm against the preceding window.",
    RANK,
    unit="σ",
    collector="health",
    doc="z-score of the last grad norm against the preceding window.",
)

TRAIN_STEP_TIME_MEDIAN_SECONDS = Family(
    "trainmon_train_step_time_median_seconds",
    GAUGE,
    (
        "Median of the last step_time_window_steps per-step times (s; the time between log() "
        "calls over the steps between them): the rank's usual step time."
    ),
    RANK,
    unit="s",
    collector="health",
    doc=(
        "Median of the last 50 per-step times (as in the histogram above): the rank's usual step "
        "time, what stragglers are compared on."
    ),
)

TRAIN_HUNG = Family(
    "trainmon_train_hung",
    GAUGE,
    (
        "1 while the rank is connected, runs no tracked operation and has not stepped for "
        "hang_factor x median step time + hang_grace_seconds."
    ),
    RANK,
    unit="0/1",
    collector="health",
    doc="Connected, no tracked operation running, and no step for 2 × median + 30 s.",
)

TRAIN_THROUGHPUT_RATIO = Family(
    "trainmon_train_throughput_ratio",
    GAUGE,
    (
        "Median per-step tokens/s of the last throughput_recent_steps over that of the last "
        "throughput_baseline_steps (1 = as usual)."
    ),
    RANK,
    unit="ratio",
    collector="health",
    doc="Median per-step tokens/s of the last 20 steps over that of the last 500.",
)

TRAIN_THROUGHPUT_DROPPED = Family(
    "trainmon_train_throughput_dropped",
    GAUGE,
    (
        "1 while the rank's throughput is judged dropped: trainmon_train_throughput_ratio below "
        "throughput_drop_ratio at the last check (every 1 s), else 0."
    ),
    RANK,
    unit="0/1",
    collector="health",
    doc="1 while the exporter judges the throughput dropped: the ratio below "
    "`throughput_drop_ratio` at its last check (every 1 s). `TrainmonThroughputDrop` reads this "
    "verdict, so the alert follows the setting.",
)

TRAIN_STRAGGLER_RATIO = Family(
    "trainmon_train_straggler_ratio",
    GAUGE,
    (
        "Rank's recent median step time over the median of its run's other connected ranks, "
        "judged every 1 s (1 = typical; only meaningful where ranks do not synchronise every "
        "step)."
    ),
    RANK,
    unit="ratio",
    collector="health",
    doc="Rank's recent median step time / median of its run's *other* connected ranks.",
)

TRAIN_STRAGGLING = Family(
    "trainmon_train_straggling",
    GAUGE,
    (
        "1 while the rank is judged a straggler: trainmon_train_straggler_ratio above "
        "straggler_ratio at the last check (every 1 s, while connected), else 0."
    ),
    RANK,
    unit="0/1",
    collector="health",
    doc="1 while the exporter judges the rank a straggler: the ratio above `straggler_ratio` at "
    "its last check (every 1 s), and the rank connected. `TrainmonStragglerRank` reads this "
    "verdict, so the alert follows the setting.",
)

TRAIN_GRAD_GAIN_MEAN = Family(
    "trainmon_train_grad_gain_mean",
    GAUGE,
    "Geometric mean over consecutive layers of ||g_i|| / ||g_i+1|| at the last watch check.",
    RANK,
    unit="ratio",
    collector="health",
    doc="Geometric mean over consecutive layers of `‖g_i‖ / ‖g_{i+1}‖`.",
)

TRAIN_GRAD_GAIN_DRIFT_RATIO = Family(
    "trainmon_train_grad_gain_drift_ratio",
    GAUGE,
    (
        "Median mean gradient gain of the last gain_window_checks over its baseline (the median "
        "of the first gain_baseline_checks)."
    ),
    RANK,
    unit="ratio",
    collector="health",
    doc=(
        "Median mean gain of the last `gain_window_checks` / its baseline (median of the first "
        "`gain_baseline_checks`)."
    ),
)

TRAIN_MEMORY_GROWTH_BYTES_PER_STEP = Family(
    "trainmon_train_memory_growth_bytes_per_step",
    GAUGE,
    "Least-squares slope of mem_allocated over the last leak_window_steps (bytes/step).",
    RANK,
    unit="bytes/step",
    collector="health",
    doc="Least-squares slope of `mem_allocated` over the last 200 steps.",
)

TRAIN_STEP_OVERDUE_RATIO = Family(
    "trainmon_train_step_overdue_ratio",
    GAUGE,
    (
        "Seconds since the rank's last step over its median step time, while connected (1: a step "
        "is about due; hung past hang_factor x median + grace)."
    ),
    RANK,
    unit="ratio",
    collector="health",
    doc=(
        "Seconds since the last `log()` / median time between `log()` calls, while connected (a "
        "rank that logs every 100th step is overdue only after about 100 steps' time)."
    ),
)

TRAIN_LOSS_EMA_SLOPE = Family(
    "trainmon_train_loss_ema_slope",
    GAUGE,
    (
        "Least-squares slope of the loss EMA over the last trend_window_steps (loss per step; "
        "above 0: diverging)."
    ),
    RANK,
    unit="loss/step",
    collector="health",
    doc="Least-squares slope of the EMA over the last 200 steps.",
)

TRAIN_LOSS_PLATEAU = Family(
    "trainmon_train_loss_plateau",
    GAUGE,
    (
        "1 when the loss EMA moved less than plateau_tolerance (relative) across a full trend "
        "window."
    ),
    RANK,
    unit="0/1",
    collector="health",
    doc="The EMA moved less than 1 % across a full trend window.",
)

EVAL_LOSS = Family(
    "trainmon_eval_loss",
    GAUGE,
    "Validation loss of the last evaluation (Run.eval val_loss).",
    RANK,
    unit="–",
    collector="health",
    doc="Last validation loss (`Run.eval(step, val_loss=…)`).",
)

EVAL_STEP = Family(
    "trainmon_eval_step",
    GAUGE,
    "Training step of the last evaluation.",
    RANK,
    unit="step",
    collector="health",
    doc="Training step of the last evaluation.",
)

EVAL_IMPROVEMENT_RATIO = Family(
    "trainmon_eval_improvement_ratio",
    GAUGE,
    "(previous - last) / |previous| validation loss.",
    RANK,
    unit="ratio",
    collector="health",
    doc="`(previous − last) / |previous|` validation loss.",
)

EVAL_SLOW_IMPROVEMENT = Family(
    "trainmon_eval_slow_improvement",
    GAUGE,
    "1 when the last evaluation improved by less than eval_slow_improvement.",
    RANK,
    unit="0/1",
    collector="health",
    doc="Improvement under 1 % per evaluation.",
)

EVAL_GENERALIZATION_GAP_RATIO = Family(
    "trainmon_eval_generalization_gap_ratio",
    GAUGE,
    "(validation loss - training loss EMA) / training loss EMA.",
    RANK,
    unit="ratio",
    collector="health",
    doc="`(val_loss − train EMA) / train EMA`.",
)

EVAL_OVERFITTING = Family(
    "trainmon_eval_overfitting",
    GAUGE,
    "1 when the generalization gap exceeds eval_overfit_gap.",
    RANK,
    unit="0/1",
    collector="health",
    doc="Gap over 30 %.",
)

EVAL_PLATEAU = Family(
    "trainmon_eval_plateau",
    GAUGE,
    (
        "1 when the last eval_plateau_evals evaluations each changed by less than "
        "eval_plateau_change."
    ),
    RANK,
    unit="0/1",
    collector="health",
    doc="The last 3 evaluations each within 1 % of the one before.",
)

CHECKPOINT_LAST_TIMESTAMP_SECONDS = Family(
    "trainmon_checkpoint_last_timestamp_seconds",
    GAUGE,
    "When the last checkpoint was written (Unix s, Run.checkpoint).",
    RANK,
    unit="Unix s",
    collector="health",
    doc="When the last checkpoint was written (`Run.checkpoint`). Age: `time() - this`.",
)

CHECKPOINT_LAST_DURATION_SECONDS = Family(
    "trainmon_checkpoint_last_duration_seconds",
    GAUGE,
    "How long the last checkpoint took (s).",
    RANK,
    unit="s",
    collector="health",
    doc="How long it took.",
)

CHECKPOINT_LAST_STEP = Family(
    "trainmon_checkpoint_last_step",
    GAUGE,
    "Training step of the last checkpoint.",
    RANK,
    unit="step",
    collector="health",
    doc="Its step.",
)

TRAIN_GRAD_EXPLOSIONS = Family(
    "trainmon_train_grad_explosions",
    COUNTER,
    (
        "Steps whose grad norm exceeded grad_explosion_norm, or grad_explosion_ratio x its "
        "rolling mean, or was +Inf."
    ),
    RANK,
    unit="steps",
    collector="health",
    doc="Grad norm > 100, > 10× its rolling mean, or +Inf.",
)

TRAIN_GRAD_EXPLOSIONS_LAST_TIMESTAMP_SECONDS = _event_time(
    TRAIN_GRAD_EXPLOSIONS,
    "a gradient explosion was judged",
    (
        "When this exporter judged the rank's last gradient explosion. Absent until "
        "the first one. Event alerts fire on `time() - this` under their window "
        "([alerting.md](alerting.md#event-alerts)): a time does not change when "
        "Prometheus misses scrapes or restarts, so an event pages once."
    ),
)

TRAIN_GRAD_VANISHING = Family(
    "trainmon_train_grad_vanishing",
    COUNTER,
    "Steps whose grad norm was below grad_vanishing_norm.",
    RANK,
    unit="steps",
    collector="health",
    doc="Grad norm < 1e-8.",
)

TRAIN_UPDATE_RATIO_HIGH = Family(
    "trainmon_train_update_ratio_high",
    COUNTER,
    "Layer checks (Run.watch) whose update ratio ||dw||/||w|| exceeded update_ratio_high.",
    RANK,
    unit="layer checks",
    collector="health",
    doc="Layer checks whose update ratio was above `update_ratio_high` (0.1).",
)

TRAIN_UPDATE_RATIO_HIGH_LAST_TIMESTAMP_SECONDS = _event_time(
    TRAIN_UPDATE_RATIO_HIGH,
    "a watch check had a layer above update_ratio_high",
    (
        "When this exporter last counted a layer check above `update_ratio_high`. "
        "Absent until the first one. Event alerts fire on `time() - this` under their "
        "window ([alerting.md](alerting.md#event-alerts)): a time does not change "
        "when Prometheus misses scrapes or restarts, so an event pages once."
    ),
)

TRAIN_UPDATE_RATIO_LOW = Family(
    "trainmon_train_update_ratio_low",
    COUNTER,
    (
        "Layer checks whose update ratio was below update_ratio_low while the median layer's was "
        "not (a frozen layer)."
    ),
    RANK,
    unit="layer checks",
    collector="health",
    doc=(
        "Layer checks whose update ratio was below `update_ratio_low` (1e-7) while the median "
        "layer's was not (a frozen layer)."
    ),
)

TRAIN_UPDATE_RATIO_LOW_LAST_TIMESTAMP_SECONDS = _event_time(
    TRAIN_UPDATE_RATIO_LOW,
    "a watch check had a frozen layer",
    (
        "When this exporter last counted a layer check below `update_ratio_low`. "
        "Absent until the first one. Event alerts fire on `time() - this` under their "
        "window ([alerting.md](alerting.md#event-alerts)): a time does not change "
        "when Prometheus misses scrapes or restarts, so an event pages once."
    ),
)

TRAIN_GRAD_GAIN_DRIFTS = Family(
    "trainmon_train_grad_gain_drifts",
    COUNTER,
    (
        "Episodes of the mean layer-to-layer gradient gain off its baseline by gain_drift_factor "
        "for gain_drift_checks checks in a row."
    ),
    RANK,
    unit="episodes",
    collector="health",
    doc=(
        "Episodes of the drift beyond `gain_drift_factor` (2×) either way, for "
        "`gain_drift_checks` (3) checks in a row."
    ),
)

TRAIN_GRAD_GAIN_DRIFTS_LAST_TIMESTAMP_SECONDS = _event_time(
    TRAIN_GRAD_GAIN_DRIFTS,
    "a gradient gain drift episode began",
    (
        "When the rank's last gradient gain drift episode began. Absent until the "
        "first one. Event alerts fire on `time() - this` under their window "
        "([alerting.md](alerting.md#event-alerts)): a time does not change when "
        "Prometheus misses scrapes or restarts, so an event pages once."
    ),
)

TRAIN_MEMORY_LEAKS = Family(
    "trainmon_train_memory_leaks",
    COUNTER,
    "Episodes of steady mem_allocated growth (trainmon_train_memory_growth_bytes_per_step).",
    RANK,
    unit="episodes",
    collector="health",
    doc="Episodes of steady growth: over 5 % of the mean across the window, with R² ≥ 0.9.",
)

TRAIN_MEMORY_LEAKS_LAST_TIMESTAMP_SECONDS = _event_time(
    TRAIN_MEMORY_LEAKS,
    "a memory leak episode began",
    (
        "When the rank's last memory leak episode began. Absent until the first one. "
        "Event alerts fire on `time() - this` under their window "
        "([alerting.md](alerting.md#event-alerts)): a time does not change when "
        "Prometheus misses scrapes or restarts, so an event pages once."
    ),
)

TRAIN_HANGS = Family(
    "trainmon_train_hangs",
    COUNTER,
    "Hang episodes (see trainmon_train_hung).",
    RANK,
    unit="episodes",
    collector="health",
    doc="Hang episodes, counted within 0.1 s of the limit.",
)

HANG_FRAME_INFO = Family(
    "trainmon_hang_frame_info",
    GAUGE,
    (
        "Always 1, only while the rank is hung and its evidence is in: frame is the innermost "
        "frame of its training thread in the user's code, as function (file:line), or (no "
        "answer); collective is the collective it waits in (Flight Recorder), or empty."
    ),
    (*RANK, "frame", "collective"),
    unit="1",
    collector="health",
    doc=(
        "Where a hung rank is (docs/hangs.md), one series per hung rank while it is hung: "
        "`frame` is the innermost frame of the thread that calls `Run.log()` outside the "
        "standard library, site-packages and trainmon, as `function (file:line)` with the "
        "file's base name (letters, digits and `_ . : < > -`), or `(no answer)` when the rank "
        "did not answer in `hang_capture_timeout_seconds`; `collective` is the oldest "
        "collective its first process group has not completed (`gloo:all_reduce`, "
        "`nccl:all_reduce`...), empty when none. From the client's capture."
    ),
)

HANG_COLLECTIVE_SEQUENCE = Family(
    "trainmon_hang_collective_sequence",
    GAUGE,
    (
        "Last collective sequence id PyTorch's Flight Recorder saw in each state (enqueued, "
        "started, completed) for a process group of a hung rank, only while it is hung."
    ),
    (*RANK, "group", "state"),
    unit="sequence id",
    collector="health",
    doc=(
        "Per process group (`group`: its id, at most 4 per rank, those with a collective "
        "pending first) of a hung rank, the last collective sequence id the Flight Recorder "
        "saw `enqueued`, `started` and `completed`. A state the recorder does not track is "
        "left out (gloo tracks no `started`). A rank whose id lags its run's maximum in a "
        "group never joined the collective the others wait in (recording rules). From the "
        "client's capture (`torch._C._distributed_c10d`)."
    ),
)

TRAIN_THROUGHPUT_DROPS = Family(
    "trainmon_train_throughput_drops",
    COUNTER,
    "Episodes of trainmon_train_throughput_ratio below throughput_drop_ratio (default 0.7).",
    RANK,
    unit="episodes",
    collector="health",
    doc="Episodes of the ratio below 0.7 (`throughput_drop_ratio`).",
)

TRAIN_STRAGGLER_EPISODES = Family(
    "trainmon_train_straggler_episodes",
    COUNTER,
    "Episodes of trainmon_train_straggler_ratio above straggler_ratio (default 1.5).",
    RANK,
    unit="episodes",
    collector="health",
    doc="Episodes of the ratio above 1.5 (`straggler_ratio`).",
)

EVAL_EVALUATIONS = Family(
    "trainmon_eval_evaluations",
    COUNTER,
    "Evaluations reported (Run.eval).",
    RANK,
    unit="evaluations",
    collector="health",
    doc="Evaluations reported.",
)

CHECKPOINTS = Family(
    "trainmon_checkpoints",
    COUNTER,
    "Checkpoints reported (Run.checkpoint).",
    RANK,
    unit="1",
    collector="health",
    doc="Checkpoints reported.",
)

TRAIN_PRODUCTIVE_SECONDS = Family(
    "trainmon_train_productive_seconds",
    COUNTER,
    (
        "Step time that advanced the run and was not lost: the time between log() calls less "
        "every badput kind, counted once a checkpoint, a clean finish or a resume past its step "
        "keeps it (exporter monotonic clock; definitions: docs/goodput.md)."
    ),
    RANK,
    unit="s",
    collector="health",
    doc=(
        "Step time that advanced the run and was not lost later: the time between two `log()` "
        "calls less the badput inside it, counted once a checkpoint of a later step, a clean "
        "finish, or a restart or rollback that resumes past the step keeps it. Until then it is "
        "`trainmon_train_uncheckpointed_seconds`. Productive plus every badput kind plus the "
        "uncheckpointed time is the rank's wall-clock since `init()` "
        "([docs/goodput.md](goodput.md))."
    ),
)

TRAIN_BADPUT_SECONDS = Family(
    "trainmon_train_badput_seconds",
    COUNTER,
    (
        "Wall-clock time that did not train, by kind: startup (init to the first step), "
        "data_loading (Run.timed waits, data_time), checkpoint_save, checkpoint_restore, "
        "evaluation (tracked validation, eval()), hang (while a hang was open), wasted_progress "
        "(step time a crash or rollback threw away), recovery (crash to the restarted "
        "process's init), other. Never overlapping (docs/goodput.md)."
    ),
    (*RANK, "kind"),
    unit="s",
    collector="health",
    doc=(
        "Wall-clock seconds that did not train, by `kind`: `startup` (from `init()` to each "
        "process's first step), `data_loading` (the waits `Run.timed()` measured, or "
        "`data_time` as logged), `checkpoint_save` and `checkpoint_restore` "
        "(`Run.checkpoint(seconds=...)`, `restore=True`), `evaluation` (a tracked `validation` "
        "or `eval` operation, and the time from a step to the `Run.eval()` after it), `hang` "
        "(once a hang is judged: from one usual step time after the last step to the next "
        "step), `wasted_progress` (the step time a crash "
        "or a rollback threw away, and the step in progress at a crash), `recovery` (from a "
        "crash to the restarted process's `init()`), `other` (the rest: after the last step to "
        "a finish). An instant is in one kind only ([docs/goodput.md](goodput.md))."
    ),
)

TRAIN_UNCHECKPOINTED_SECONDS = Family(
    "trainmon_train_uncheckpointed_seconds",
    GAUGE,
    (
        "Step time not yet kept by a checkpoint, a clean finish or a resume past its step: "
        "productive when kept, wasted_progress if a crash or rollback loses it."
    ),
    RANK,
    unit="s",
    collector="health",
    doc=(
        "Step time since the last checkpoint (more precisely: of steps no checkpoint, clean "
        "finish or resume has kept yet). It moves to `trainmon_train_productive_seconds_total` "
        'when kept, to `badput_seconds_total{kind="wasted_progress"}` when a crash or a '
        "rollback loses it. The goodput recording rules count it as good until then."
    ),
)

TRAIN_AT_RISK_SECONDS = Family(
    "trainmon_train_at_risk_seconds",
    GAUGE,
    (
        "Step time not yet kept whose process ended without a clean finish: lost unless a "
        "restart on this exporter resumes past it; the goodput rules count it as "
        "wasted_progress."
    ),
    RANK,
    unit="s",
    collector="health",
    doc=(
        "Uncheckpointed step time of a process that crashed (or went away while the exporter "
        "was down): it moves to `trainmon_train_productive_seconds_total` or "
        '`badput_seconds_total{kind="wasted_progress"}` when a restart here resumes, and to '
        "`wasted_progress` when the rank's state expires. The goodput recording rules count it "
        "as `wasted_progress` meanwhile, so time a crash threw away is never counted as good "
        "([docs/goodput.md](goodput.md))."
    ),
)

TRAIN_ACCOUNTING_START_TIMESTAMP_SECONDS = Family(
    "trainmon_train_accounting_start_timestamp_seconds",
    GAUGE,
    (
        "When this exporter's time accounting of the rank starts (Unix s): the first "
        "process's init() it knows of. Its productive, badput, uncheckpointed and at-risk "
        "seconds add up to the time from here."
    ),
    RANK,
    unit="s",
    collector="health",
    doc=(
        "Start of the wall-clock this exporter accounts for the rank (Unix seconds): the "
        "`init()` of the first process it knows of (or the first step it saw, for a process "
        "that began before the exporter knew of it). With the accounted seconds it gives "
        "where this exporter's accounting ends, and the recording rules count the gaps "
        "between the exporters that accounted a rank (a restart on another node) as recovery."
    ),
)

TRAIN_DATA_LOADING_MEASURED = Family(
    "trainmon_train_data_loading_measured",
    GAUGE,
    (
        "1 once the rank reported how long it waited for its input (Run.timed, data_time), "
        "else 0: its data-loading badput is not measured, not zero."
    ),
    RANK,
    unit="0/1",
    collector="health",
    doc=(
        "1 once the rank has reported its data waits (`Run.timed()`, `data_time`, or a "
        "framework callback), 0 while it never did: then its data loading is inside its step "
        "time, unmeasured, and the dashboard and the status page say so."
    ),
)

TRAIN_INPUT_BOUND = Family(
    "trainmon_train_input_bound",
    GAUGE,
    (
        "1 while the rank is judged input-bound: data loading above input_bound_ratio of step "
        "time over the rate window, else 0."
    ),
    RANK,
    unit="0/1",
    collector="health",
    doc="1 while the exporter judges the rank input-bound: data waits (`Run.timed()`, "
    "`data_time`) above `input_bound_ratio` of the step time between `log()` calls over the "
    "rate window. `TrainmonInputBound` reads this verdict, so the alert follows the setting.",
)

TRAIN_LOSS_SPIKES = Family(
    "trainmon_train_loss_spikes",
    COUNTER,
    (
        "Steps whose loss z-score against the preceding window reached spike_z[severity] (the "
        "highest severity reached is counted)."
    ),
    (*RANK, "severity"),
    unit="steps",
    collector="health",
    doc=(
        "Steps whose loss z-score reached `minor` (4), `major` (6) or `severe` (10); the highest "
        "severity reached is counted."
    ),
)

TRAIN_LOSS_SPIKES_LAST_TIMESTAMP_SECONDS = _event_time(
    TRAIN_LOSS_SPIKES,
    "a loss spike of that severity was judged",
    (
        "When this exporter judged the rank's last loss spike of `severity`. Absent "
        "until the first one. Event alerts fire on `time() - this` under their window "
        "([alerting.md](alerting.md#event-alerts)): a time does not change when "
        "Prometheus misses scrapes or restarts, so an event pages once."
    ),
)

TRAIN_GRAD_NORM_SPIKES = Family(
    "trainmon_train_grad_norm_spikes",
    COUNTER,
    "Steps whose grad-norm z-score reached spike_z[severity].",
    (*RANK, "severity"),
    unit="steps",
    collector="health",
    doc="The same for the grad norm.",
)

MONITORING_OVERHEAD_RATIO = Family(
    "trainmon_monitoring_overhead_ratio",
    GAUGE,
    (
        "Share of wall time spent in monitoring over rate_window_seconds: the client's own log() "
        "time plus operations timed with Run.track."
    ),
    RANK,
    unit="ratio",
    collector="health",
    doc="(client `log()` time + tracked operations) / wall time, over the rate window.",
)

MONITORING_OVER_BUDGET = Family(
    "trainmon_monitoring_over_budget",
    GAUGE,
    "1 when trainmon_monitoring_overhead_ratio exceeds monitoring_budget_ratio (default 0.05).",
    RANK,
    unit="0/1",
    collector="health",
    doc="The ratio above `monitoring_budget_ratio` (0.05).",
)

MONITORING_SECONDS = Family(
    "trainmon_monitoring_seconds",
    COUNTER,
    "Wall time of finished runs of each tracked operation (s, Run.track).",
    (*RANK, "operation"),
    unit="s",
    collector="health",
    doc="Wall time of finished runs of each `Run.track` operation.",
)

MONITORING_OPERATIONS = Family(
    "trainmon_monitoring_operations",
    COUNTER,
    "Finished runs of each tracked operation.",
    (*RANK, "operation"),
    unit="1",
    collector="health",
    doc="Finished runs of each operation.",
)

MONITORING_ACTIVE = Family(
    "trainmon_monitoring_active",
    GAUGE,
    "1 while the tracked operation runs.",
    (*RANK, "operation"),
    unit="0/1",
    collector="health",
    doc="1 while the operation runs.",
)

EVAL_VALUE = Family(
    "trainmon_eval_value",
    GAUGE,
    "Last value of each metric reported with Run.eval (capped like custom metrics).",
    (*RANK, "name"),
    unit="–",
    collector="health",
    doc="Other metrics passed to `Run.eval` (capped like custom metrics).",
)


# ---------- collector layers: per-layer series of Run.watch checks

LAYER_GRAD_NORM = Family(
    "trainmon_layer_grad_norm",
    GAUGE,
    "L2 norm of the layer's gradients. (Run.watch)",
    LAYER,
    unit="–",
    collector="layers",
    doc="L2 norm of the layer's gradients.",
)

LAYER_GRAD_MEAN = Family(
    "trainmon_layer_grad_mean",
    GAUGE,
    "Mean of the layer's gradient values. (Run.watch)",
    LAYER,
    unit="–",
    collector="layers",
    doc="Mean of its gradient values.",
)

LAYER_GRAD_STDDEV = Family(
    "trainmon_layer_grad_stddev",
    GAUGE,
    "Standard deviation of its gradient values. (Run.watch)",
    LAYER,
    unit="–",
    collector="layers",
    doc="Standard deviation of its gradient values.",
)

LAYER_WEIGHT_NORM = Family(
    "trainmon_layer_weight_norm",
    GAUGE,
    "L2 norm of the layer's weights. (Run.watch)",
    LAYER,
    unit="–",
    collector="layers",
    doc="L2 norm of its weights.",
)

LAYER_UPDATE_RATIO = Family(
    "trainmon_layer_update_ratio",
    GAUGE,
    (
        "||w_after - w_before|| / ||w_before|| of the last watched optimizer step (or "
        "lr*||g||/||w|| when the client runs watch(exact_update=False)). (Run.watch)"
    ),
    LAYER,
    unit="ratio",
    collector="layers",
    doc="`‖w_after − w_before‖ / ‖w_before‖` of the watched step.",
)

LAYER_ACTIVATION_MEAN = Family(
    "trainmon_layer_activation_mean",
    GAUGE,
    "Mean of the layer's output. (Run.watch)",
    LAYER,
    unit="–",
    collector="layers",
    doc="Mean of its output (`activations=True`).",
)

LAYER_ACTIVATION_STDDEV = Family(
    "trainmon_layer_activation_stddev",
    GAUGE,
    "Standard deviation of its output. (Run.watch)",
    LAYER,
    unit="–",
    collector="layers",
    doc="Standard deviation of its output (`activations=True`).",
)

LAYER_DEAD_UNITS_RATIO = Family(
    "trainmon_layer_dead_units_ratio",
    GAUGE,
    "Share of the layer's output units never above 0 in the watched batch. (Run.watch)",
    LAYER,
    unit="ratio",
    collector="layers",
    doc="Share of output units never above 0 in the batch (`activations=True`).",
)

LAYER_GRAD_PERCENTILE = Family(
    "trainmon_layer_grad_percentile",
    GAUGE,
    "Percentile of the layer's gradient values (Run.watch, at most 65,536 strided elements).",
    (*LAYER, "percentile"),
    unit="–",
    collector="layers",
    doc=(
        "Percentiles 0, 25, 50, 75, 95, 99, 100 of its gradient values (every `quantiles_every` "
        "steps). The label is `percentile` because promtool reserves `quantile` for summaries."
    ),
)


# ---------- collector rank_gpu: ranks joined to their GPU by UUID

TRAIN_MODEL_FLOPS_PER_SECOND = Family(
    "trainmon_train_model_flops_per_second",
    GAUGE,
    (
        "Model FLOP/s the rank achieves: tokens/s over rate_window_seconds x the client's "
        "flops_per_token (6 x num_params by default)."
    ),
    RANK,
    unit="FLOP/s",
    collector="rank_gpu",
    doc=(
        "`trainmon_train_tokens_per_second × flops_per_token`; the client sends `flops_per_token` "
        "(`init(num_params=N)` gives `6 × N`, Kaplan et al. 2020, or pass it)."
    ),
)

TRAIN_PEAK_FLOPS_PER_SECOND = Family(
    "trainmon_train_peak_flops_per_second",
    GAUGE,
    (
        "Peak dense FLOP/s of the rank's GPU for its dtype: the MFU denominator "
        "(trainmon_exporter.peaks datasheet table by PCI device id and NVML name, or the "
        "peak_flops setting)."
    ),
    RANK,
    unit="FLOP/s",
    collector="rank_gpu",
    doc=(
        "Dense peak of the rank's GPU model for its `dtype`, from the datasheet table below, or "
        "the `peak_flops` setting."
    ),
)

TRAIN_MFU_RATIO = Family(
    "trainmon_train_mfu_ratio",
    GAUGE,
    (
        "Model FLOPs utilisation: trainmon_train_model_flops_per_second / "
        "trainmon_train_peak_flops_per_second (PaLM, appendix B)."
    ),
    RANK,
    unit="ratio",
    collector="rank_gpu",
    doc=(
        "Model FLOPs utilisation: model FLOP/s / peak (PaLM, Chowdhery et al. 2022, appendix B). "
        "Exported as computed, even above 1: a value over 1 means an input is wrong (alert "
        "`TrainmonMfuAbovePeak`, and a health line on the status page)."
    ),
)

TRAIN_MFU_UNAVAILABLE = Family(
    "trainmon_train_mfu_unavailable",
    GAUGE,
    (
        "1 when the rank has no MFU, with the reason: no_flops_per_token (pass num_params to "
        "init), no_gpu_uuid (no CUDA device reported), gpu_not_sampled (NVML does not show that "
        "GPU), unknown_gpu_model or unknown_dtype (not in the peak table: set peak_flops)."
    ),
    (*RANK, "reason"),
    unit="1",
    collector="rank_gpu",
    doc=(
        "1 when a rank has no MFU, saying why: `no_flops_per_token` (pass `num_params` to "
        "`init`), `no_gpu_uuid` (no CUDA device reported), `gpu_not_sampled` (NVML does not show "
        "that UUID, e.g. no NVML or another node's GPU), `unknown_gpu_model` or `unknown_dtype` "
        "(not in the table; set `peak_flops`). Never a fallback to another GPU's peak."
    ),
)

RANK_GPU_MEMORY_USED_BYTES = Family(
    "trainmon_rank_gpu_memory_used_bytes",
    GAUGE,
    (
        "GPU memory of the rank's process as the driver sees it "
        "(nvmlDeviceGetComputeRunningProcesses usedGpuMemory, summed over GPUs; process found by "
        "SO_PEERCRED pid)."
    ),
    RANK,
    unit="bytes",
    collector="rank_gpu",
    doc=(
        "`usedGpuMemory` of the rank's process in `nvmlDeviceGetComputeRunningProcesses`, summed "
        "over GPUs. The process is matched by the PID the kernel reports for the socket peer "
        "(`SO_PEERCRED`), which is the host PID when the exporter shares the host PID namespace "
        "(compose: `pid: host`)."
    ),
)


# ---------- collector gpu: per-GPU series of the NVML sampler, and its state

GPU_UTILIZATION_RATIO = Family(
    "trainmon_gpu_utilization_ratio",
    GAUGE,
    (
        "Share of the last sample period (1/6 s to 1 s, by product) in which a kernel ran "
        "(nvmlDeviceGetUtilizationRates().gpu / 100). Not throughput: compare "
        "trainmon_gpu_sm_active_ratio."
    ),
    GPU,
    unit="ratio",
    collector="gpu",
    doc=(
        "`nvmlDeviceGetUtilizationRates().gpu / 100`: the share of the driver's sample period "
        "(1/6 s to 1 s) in which any kernel ran. Not throughput: a GPU running one tiny kernel "
        "all the time shows 1."
    ),
)

GPU_MEMORY_UTILIZATION_RATIO = Family(
    "trainmon_gpu_memory_utilization_ratio",
    GAUGE,
    (
        "Share of the last sample period in which device memory was read or written "
        "(nvmlDeviceGetUtilizationRates().memory / 100)."
    ),
    GPU,
    unit="ratio",
    collector="gpu",
    doc=(
        "`nvmlDeviceGetUtilizationRates().memory / 100`: share of the period device memory was "
        "read or written."
    ),
)

GPU_MEMORY_USED_BYTES = Family(
    "trainmon_gpu_memory_used_bytes",
    GAUGE,
    ("Device memory in use, all processes and the driver (nvmlDeviceGetMemoryInfo().used, bytes)."),
    GPU,
    unit="bytes",
    collector="gpu",
    doc="`nvmlDeviceGetMemoryInfo().used`: all processes plus the driver's reservation.",
)

GPU_MEMORY_FREE_BYTES = Family(
    "trainmon_gpu_memory_free_bytes",
    GAUGE,
    "Device memory free (nvmlDeviceGetMemoryInfo().free, bytes).",
    GPU,
    unit="bytes",
    collector="gpu",
    doc="`nvmlDeviceGetMemoryInfo().free`.",
)

GPU_MEMORY_SIZE_BYTES = Family(
    "trainmon_gpu_memory_size_bytes",
    GAUGE,
    "Device memory total (nvmlDeviceGetMemoryInfo().total, bytes).",
    GPU,
    unit="bytes",
    collector="gpu",
    doc="`nvmlDeviceGetMemoryInfo().total`.",
)

GPU_POWER_USAGE_WATTS = Family(
    "trainmon_gpu_power_usage_watts",
    GAUGE,
    (
        "Board power draw (nvmlDeviceGetPowerUsage, mW / 1000). For energy use the counter "
        "trainmon_gpu_energy_consumption_joules_total."
    ),
    GPU,
    unit="W",
    collector="gpu",
    doc="`nvmlDeviceGetPowerUsage` mW / 1000. Prefer the energy counter for averages.",
)

GPU_POWER_LIMIT_WATTS = Family(
    "trainmon_gpu_power_limit_watts",
    GAUGE,
    "Enforced power limit (nvmlDeviceGetEnforcedPowerLimit, mW / 1000).",
    GPU,
    unit="W",
    collector="gpu",
    doc="`nvmlDeviceGetEnforcedPowerLimit` mW / 1000.",
)

GPU_TEMPERATURE_CELSIUS = Family(
    "trainmon_gpu_temperature_celsius",
    GAUGE,
    (
        "GPU die temperature (nvmlDeviceGetTemperature, or nvmlDeviceGetTemperatureV where a "
        "driver lacks it; NVML_TEMPERATURE_GPU, °C)."
    ),
    GPU,
    unit="°C",
    collector="gpu",
    doc=(
        "`nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)` (`nvmlDeviceGetTemperatureV` on a "
        "driver without it)."
    ),
)

GPU_MEMORY_TEMPERATURE_CELSIUS = Family(
    "trainmon_gpu_memory_temperature_celsius",
    GAUGE,
    (
        "HBM temperature where the device reports it (nvmlDeviceGetFieldValues "
        "NVML_FI_DEV_MEMORY_TEMP, °C)."
    ),
    GPU,
    unit="°C",
    collector="gpu",
    doc="`nvmlDeviceGetFieldValues(NVML_FI_DEV_MEMORY_TEMP)`, on HBM parts.",
)

GPU_SM_CLOCK_HERTZ = Family(
    "trainmon_gpu_sm_clock_hertz",
    GAUGE,
    "SM clock (nvmlDeviceGetClockInfo NVML_CLOCK_SM, MHz x 1e6).",
    GPU,
    unit="Hz",
    collector="gpu",
    doc="`nvmlDeviceGetClockInfo(NVML_CLOCK_SM)` MHz × 1e6.",
)

GPU_MEMORY_CLOCK_HERTZ = Family(
    "trainmon_gpu_memory_clock_hertz",
    GAUGE,
    "Memory clock (nvmlDeviceGetClockInfo NVML_CLOCK_MEM, MHz x 1e6).",
    GPU,
    unit="Hz",
    collector="gpu",
    doc="`nvmlDeviceGetClockInfo(NVML_CLOCK_MEM)` MHz × 1e6.",
)

GPU_SM_CLOCK_MAX_HERTZ = Family(
    "trainmon_gpu_sm_clock_max_hertz",
    GAUGE,
    "Highest SM clock (nvmlDeviceGetMaxClockInfo NVML_CLOCK_SM, MHz x 1e6).",
    GPU,
    unit="Hz",
    collector="gpu",
    doc=(
        "`nvmlDeviceGetMaxClockInfo(NVML_CLOCK_SM)` MHz × 1e6, read once. "
        "`sm_clock / sm_clock_max` is how far clocks are held down."
    ),
)

GPU_MEMORY_CLOCK_MAX_HERTZ = Family(
    "trainmon_gpu_memory_clock_max_hertz",
    GAUGE,
    "Highest memory clock (nvmlDeviceGetMaxClockInfo NVML_CLOCK_MEM, MHz x 1e6).",
    GPU,
    unit="Hz",
    collector="gpu",
    doc="`nvmlDeviceGetMaxClockInfo(NVML_CLOCK_MEM)` MHz × 1e6, read once.",
)

GPU_REMAPPED_ROWS_PENDING = Family(
    "trainmon_gpu_remapped_rows_pending",
    GAUGE,
    (
        "1 if remapped memory rows wait for a GPU reset to take effect (nvmlDeviceGetRemappedRows "
        "isPending)."
    ),
    GPU,
    unit="0/1",
    collector="gpu",
    doc="A remapping waits for a GPU reset.",
)

GPU_REMAPPED_ROWS_FAILED = Family(
    "trainmon_gpu_remapped_rows_failed",
    GAUGE,
    (
        "1 if a row remapping failed: the GPU needs service (nvmlDeviceGetRemappedRows "
        "failureOccurred)."
    ),
    GPU,
    unit="0/1",
    collector="gpu",
    doc="A remapping failed: the board needs service.",
)

GPU_PROCESSES = Family(
    "trainmon_gpu_processes",
    GAUGE,
    (
        "Compute processes on the GPU (len(nvmlDeviceGetComputeRunningProcesses_v3), or _v2 / v1 "
        "on drivers without it)."
    ),
    GPU,
    unit="processes",
    collector="gpu",
    doc=(
        "`len(nvmlDeviceGetComputeRunningProcesses_v3())`, `_v2` or v1 on drivers without it (off "
        "with `--no-nvml-processes`)."
    ),
)

GPU_SM_ACTIVE_RATIO = Family(
    "trainmon_gpu_sm_active_ratio",
    GAUGE,
    (
        "Share of SMs busy between two samples (NVML GPM NVML_GPM_METRIC_SM_UTIL / 100; Hopper "
        "and newer)."
    ),
    GPU,
    unit="ratio",
    collector="gpu",
    doc=(
        "NVML GPM `NVML_GPM_METRIC_SM_UTIL / 100` between two passes: share of SMs busy. Hopper "
        "and newer (`nvmlGpmQueryDeviceSupport`). Unlike DCGM's profiling fields, GPM does not "
        "lock out Nsight."
    ),
)

GPU_SM_OCCUPANCY_RATIO = Family(
    "trainmon_gpu_sm_occupancy_ratio",
    GAUGE,
    (
        "Resident warps over the maximum between two samples (NVML GPM "
        "NVML_GPM_METRIC_SM_OCCUPANCY / 100)."
    ),
    GPU,
    unit="ratio",
    collector="gpu",
    doc="GPM `NVML_GPM_METRIC_SM_OCCUPANCY / 100`: resident warps over the maximum.",
)

GPU_TENSOR_ACTIVE_RATIO = Family(
    "trainmon_gpu_tensor_active_ratio",
    GAUGE,
    (
        "Share of time the tensor pipes were busy between two samples (NVML GPM "
        "NVML_GPM_METRIC_ANY_TENSOR_UTIL / 100): the hardware's view of MFU."
    ),
    GPU,
    unit="ratio",
    collector="gpu",
    doc=(
        "GPM `NVML_GPM_METRIC_ANY_TENSOR_UTIL / 100`: share of time the tensor pipes were busy, "
        "the hardware's cross-check of MFU."
    ),
)

GPU_DRAM_ACTIVE_RATIO = Family(
    "trainmon_gpu_dram_active_ratio",
    GAUGE,
    (
        "DRAM bandwidth used over its peak between two samples (NVML GPM "
        "NVML_GPM_METRIC_DRAM_BW_UTIL / 100)."
    ),
    GPU,
    unit="ratio",
    collector="gpu",
    doc="GPM `NVML_GPM_METRIC_DRAM_BW_UTIL / 100`: DRAM bandwidth used over its peak.",
)

GPU_ENERGY_CONSUMPTION_JOULES = Family(
    "trainmon_gpu_energy_consumption_joules",
    COUNTER,
    (
        "Energy since the driver loaded (nvmlDeviceGetTotalEnergyConsumption, mJ / 1000), read "
        "every nvml_slow_interval_seconds (15 s by default), as of "
        "trainmon_gpu_slow_sample_timestamp_seconds."
    ),
    GPU,
    unit="J",
    collector="gpu",
    doc=(
        "`nvmlDeviceGetTotalEnergyConsumption` mJ / 1000, since the driver loaded (Volta and "
        "newer). `rate()` gives average watts over any window. A slow reading (2.3–2.8 ms a "
        "call on an H200): read every `--nvml-slow-interval-seconds` (15 s), not every pass; "
        "the value is as of `trainmon_gpu_slow_sample_timestamp_seconds`."
    ),
)

GPU_PCIE_TRANSMIT_BYTES = Family(
    "trainmon_gpu_pcie_transmit_bytes",
    COUNTER,
    (
        "Bytes sent over PCIe (nvmlDeviceGetFieldValues NVML_FI_DEV_PCIE_COUNT_TX_BYTES), read "
        "every nvml_slow_interval_seconds (15 s by default), as of "
        "trainmon_gpu_slow_sample_timestamp_seconds."
    ),
    GPU,
    unit="bytes",
    collector="gpu",
    doc=(
        "`nvmlDeviceGetFieldValues(NVML_FI_DEV_PCIE_COUNT_TX_BYTES)`, a field drivers have from "
        "R555 on (absent before). Counters rather than the KB/s rate of "
        "`nvmlDeviceGetPcieThroughput`, so `rate()` loses nothing over windows longer than "
        "their interval. A slow reading (135 µs a field on an H200), like the energy counter."
    ),
)

GPU_PCIE_RECEIVE_BYTES = Family(
    "trainmon_gpu_pcie_receive_bytes",
    COUNTER,
    (
        "Bytes received over PCIe (nvmlDeviceGetFieldValues NVML_FI_DEV_PCIE_COUNT_RX_BYTES), "
        "read every nvml_slow_interval_seconds (15 s by default), as of "
        "trainmon_gpu_slow_sample_timestamp_seconds."
    ),
    GPU,
    unit="bytes",
    collector="gpu",
    doc=(
        "`nvmlDeviceGetFieldValues(NVML_FI_DEV_PCIE_COUNT_RX_BYTES)`, from R555 on, a slow "
        "reading, as above."
    ),
)

GPU_NVLINK_TRANSMIT_BYTES = Family(
    "trainmon_gpu_nvlink_transmit_bytes",
    COUNTER,
    (
        "Data bytes sent over NVLink, all links (nvmlDeviceGetFieldValues "
        "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, KiB x 1024)."
    ),
    GPU,
    unit="bytes",
    collector="gpu",
    doc=(
        "`nvmlDeviceGetFieldValues(NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX)` (scope 0) KiB × 1024; "
        "absent without NVLink."
    ),
)

GPU_NVLINK_RECEIVE_BYTES = Family(
    "trainmon_gpu_nvlink_receive_bytes",
    COUNTER,
    (
        "Data bytes received over NVLink, all links (nvmlDeviceGetFieldValues "
        "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, KiB x 1024)."
    ),
    GPU,
    unit="bytes",
    collector="gpu",
    doc=(
        "`nvmlDeviceGetFieldValues(NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX)` (scope 0) KiB × 1024; "
        "absent without NVLink."
    ),
)

GPU_INFO = Family(
    "trainmon_gpu_info",
    GAUGE,
    (
        "Always 1; a GPU's identity: nvmlDeviceGetName, nvmlDeviceGetPciInfo (bus id, device id) "
        "and nvmlSystemGetDriverVersion."
    ),
    (*GPU, "name", "pci_bus_id", "pci_device_id", "driver_version"),
    unit="1",
    collector="gpu",
    doc=(
        "`nvmlDeviceGetName`, `nvmlDeviceGetPciInfo_v3` (`_v2`, v1 where missing; `busId` as "
        "`00000000:3B:00.0`, `pciDeviceId` as 0x… hex), `nvmlSystemGetDriverVersion`. A label "
        "NVML could not read is empty."
    ),
)

GPU_CLOCK_EVENT_REASON_ACTIVE = Family(
    "trainmon_gpu_clock_event_reason_active",
    GAUGE,
    (
        "1 while NVML reports this reason for holding clocks down "
        "(nvmlDeviceGetCurrentClocksEventReasons bit; ...ThrottleReasons before R535); "
        "hw_slowdown, sw_thermal_slowdown, hw_thermal_slowdown and hw_power_brake_slowdown slow "
        "training (sw_power_cap is normal at full load)."
    ),
    (*GPU, "reason"),
    unit="0/1",
    collector="gpu",
    doc=(
        "One series per bit of `nvmlDeviceGetCurrentClocksEventReasons` (R535 on; "
        "`nvmlDeviceGetCurrentClocksThrottleReasons`, the same bits, before): `gpu_idle`, "
        "`applications_clocks_setting`, `sw_power_cap`, `hw_slowdown`, `sync_boost`, "
        "`sw_thermal_slowdown`, `hw_thermal_slowdown`, `hw_power_brake_slowdown`, "
        "`display_clock_setting`. `hw_slowdown`, `sw_thermal_slowdown`, `hw_thermal_slowdown` "
        "and `hw_power_brake_slowdown` mean a slowed GPU: `TrainmonGpuThrottled` alerts on "
        "them and the status views show them as `slowdown`. `sw_power_cap` does not: a GPU "
        "training flat out sits at its power limit by design."
    ),
)

GPU_ECC_ERRORS = Family(
    "trainmon_gpu_ecc_errors",
    COUNTER,
    (
        "ECC memory errors (nvmlDeviceGetTotalEccErrors): error_type corrected|uncorrected; "
        "counter_type volatile (since the driver loaded) | aggregate (lifetime)."
    ),
    (*GPU, "error_type", "counter_type"),
    unit="errors",
    collector="gpu",
    doc=(
        "`nvmlDeviceGetTotalEccErrors`; `error_type` `corrected` or `uncorrected`, `counter_type` "
        "`volatile` (since the driver loaded) or `aggregate` (lifetime of the board). Absent with "
        "ECC off."
    ),
)

GPU_REMAPPED_ROWS = Family(
    "trainmon_gpu_remapped_rows",
    COUNTER,
    "Memory rows remapped (nvmlDeviceGetRemappedRows), by cause correctable|uncorrectable.",
    (*GPU, "cause"),
    unit="rows",
    collector="gpu",
    doc=(
        "`nvmlDeviceGetRemappedRows`, `cause` `correctable` or `uncorrectable` (Ampere and newer)."
    ),
)

GPU_XID_ERRORS = Family(
    "trainmon_gpu_xid_errors",
    COUNTER,
    (
        "XID critical errors (NVML event nvmlEventTypeXidCriticalError) since the exporter "
        "started, by XID code (see NVIDIA's XID catalogue); past 32 codes on one GPU, new ones "
        "count as 'other'."
    ),
    (*GPU, "xid"),
    unit="errors",
    collector="gpu",
    doc=(
        "XID critical-error events (`nvmlDeviceRegisterEvents(nvmlEventTypeXidCriticalError)`, "
        "drained each pass with `nvmlEventSetWait(…, 0 ms)`, so the sampler never blocks), by XID "
        "code, since the exporter started. 48 is a double-bit ECC error, 79 a GPU that fell off "
        "the bus, 13/31/43 usually the application. At most 32 codes per GPU; later new codes "
        'count under `xid="other"`.'
    ),
)

GPU_XID_ERRORS_LAST_TIMESTAMP_SECONDS = _event_time(
    GPU_XID_ERRORS,
    "an XID of that code was drained from NVML",
    (
        "When the sampler drained the GPU's last XID event of code `xid` (within one "
        "sampling interval of the error). Absent until the first one. Event alerts "
        "fire on `time() - this` under their window "
        "([alerting.md](alerting.md#event-alerts)): a time does not change when "
        "Prometheus misses scrapes or restarts, so an event pages once."
    ),
)

GPU_SAMPLE_DURATION_SECONDS = Family(
    "trainmon_gpu_sample_duration_seconds",
    GAUGE,
    "Wall time of the last NVML sampling pass over all GPUs (s, time.perf_counter).",
    (),
    unit="s",
    collector="gpu",
    doc=(
        "Wall time of the last sampling pass over all GPUs. A pass that also reads the slow "
        "readings (energy, PCIe counters; every `--nvml-slow-interval-seconds`) takes longer."
    ),
)

GPU_SLOW_SAMPLE_TIMESTAMP_SECONDS = Family(
    "trainmon_gpu_slow_sample_timestamp_seconds",
    GAUGE,
    (
        "When this GPU's slow readings were last taken (Unix s): the energy and PCIe byte "
        "counters, read every nvml_slow_interval_seconds (15 s by default) instead of every "
        "pass."
    ),
    GPU,
    unit="Unix s",
    collector="gpu",
    doc=(
        "When the values of `trainmon_gpu_energy_consumption_joules_total` and the PCIe byte "
        "counters were read. They cost most of a pass on an H200 (2.3–2.8 ms and 2 × 135 µs "
        "against 1–6 µs for other calls), so they are read every `--nvml-slow-interval-seconds` "
        "(15 s) and on the first pass over a GPU, and again on the next pass after a failed "
        "read. Absent while the GPU has none of them."
    ),
)

GPU_SAMPLE_TIMESTAMP_SECONDS = Family(
    "trainmon_gpu_sample_timestamp_seconds",
    GAUGE,
    "When the last NVML sampling pass finished (Unix s).",
    (),
    unit="Unix s",
    collector="gpu",
    doc=(
        "When it finished. `time() - this` above a few intervals means the sampler is stuck in "
        "the driver."
    ),
)

GPU_NVML_AVAILABLE = Family(
    "trainmon_gpu_nvml_available",
    GAUGE,
    (
        "1 while NVML is initialised and sampling; 0 with no NVIDIA library or driver (a node "
        "without GPUs) or NVML failing (sampler state)."
    ),
    (),
    unit="0/1",
    collector="gpu",
    doc=(
        "1 while NVML is initialised and sampling; 0 with no NVIDIA library or driver, or NVML "
        "failing. On every node, GPUs or not. A boolean gauge, so no unit suffix, and "
        "`_available` rather than `_up`, which Prometheus reserves for its own scrape status."
    ),
)

GPU_EXPECTED = Family(
    "trainmon_gpu_expected",
    GAUGE,
    (
        "1 when this node should have GPU metrics: --require-gpus, NVML worked since the exporter "
        "started, or NVML is installed but cannot be used; 0 on a node without an NVIDIA driver "
        "(sampler state)."
    ),
    (),
    unit="0/1",
    collector="gpu",
    doc=(
        "1 when this node should have GPU metrics: `--require-gpus`, NVML worked since the "
        "exporter started, or a driver is installed but NVML cannot be used. 0 on a node without "
        "an NVIDIA driver. Kept apart from `trainmon_gpu_nvml_available` so that an alert can ask "
        'for "expected and not available" without the exporter deciding what pages.'
    ),
)

GPU_DEVICES = Family(
    "trainmon_gpu_devices",
    GAUGE,
    "GPUs sampled in the last pass.",
    (),
    unit="GPUs",
    collector="gpu",
    doc="GPUs sampled in the last pass (0 without NVML).",
)

GPU_LOST = Family(
    "trainmon_gpu_lost",
    COUNTER,
    (
        "GPUs that NVML reported lost (NVML_ERROR_GPU_IS_LOST) since the exporter started; their "
        "series are dropped."
    ),
    (),
    unit="GPUs",
    collector="gpu",
    doc=(
        "GPUs dropped because NVML reported them lost, plus GPUs missing when NVML comes back "
        "after failing. Exists at 0 on every node."
    ),
)

GPU_LOST_LAST_TIMESTAMP_SECONDS = _event_time(
    GPU_LOST,
    "a GPU the sampler had sampled was found lost",
    (
        "When this exporter last found a GPU it had sampled lost (NVML_ERROR_GPU_IS_LOST while "
        "sampling, or gone when NVML came back after failing). GPUs already lost when it first "
        "enumerates them count in `trainmon_gpu_lost_total` only: their loss predates the "
        "exporter. Absent until the first one. Event alerts fire on `time() - this` under their "
        "window ([alerting.md](alerting.md#event-alerts))."
    ),
)

GPU_READ_ERRORS = Family(
    "trainmon_gpu_read_errors",
    COUNTER,
    (
        "NVML reads that failed other than 'not supported' or a function the driver lacks, by "
        "nvmlReturn_t name ('other': another code; 'exception': a Python exception in the "
        "bindings)."
    ),
    ("error",),
    unit="reads",
    collector="gpu",
    doc=(
        'NVML reads that failed for a reason other than "not supported" or a function the driver '
        "lacks, by `nvmlReturn_t` name, lower case: `uninitialized`, `invalid_argument`, "
        "`no_permission`, `not_found`, `insufficient_size`, `insufficient_power`, `timeout`, "
        "`irq_issue`, `corrupted_inforom`, `reset_required`, `operating_system`, `memory`, "
        "`no_data`, `unknown`; `other` for any other code and `exception` for a Python exception "
        "from the bindings. All 16 exist at 0 on every node, so `increase()` sees the first "
        "error."
    ),
)


# ---------- collector exporter: the exporter's identity and state sizes

BUILD_INFO = Family(
    "trainmon_build_info",
    GAUGE,
    "Always 1; labels name the exporter version, git revision and Python version.",
    ("version", "revision", "python_version"),
    unit="1",
    collector="exporter",
    doc="Exporter identity.",
)

EXPORTER_RANKS = Family(
    "trainmon_exporter_ranks",
    GAUGE,
    "(run, rank) pairs whose series are exported now.",
    (),
    unit="pairs",
    collector="exporter",
    doc="(run, rank) pairs exported now.",
)

EXPORTER_RANKS_EXPIRED = Family(
    "trainmon_exporter_ranks_expired",
    COUNTER,
    "(run, rank) pairs dropped after series_ttl_seconds without a connection.",
    (),
    unit="pairs",
    collector="exporter",
    doc="Pairs dropped `series_ttl_seconds` after they disconnected.",
)

EXPORTER_DEPARTED_RANKS = Family(
    "trainmon_exporter_departed_ranks",
    GAUGE,
    (
        "Ranks whose state expired or was evicted without a clean finish, whose time "
        "accounting is kept (and exported) for goodput_retention_seconds."
    ),
    (),
    unit="pairs",
    collector="exporter",
    doc=(
        "(run, rank) pairs that left without a clean finish and whose goodput series are still "
        "exported, for `goodput_retention_seconds` and at most `max_ranks` of them: a rank that "
        "comes back adopts its accounting, and the recording rules still see the time a run "
        "spent on this node after it moved elsewhere."
    ),
)

EXPORTER_DEPARTED_EVICTED = Family(
    "trainmon_exporter_departed_evicted",
    COUNTER,
    "Departed ranks' accounting dropped before goodput_retention_seconds to stay within max_ranks.",
    (),
    unit="pairs",
    collector="exporter",
    doc="Departed pairs' accounting dropped, oldest first, to keep at most `max_ranks` of them.",
)

EXPORTER_STATE_SAVES = Family(
    "trainmon_exporter_state_saves",
    COUNTER,
    "Writes of the state file (state_file), by result: ok or error (logged).",
    ("result",),
    unit="writes",
    collector="exporter",
    doc=(
        "Writes of the state file every `state_save_interval_seconds` and at shutdown, by "
        "`result`: `ok`, or `error` (the directory is not writable, the disk is full: logged)."
    ),
)

EXPORTER_STATE_LAST_SAVE_TIMESTAMP_SECONDS = Family(
    "trainmon_exporter_state_last_save_timestamp_seconds",
    GAUGE,
    "When the state file was last written (Unix s); 0 before the first write.",
    (),
    unit="s",
    collector="exporter",
    doc="When the state file was last written (Unix seconds); 0 before the first write.",
)

EXPORTER_STATE_REFUSED = Family(
    "trainmon_exporter_state_refused",
    COUNTER,
    (
        "State files (or rows of one) refused at start, by reason: unsafe, too_large, "
        "corrupt, foreign, future_version, unreadable, bad_row. Logged; the exporter starts "
        "without them."
    ),
    ("reason",),
    unit="files",
    collector="exporter",
    doc=(
        "A state file refused at start, by `reason`: `unsafe` (another user could write it, "
        "or it is a symbolic link), `too_large`, `corrupt` (not JSON), `foreign` (not a "
        "trainmon exporter's), `future_version` (written by a later exporter), `unreadable`; "
        "`bad_row` counts each row of an accepted file that fails its checks. The exporter "
        "logs why, sets a refused file aside as `<file>.refused`, and starts without it."
    ),
)

EXPORTER_STATE_RESTORED = Family(
    "trainmon_exporter_state_restored",
    GAUGE,
    "Rows restored from the state file at start, by kind: rank (live) or departed.",
    ("kind",),
    unit="pairs",
    collector="exporter",
    doc=(
        "Rows taken back from the state file when the exporter started, by `kind`: `rank` (a "
        "rank that was connected or within its TTL) and `departed` (kept accounting)."
    ),
)

EXPORTER_RANKS_EVICTED = Family(
    "trainmon_exporter_ranks_evicted",
    COUNTER,
    (
        "(run, rank) pairs dropped before series_ttl_seconds to make room for a new rank (a cap "
        "or a tenant's quota reached), by status: disconnected ones by the status they ended "
        "with (finished and failed first, then crashed, then running: closed by the exporter), "
        "none within rank_retention_seconds of disconnecting; idle and live are connected ones "
        "taken from a tenant above its fair share for one below it (idle: no step since "
        "connecting)."
    ),
    ("status",),
    unit="pairs",
    collector="exporter",
    doc=(
        "Pairs dropped before their TTL to make room for a new rank when `max_ranks`, "
        "`max_series` or the new rank's tenant quota (`max_ranks_per_uid`, `max_series_per_uid`) "
        "is reached. Disconnected ones by the status they ended with: `finished` and `failed` go "
        "first, then `crashed`, then `running` (closed by the exporter: idle or shutdown); "
        "oldest first within each, the new rank's own tenant's first; none within "
        "`rank_retention_seconds` of disconnecting, whoever connects; a tenant at its quota "
        "evicts only its own ranks. When the node is full and none is past retention, a tenant "
        "(a verified namespace, else a uid) below its fair share (the cap divided among the "
        "tenants holding ranks) takes a connected pair from a tenant above it: `idle` (no step "
        "since it connected: squatting or still loading; these first) or `live` (the largest "
        "holder's newest); its connection is closed and its client told `evicted`. The run id "
        "stays its owner's until the TTL."
    ),
)

HANG_CAPTURE_REQUESTS = Family(
    "trainmon_hang_capture_requests",
    COUNTER,
    "Requests for stacks and collective state sent to ranks judged hung (one per hang episode).",
    (),
    unit="requests",
    collector="exporter",
    doc="CAPTURE_REQUEST records sent, one per hang episode of a rank (`hang_capture`).",
)

HANG_CAPTURES = Family(
    "trainmon_hang_captures",
    COUNTER,
    (
        "What became of each request for a hung rank's stacks: captured (answered), no_answer "
        "(none within hang_capture_timeout_seconds), not_sent (the connection refused it)."
    ),
    ("result",),
    unit="requests",
    collector="exporter",
    doc=(
        "Requests by outcome: `captured`, `no_answer` (native code holding the GIL, a stopped "
        "process, a client that predates capture; a late answer moves it to `captured`), "
        "`not_sent`."
    ),
)

HANG_EVIDENCE_DROPPED = Family(
    "trainmon_hang_evidence_dropped",
    COUNTER,
    (
        "Hang evidence refused or dropped: unsolicited, late (after the rank stepped again), "
        "too_large (over hang_capture_max_bytes), invalid, budget (hang_evidence_max_bytes held "
        "by hung ranks), evicted."
    ),
    ("reason",),
    unit="answers",
    collector="exporter",
    doc=(
        "Answers refused: `unsolicited` (no request of that connection waits for it), "
        "`late` (after the wait ran out and the rank stepped again: where it is now, not where "
        "it hung), `too_large`, `invalid` (breaks the layout of docs/hangs.md), `budget`; and "
        "`evicted`: older evidence of a rank no longer hung, dropped to make room."
    ),
)

HANG_EVIDENCE_BYTES = Family(
    "trainmon_hang_evidence_bytes",
    GAUGE,
    "Bytes of hang evidence held (answers' JSON, native stacks), at most hang_evidence_max_bytes.",
    (),
    unit="bytes",
    collector="exporter",
    doc="Hang evidence held for every rank together, bounded by `hang_evidence_max_bytes`.",
)

EXPORTER_SERIES = Family(
    "trainmon_exporter_series",
    GAUGE,
    (
        "Estimated series of every rank in the exposition, against the max_series budget (per "
        "rank, custom metric, evaluation value, operation and exported layer)."
    ),
    (),
    unit="series",
    collector="exporter",
    doc=(
        "Estimated series of every rank in the exposition (124 per rank, 1 per custom metric or "
        "evaluation value, 3 per operation, 15 per exported layer), held under `max_series`."
    ),
)


INGEST_HELLOS_REFUSED = Family(
    "trainmon_ingest_hellos_refused",
    COUNTER,
    (
        "HELLOs refused, so trainers turned away, by reason, by the namespace of the sender's "
        "pod as the node tells it (left out where none) and by its uid (SO_PEERCRED; the first "
        "64 namespace and uid pairs refused get their own label values, later ones share "
        'uid="other"). A series appears with its first refusal.'
    ),
    ("reason", "namespace", "uid"),
    unit="HELLOs",
    collector="exporter",
    doc=(
        "HELLOs refused, each a trainer turned away (its connection closed), by the refusal "
        "reason of `trainmon_ingest_messages_invalid_total` (`not_owner`, `duplicate_rank`, "
        "`uid_rank_quota`, `uid_series_quota`, `too_many_ranks`, `series_budget`, "
        "`namespace_mismatch`, `peer_not_allowed`, `bad_hello`, or a protocol reason such as "
        "`malformed`), the namespace of the sender's pod as the node tells it "
        "(`kubelet_pod_logs_dir`; never the namespace the HELLO claims, and left out where "
        "there is none, so Prometheus gives the series the exporter's own) and the uid of the "
        "process (`SO_PEERCRED`; `unknown` where the kernel gave none). With the node "
        "DaemonSet's `honorLabels`, a refusal thus carries the namespace of the team it hurt, "
        "and so does `TrainmonTrainerRefused`. The labels are bounded: the first 64 namespace "
        "and uid pairs refused since the exporter started get their own values, later ones "
        'share `uid="other"`. A series appears with its first refusal (its first sample may '
        "be above 0); `TrainmonTrainerRefused` reads the time of the last one instead "
        "(`trainmon_ingest_hellos_refused_last_timestamp_seconds`)."
    ),
)

INGEST_HELLOS_REFUSED_LAST_TIMESTAMP_SECONDS = _event_time(
    INGEST_HELLOS_REFUSED,
    "a HELLO from that namespace and uid was refused for that reason",
    (
        "When the exporter last refused a HELLO for `reason` from `namespace` and `uid`. "
        "Absent until "
        "the first one. Event alerts fire on `time() - this` under their window "
        "([alerting.md](alerting.md#event-alerts)): a time does not change when "
        "Prometheus misses scrapes or restarts, so an event pages once."
    ),
)

EXPORTER_TENANT_RANKS = Family(
    "trainmon_exporter_tenant_ranks",
    GAUGE,
    (
        "(run, rank) pairs each tenant holds, connected or not: a tenant is the namespace of "
        "its trainers' pod as the node tells it (namespace label), else their uid (uid label). "
        'The 32 largest holders have their own series, the rest are summed under uid="other".'
    ),
    (NAMESPACE, "uid"),
    unit="pairs",
    collector="exporter",
    doc=(
        "(run, rank) pairs each tenant holds, connected or not, against `max_ranks_per_uid` "
        "(its quota) and its fair share of `max_ranks`. A tenant is the namespace of its "
        "trainers' pod as the node tells it (`namespace` label, with `kubelet_pod_logs_dir`), "
        "else their uid (`uid` label: `SO_PEERCRED`). Bounded: the 32 tenants holding most "
        'have their own series, the others are summed into one with `uid="other"`. Who '
        "holds the slots when `too_many_ranks` refusals appear."
    ),
)

EXPORTER_TENANT_SERIES = Family(
    "trainmon_exporter_tenant_series",
    GAUGE,
    (
        "Estimated series each tenant's ranks cost, against max_series_per_uid and its fair "
        "share of max_series; the tenants of trainmon_exporter_tenant_ranks."
    ),
    (NAMESPACE, "uid"),
    unit="series",
    collector="exporter",
    doc=(
        "Estimated series of each tenant's ranks (as `trainmon_exporter_series` counts them), "
        "against `max_series_per_uid` and its fair share of `max_series`; the same tenants and "
        "`other` as `trainmon_exporter_tenant_ranks`."
    ),
)

OWNER_CLAIMS_INVALID = Family(
    "trainmon_owner_claims_invalid",
    COUNTER,
    (
        "Owner claims ignored at a HELLO, by problem: unsafe_dir (the claims directory or its "
        "path could be changed by another user, or is a symbolic link), unsafe_file (a "
        "symbolic link, not a regular file, or writable by another user), malformed (not one "
        "decimal uid), unreadable. The run is then first come, first served."
    ),
    ("problem",),
    unit="claims",
    collector="exporter",
    doc=(
        "Owner claims (`owner_claims_dir`, written by the Slurm prolog) ignored at a HELLO, by "
        "problem: `unsafe_dir` (the directory, or a directory on its path, is a symbolic link "
        "or belongs to a user other than root or the exporter's, or could be written by "
        "another user), `unsafe_file` (the claim is a symbolic link, not a regular file, or "
        "belongs to or may be written by another user), `malformed` (not one decimal uid), "
        "`unreadable` (an I/O error). Each is logged; the run is then first come, first "
        "served, as without a claim. Counted at each look-up, so a trainer retrying counts "
        "again."
    ),
)

# ---------- ingest: the socket server's instruments (trainmon_exporter.ingest.IngestMetrics)

INGEST_PACKETS = Family(
    "trainmon_ingest_packets",
    COUNTER,
    "Packets read from trainer sockets (one per client flush).",
    (),
    unit="packets",
    collector="ingest",
    doc="Packets read (one per client flush).",
)

INGEST_BYTES = Family(
    "trainmon_ingest_bytes",
    COUNTER,
    "Bytes read from trainer sockets.",
    (),
    unit="bytes",
    collector="ingest",
    doc="Bytes read.",
)

INGEST_MESSAGES = Family(
    "trainmon_ingest_messages",
    COUNTER,
    "Valid records applied, by record type (hello, name, step, finish, eval, track, checkpoint, "
    "layers, totals).",
    ("type",),
    unit="records",
    collector="ingest",
    doc=(
        "Valid records applied: `hello`, `name`, `step`, `finish`, `eval`, `track`, `checkpoint`, "
        "`layers`, `totals`."
    ),
)

INGEST_MESSAGES_INVALID = Family(
    "trainmon_ingest_messages_invalid",
    COUNTER,
    "Packets or records dropped as invalid, by reason (see docs/metrics.md).",
    ("reason",),
    unit="records",
    collector="ingest",
    doc=(
        "Packets or records refused. Reasons: `oversized` (over 64 KiB), `truncated`, "
        "`bad_magic`, `unknown_version`, `unknown_type`, `malformed` (bad JSON, bad UTF-8, "
        "reserved id, bad status), `no_hello` (data before HELLO), `duplicate_hello`, `bad_hello` "
        "(wrong types, or a run id or hostname that is too long or has control characters), "
        "`invalid_name` (quotes, spaces, newlines, over 128 characters), `duplicate_rank` (that "
        "(run, rank) is already connected), `too_many_ranks` (`max_ranks`, and no disconnected "
        "rank past `rank_retention_seconds`), `name_cap` (a NAME "
        "past the 4,096 names one connection may bind), `not_owner` (a HELLO from a uid other "
        "than the one that opened the run: a new rank or a reconnect, see "
        "[exporter.md](exporter.md#who-may-write)), `peer_not_allowed` (a HELLO from a process "
        "outside `allowed_uids`/`allowed_gids`), `series_budget` (a new rank while `max_series` "
        "is spent and no disconnected rank is past `rank_retention_seconds`), `uid_rank_quota` "
        "(a new rank of a uid that holds `max_ranks_per_uid` ranks, none of its own past "
        "retention), `uid_series_quota` (a new rank of a uid whose share `max_series_per_uid` "
        "is spent; both quotas are a tenant's: the verified namespace where there is one), "
        "`namespace_mismatch` (a HELLO naming a namespace other than its sender's pod's, as the "
        "node tells it), `empty` (a zero-length packet; the connection stays open), "
        "`internal_error` (a record whose application raised: dropped and logged, the rest of the "
        "packet applies, the rank stays connected). A connection whose HELLO is refused is "
        "closed; every record after that HELLO in its packet counts as `no_hello`."
    ),
)

INGEST_MESSAGES_INVALID_LAST_TIMESTAMP_SECONDS = _event_time(
    INGEST_MESSAGES_INVALID,
    "a packet or record was refused for that reason",
    (
        "When the exporter last refused a packet or record for `reason`. Absent until "
        "the first one. Event alerts fire on `time() - this` under their window "
        "([alerting.md](alerting.md#event-alerts)): a time does not change when "
        "Prometheus misses scrapes or restarts, so an event pages once."
    ),
)

INGEST_VALUES_DROPPED = Family(
    "trainmon_ingest_values_dropped",
    COUNTER,
    (
        "Values of valid records that were dropped, by reason: unknown_field (no NAME for the "
        "id), custom_cap (over max_custom_metrics), layer_cap (over max_layers), layer_rank "
        "(layers of a rank outside layer_ranks: analysed, not exported), unknown_hello_key, "
        "operation_cap (over max_operations), series_budget (max_series spent), bad_counter (a "
        "cumulative total that was not finite, negative or went back), unknown_stat (a layer "
        "value under a stat code the protocol does not define), label_rewritten (a HELLO label "
        "value kept with characters outside letters, digits and ._-:/+ replaced), "
        "pod_rewritten (a HELLO's pod name that is not its sender's pod: the node's kept)."
    ),
    ("reason",),
    unit="values",
    collector="ingest",
    doc=(
        "Values inside valid records that were dropped: `unknown_field` (an id with no accepted "
        "NAME), `custom_cap` (a new custom name past `max_custom_metrics`), `layer_cap` (a layer "
        "past `max_layers`), `layer_rank` (a layer of a rank outside `layer_ranks`: analysed, not "
        "exported), `unknown_hello_key`, `operation_cap` (a new operation name, `Run.track` or "
        "`watch`, past `max_operations` per rank), `series_budget` (a new custom metric, "
        "evaluation value, operation or layer while `max_series` is spent), `bad_counter` (a "
        "cumulative total of a STEP, tokens, samples or client overhead, that is NaN, infinite, "
        "negative, or lower than the previous one without a client restart: the total keeps its "
        "previous value), `unknown_stat` (a value of a LAYERS record under a stat code the "
        "protocol does not define: never stored), `label_rewritten` (a HELLO value that becomes "
        "a label of `trainmon_rank_info`, hostname, GPU UUID, client version or dtype, with "
        "characters outside ASCII letters, digits and `. _ - : / +`: kept with accents and "
        "combining marks removed and any other character replaced by `_`, see "
        "[reliability.md](reliability.md#who-may-write)), `pod_rewritten` (a HELLO's pod name "
        "that is not the pod the node places its sender in, with `kubelet_pod_logs_dir`: the "
        "node's name is kept)."
    ),
)

INGEST_CONNECTIONS = Family(
    "trainmon_ingest_connections",
    COUNTER,
    "Trainer connections accepted on the Unix socket.",
    (),
    unit="1",
    collector="ingest",
    doc="Trainer connections accepted.",
)

INGEST_OPEN_CONNECTIONS = Family(
    "trainmon_ingest_open_connections",
    GAUGE,
    "Trainer connections open now.",
    (),
    unit="1",
    collector="ingest",
    doc="Trainer connections open now.",
)

INGEST_CONNECTIONS_REFUSED = Family(
    "trainmon_ingest_connections_refused",
    COUNTER,
    (
        "Trainer connections refused or closed by the exporter, by reason: max_connections "
        "(ingest_max_connections open and the tenant at its fair share: accepted and closed at "
        "once), uid_quota (the connecting tenant holds ingest_max_connections_per_uid: "
        "accepted and closed at once), fd_limit (accept() failed for lack of file descriptors "
        "or memory, per attempt; accepting pauses), hello_timeout (no HELLO within "
        "ingest_hello_timeout_seconds), idle_timeout (silent for "
        "ingest_idle_timeout_seconds), fair_share (closed to give its slot, or its rank's, to a "
        "tenant below its fair share)."
    ),
    ("reason",),
    unit="1",
    collector="ingest",
    doc=(
        "Trainer connections refused or closed by the exporter: `max_connections` (the cap was "
        "reached and the connecting tenant holds its fair share of it: accepted and closed at "
        "once, the client sees EOF and retries with back-off), `uid_quota` (the connecting "
        "tenant, its pod's namespace or else its uid from `SO_PEERCRED`, already holds "
        "`ingest_max_connections_per_uid` connections: accepted and closed at once; other "
        "tenants still get in), `fair_share` (closed, its client told `evicted`, to give its "
        "slot to a tenant below its fair share of the cap, or because its rank was taken for "
        "one: the largest holder's connections without a HELLO go first, then those that never "
        "stepped), `fd_limit` (one failed `accept()` for lack of descriptors or memory — "
        "EMFILE, ENFILE, ENOBUFS, ENOMEM; accepting pauses 50 ms, doubling to 1 s), "
        "`hello_timeout` (no HELLO within `ingest_hello_timeout_seconds`), `idle_timeout` "
        "(silent for `ingest_idle_timeout_seconds`, off by default)."
    ),
)

INGEST_MAX_CONNECTIONS = Family(
    "trainmon_ingest_max_connections",
    GAUGE,
    (
        "Trainer connections the exporter accepts at once: ingest_max_connections, lowered to fit "
        "the open-file limit (RLIMIT_NOFILE) if needed."
    ),
    (),
    unit="1",
    collector="ingest",
    doc=(
        "Trainer connections accepted at once: `ingest_max_connections`, lowered at start to fit "
        "the open-file limit (a warning says so)."
    ),
)


INGEST_PEER_IDENTITIES = Family(
    "trainmon_ingest_peer_identities",
    COUNTER,
    (
        "Trainer connections by how the kernel identified their process (with "
        "kubelet_pod_logs_dir): pod (its pod is on the node: namespace verified), host (not in a "
        "pod), unknown_pod (a pod the node's directory does not name), unverifiable (no PID "
        "here, /proc unreadable, or the process gone); all but pod are keyed by uid."
    ),
    ("identity",),
    unit="1",
    collector="ingest",
    doc=(
        "Trainer connections by how the kernel identified their process, counted at accept "
        "when `kubelet_pod_logs_dir` is set (exported from 0 then, absent otherwise): `pod` (its "
        "cgroup names a pod the kubelet's pod directory lists: the namespace is verified, and "
        "is the connection's tenant), `host` (not in a pod's cgroup), `unknown_pod` (a pod's "
        "cgroup whose pod the directory does not name; logged), `unverifiable` (no PID in the "
        "exporter's PID namespace, `/proc` unreadable, or the process exited first). All but "
        "`pod` are keyed by uid, and may name any namespace in their HELLO, as without the "
        "look-up (see [attribution per team](scaling.md#attribution-per-team))."
    ),
)


# ---------- http: connections and requests the HTTP server refused or closed

HTTP_CONNECTIONS_CLOSED = Family(
    "trainmon_http_connections_closed",
    COUNTER,
    (
        "HTTP connections the exporter closed, by reason: header_timeout (no complete request "
        "head within http_header_timeout_seconds), evicted (oldest connection without a request "
        "in progress, closed to stay under http_limit_concurrency), write_timeout (response "
        "unread for http_write_timeout_seconds), unread (the answer that waited longest for its "
        "client to read it, closed when a newer request needed the room: a new connection at "
        "http_limit_concurrency, or a /metrics body beyond http_max_concurrent_scrapes)."
    ),
    ("reason",),
    unit="1",
    collector="http",
    doc=(
        "HTTP connections the exporter closed: `header_timeout` (no complete request head within "
        "`http_header_timeout_seconds`), `evicted` (the oldest connection without a request in "
        "progress, closed when a new one reaches `http_limit_concurrency`), `write_timeout` (a "
        "response left unread for `http_write_timeout_seconds`; its buffered body is freed), "
        "`unread` (the answer that has waited longest for its client to read it, closed when a "
        "newer request needs the room: a new connection at `http_limit_concurrency` while every "
        "other one has a request in progress, or a new `/metrics` body beyond "
        "`http_max_concurrent_scrapes` held at once)."
    ),
)

HTTP_REQUESTS_REFUSED = Family(
    "trainmon_http_requests_refused",
    COUNTER,
    (
        "HTTP requests answered 503 at once, by reason: api_limit (more than "
        "http_max_concurrent_api JSON API and status page requests in progress). /metrics is "
        "never refused."
    ),
    ("reason",),
    unit="1",
    collector="http",
    doc=(
        "Requests answered 503 at once, with `Retry-After: 1`: `api_limit` (more than "
        "`http_max_concurrent_api` `/api/v1/*` and status page requests in progress; a request "
        "holds its slot until the client has read its body). `/metrics` is never refused: "
        "scrapes share collections ([scrapes](exporter.md#scrapes))."
    ),
)

HTTP_AUTH_FAILURES = Family(
    "trainmon_http_auth_failures",
    COUNTER,
    (
        "HTTP requests refused by basic auth (web config file), by reason: missing (no Basic "
        "credentials), malformed (credentials that do not decode), rejected (unknown user or "
        "wrong password), check_limit (503: the client's address already had a password "
        "check in progress or waiting)."
    ),
    ("reason",),
    unit="1",
    collector="http",
    doc=(
        "Requests refused by the basic auth of the web configuration file (`--web.config.file`, "
        "`basic_auth_users`): `missing` (no Basic credentials; 401), `malformed` (credentials "
        "that do not decode; 401), `rejected` (an unknown user or a wrong password; 401), "
        "`check_limit` (503 at once: the client's address already had a bcrypt check in "
        "progress or waiting its turn; checks past `http_max_concurrent_auth_checks` wait, one "
        "per address). Always 0 without `basic_auth_users`."
    ),
)

HTTP_TLS_RELOADS = Family(
    "trainmon_http_tls_reloads",
    COUNTER,
    (
        "Loads of the TLS certificate, key and client CA after their files changed (web "
        "config file), by result: success (new connections get the new certificate), failure "
        "(the new files do not load; the certificate loaded before is still served)."
    ),
    ("result",),
    unit="1",
    collector="http",
    doc=(
        "Loads of `tls_server_config`'s `cert_file`, `key_file` and `client_ca_file` after "
        "one of them changed (checked at each TLS handshake, as a certificate renewal writes "
        "them): `success` (new connections get the new certificate; open ones keep theirs), "
        "`failure` (a file is missing, unreadable, not PEM or not a pair: the certificate "
        "loaded before is still served, an error is logged, and the files are tried again "
        "when they next change). Always 0 without `tls_server_config`."
    ),
)


# ---------- log: lines the log limiter suppressed

EXPORTER_LOG_MESSAGES_SUPPRESSED = Family(
    "trainmon_exporter_log_messages_suppressed",
    COUNTER,
    (
        "Log lines the exporter did not write because the same line of code logged more than "
        "log_max_repeats times per log_repeat_interval_seconds, by level."
    ),
    ("level",),
    unit="lines",
    collector="log",
    doc=(
        "Log lines not written because the same line of code logged more than `log_max_repeats` "
        "times in `log_repeat_interval_seconds` (`debug` … `critical`). The next line from that "
        "place says how many it stands for."
    ),
)


# ---------- scrape: per-collector timing and success (collectors.ScrapeCollector)

SCRAPE_COLLECTOR_DURATION_SECONDS = Family(
    "trainmon_scrape_collector_duration_seconds",
    GAUGE,
    "Time one collector took in this scrape (s, time.perf_counter).",
    ("collector",),
    unit="s",
    collector="scrape",
    doc="Time each collector took in this scrape.",
)

SCRAPE_COLLECTOR_SUCCESS = Family(
    "trainmon_scrape_collector_success",
    GAUGE,
    "1 if the collector succeeded in this scrape, 0 if it failed (see the log).",
    ("collector",),
    unit="0/1",
    collector="scrape",
    doc=(
        "0 when the collector failed: a known condition is one log line and shows on `/readyz` "
        "under `collector_errors`; anything else logs a traceback. The other collectors still "
        "report. No NVML is not a collector failure (see `trainmon_gpu_nvml_available`)."
    ),
)

# ---------- exposition: the sample budget of /metrics (shed.SampleBudget)

EXPORTER_SAMPLE_LIMIT = Family(
    "trainmon_exporter_sample_limit",
    GAUGE,
    "Most samples one scrape of /metrics carries (scrape_sample_limit, the scrape's sample_limit).",
    (),
    unit="samples",
    collector="exposition",
    doc=(
        "`scrape_sample_limit`: the most samples one exposition carries, the value the shipped "
        "PodMonitors and Prometheus configuration scrape with (`sampleLimit`, `sample_limit`)."
    ),
)

EXPORTER_SAMPLES = Family(
    "trainmon_exporter_samples",
    GAUGE,
    "Samples in this scrape's exposition, these included (every histogram bucket, _sum and "
    "_count counted).",
    (),
    unit="samples",
    collector="exposition",
    doc=(
        "Samples this exposition carries after shedding, its own included; at most "
        "`trainmon_exporter_sample_limit`."
    ),
)

EXPORTER_SERIES_SHED = Family(
    "trainmon_exporter_series_shed",
    GAUGE,
    "Series left out of this scrape to stay under scrape_sample_limit, by shed class (layer, "
    "custom, evaluation, operation first; rank and node only when those do not suffice).",
    ("class",),
    unit="series",
    collector="exposition",
    doc=(
        "Series left out of this exposition so that it stays under `scrape_sample_limit` "
        "(Prometheus would otherwise fail the whole scrape), by class, the first shed first: "
        "`layer` (per-layer series), `custom` (custom metrics), `evaluation` (named `Run.eval` "
        "values), `operation` (tracked operations); then `rank` (whole ranks) and `node` "
        "(the node's own families), reached only when a node's ranks and GPUs alone pass the "
        "limit. Run health, the crash and non-finite counters and GPU telemetry are shed only "
        "in `rank` or `node`. Every class is exported at 0 from the first scrape "
        "(`TrainmonExporterSheddingSeries`)."
    ),
)


# ---------- collector process: prometheus-client's process collector (its names and HELP)

PROCESS_VIRTUAL_MEMORY_BYTES = Family(
    "process_virtual_memory_bytes",
    GAUGE,
    "Virtual memory size in bytes.",
    (),
    unit="bytes",
    collector="process",
    doc=(
        "The exporter's virtual memory size (prometheus-client's process collector, from "
        "`/proc/self`)."
    ),
)

PROCESS_RESIDENT_MEMORY_BYTES = Family(
    "process_resident_memory_bytes",
    GAUGE,
    "Resident memory size in bytes.",
    (),
    unit="bytes",
    collector="process",
    doc="The exporter's resident memory (`/proc/self`).",
)

PROCESS_START_TIME_SECONDS = Family(
    "process_start_time_seconds",
    GAUGE,
    "Start time of the process since unix epoch in seconds.",
    (),
    unit="Unix s",
    collector="process",
    doc="When the exporter process started (`/proc/self`).",
)

PROCESS_CPU_SECONDS = Family(
    "process_cpu_seconds",
    COUNTER,
    "Total user and system CPU time spent in seconds.",
    (),
    unit="s",
    collector="process",
    doc="CPU time the exporter used, user and system (`/proc/self`).",
)

PROCESS_OPEN_FDS = Family(
    "process_open_fds",
    GAUGE,
    "Number of open file descriptors.",
    (),
    unit="fds",
    collector="process",
    doc="File descriptors the exporter has open (`/proc/self`).",
)

PROCESS_MAX_FDS = Family(
    "process_max_fds",
    GAUGE,
    "Maximum number of open file descriptors.",
    (),
    unit="fds",
    collector="process",
    doc="Its open-file limit (`RLIMIT_NOFILE`, `/proc/self`).",
)


# ---------- the reference's tables (docs/metrics.md), in its row order
TRAINING_TABLE: tuple[Family, ...] = (
    RUN_UP,
    RUN_INFO,
    RUN_WORLD_SIZE,
    RANK_INFO,
    RUN_START_TIMESTAMP_SECONDS,
    RUN_CRASHES,
    RUN_CRASHES_LAST_TIMESTAMP_SECONDS,
    RUN_RESTARTS,
    TRAIN_STEP_ROLLBACKS,
    TRAIN_STEP_ROLLBACKS_REPEAT_TIMESTAMP_SECONDS,
    TRAIN_STEP,
    TRAIN_STEPS,
    TRAIN_LAST_STEP_TIMESTAMP_SECONDS,
    TRAIN_LOSS,
    TRAIN_LEARNING_RATE,
    TRAIN_GRAD_NORM,
    TRAIN_MEMORY_ALLOCATED_BYTES,
    TRAIN_MEMORY_RESERVED_BYTES,
    TRAIN_MEMORY_PEAK_BYTES,
    TRAIN_ALLOCATOR_RETRIES,
    TRAIN_ALLOCATOR_RETRIES_LAST_TIMESTAMP_SECONDS,
    TRAIN_OOM_ERRORS,
    TRAIN_OOM_ERRORS_LAST_TIMESTAMP_SECONDS,
    TRAIN_BATCH_SIZE,
    TRAIN_SEQUENCE_LENGTH,
    TRAIN_TOKENS,
    TRAIN_SAMPLES,
    TRAIN_TOKENS_PER_SECOND,
    TRAIN_SAMPLES_PER_SECOND,
    TRAIN_STEP_DURATION_SECONDS,
    TRAIN_NONFINITE_VALUES,
    TRAIN_NONFINITE_VALUES_LAST_TIMESTAMP_SECONDS,
    TRAIN_CUSTOM_VALUE,
    CLIENT_OVERHEAD_SECONDS,
    CLIENT_OVERHEAD_RATIO,
    CLIENT_DROPPED_MESSAGES,
    CLIENT_DROPPED_MESSAGES_LAST_TIMESTAMP_SECONDS,
    CLIENT_SENT_MESSAGES,
    INGEST_MESSAGES_UNAPPLIED,
    CLIENT_REFUSED_VALUES,
)
GPU_TABLE: tuple[Family, ...] = (
    GPU_INFO,
    GPU_UTILIZATION_RATIO,
    GPU_MEMORY_UTILIZATION_RATIO,
    GPU_MEMORY_USED_BYTES,
    GPU_MEMORY_FREE_BYTES,
    GPU_MEMORY_SIZE_BYTES,
    GPU_POWER_USAGE_WATTS,
    GPU_POWER_LIMIT_WATTS,
    GPU_ENERGY_CONSUMPTION_JOULES,
    GPU_TEMPERATURE_CELSIUS,
    GPU_MEMORY_TEMPERATURE_CELSIUS,
    GPU_SM_CLOCK_HERTZ,
    GPU_MEMORY_CLOCK_HERTZ,
    GPU_SM_CLOCK_MAX_HERTZ,
    GPU_MEMORY_CLOCK_MAX_HERTZ,
    GPU_CLOCK_EVENT_REASON_ACTIVE,
    GPU_ECC_ERRORS,
    GPU_REMAPPED_ROWS,
    GPU_REMAPPED_ROWS_PENDING,
    GPU_REMAPPED_ROWS_FAILED,
    GPU_XID_ERRORS,
    GPU_XID_ERRORS_LAST_TIMESTAMP_SECONDS,
    GPU_PCIE_TRANSMIT_BYTES,
    GPU_PCIE_RECEIVE_BYTES,
    GPU_NVLINK_TRANSMIT_BYTES,
    GPU_NVLINK_RECEIVE_BYTES,
    GPU_PROCESSES,
    GPU_SM_ACTIVE_RATIO,
    GPU_SM_OCCUPANCY_RATIO,
    GPU_TENSOR_ACTIVE_RATIO,
    GPU_DRAM_ACTIVE_RATIO,
    GPU_NVML_AVAILABLE,
    GPU_EXPECTED,
    GPU_DEVICES,
    GPU_LOST,
    GPU_LOST_LAST_TIMESTAMP_SECONDS,
    GPU_READ_ERRORS,
    GPU_SAMPLE_DURATION_SECONDS,
    GPU_SAMPLE_TIMESTAMP_SECONDS,
    GPU_SLOW_SAMPLE_TIMESTAMP_SECONDS,
)
RANK_GPU_TABLE: tuple[Family, ...] = (
    TRAIN_MODEL_FLOPS_PER_SECOND,
    TRAIN_PEAK_FLOPS_PER_SECOND,
    TRAIN_MFU_RATIO,
    TRAIN_MFU_UNAVAILABLE,
    RANK_GPU_MEMORY_USED_BYTES,
)
HEALTH_TABLE: tuple[Family, ...] = (
    TRAIN_LOSS_EMA,
    TRAIN_LOSS_MEAN,
    TRAIN_LOSS_STDDEV,
    TRAIN_GRAD_NORM_MEAN,
    TRAIN_GRAD_NORM_STDDEV,
    TRAIN_LOSS_ZSCORE,
    TRAIN_GRAD_NORM_ZSCORE,
    TRAIN_LOSS_TO_AVERAGE_RATIO,
    TRAIN_LOSS_SPIKES,
    TRAIN_LOSS_SPIKES_LAST_TIMESTAMP_SECONDS,
    TRAIN_GRAD_NORM_SPIKES,
    TRAIN_GRAD_EXPLOSIONS,
    TRAIN_GRAD_EXPLOSIONS_LAST_TIMESTAMP_SECONDS,
    TRAIN_GRAD_VANISHING,
    TRAIN_STEP_TIME_MEDIAN_SECONDS,
    TRAIN_HUNG,
    TRAIN_HANGS,
    HANG_FRAME_INFO,
    HANG_COLLECTIVE_SEQUENCE,
    TRAIN_STEP_OVERDUE_RATIO,
    TRAIN_MEMORY_GROWTH_BYTES_PER_STEP,
    TRAIN_MEMORY_LEAKS,
    TRAIN_MEMORY_LEAKS_LAST_TIMESTAMP_SECONDS,
    TRAIN_THROUGHPUT_RATIO,
    TRAIN_THROUGHPUT_DROPPED,
    TRAIN_THROUGHPUT_DROPS,
    TRAIN_STRAGGLER_RATIO,
    TRAIN_STRAGGLING,
    TRAIN_STRAGGLER_EPISODES,
    TRAIN_LOSS_EMA_SLOPE,
    TRAIN_LOSS_PLATEAU,
    EVAL_LOSS,
    EVAL_STEP,
    EVAL_EVALUATIONS,
    EVAL_IMPROVEMENT_RATIO,
    EVAL_SLOW_IMPROVEMENT,
    EVAL_GENERALIZATION_GAP_RATIO,
    EVAL_OVERFITTING,
    EVAL_PLATEAU,
    EVAL_VALUE,
    MONITORING_SECONDS,
    MONITORING_OPERATIONS,
    MONITORING_ACTIVE,
    MONITORING_OVERHEAD_RATIO,
    MONITORING_OVER_BUDGET,
    CHECKPOINT_LAST_TIMESTAMP_SECONDS,
    CHECKPOINT_LAST_DURATION_SECONDS,
    CHECKPOINT_LAST_STEP,
    CHECKPOINTS,
    TRAIN_PRODUCTIVE_SECONDS,
    TRAIN_BADPUT_SECONDS,
    TRAIN_UNCHECKPOINTED_SECONDS,
    TRAIN_AT_RISK_SECONDS,
    TRAIN_ACCOUNTING_START_TIMESTAMP_SECONDS,
    TRAIN_DATA_LOADING_MEASURED,
    TRAIN_INPUT_BOUND,
)
LAYER_TABLE: tuple[Family, ...] = (
    LAYER_GRAD_NORM,
    LAYER_GRAD_MEAN,
    LAYER_GRAD_STDDEV,
    LAYER_WEIGHT_NORM,
    LAYER_UPDATE_RATIO,
    LAYER_ACTIVATION_MEAN,
    LAYER_ACTIVATION_STDDEV,
    LAYER_DEAD_UNITS_RATIO,
    LAYER_GRAD_PERCENTILE,
    TRAIN_GRAD_GAIN_MEAN,
    TRAIN_GRAD_GAIN_DRIFT_RATIO,
    TRAIN_GRAD_GAIN_DRIFTS,
    TRAIN_GRAD_GAIN_DRIFTS_LAST_TIMESTAMP_SECONDS,
    TRAIN_UPDATE_RATIO_HIGH,
    TRAIN_UPDATE_RATIO_HIGH_LAST_TIMESTAMP_SECONDS,
    TRAIN_UPDATE_RATIO_LOW,
    TRAIN_UPDATE_RATIO_LOW_LAST_TIMESTAMP_SECONDS,
)
EXPORTER_TABLE: tuple[Family, ...] = (
    BUILD_INFO,
    EXPORTER_RANKS,
    EXPORTER_RANKS_EXPIRED,
    EXPORTER_RANKS_EVICTED,
    EXPORTER_SERIES,
    EXPORTER_TENANT_RANKS,
    EXPORTER_TENANT_SERIES,
    INGEST_HELLOS_REFUSED,
    INGEST_HELLOS_REFUSED_LAST_TIMESTAMP_SECONDS,
    OWNER_CLAIMS_INVALID,
    EXPORTER_DEPARTED_RANKS,
    EXPORTER_DEPARTED_EVICTED,
    EXPORTER_STATE_SAVES,
    EXPORTER_STATE_LAST_SAVE_TIMESTAMP_SECONDS,
    EXPORTER_STATE_REFUSED,
    EXPORTER_STATE_RESTORED,
    HANG_CAPTURE_REQUESTS,
    HANG_CAPTURES,
    HANG_EVIDENCE_DROPPED,
    HANG_EVIDENCE_BYTES,
    INGEST_CONNECTIONS,
    INGEST_OPEN_CONNECTIONS,
    INGEST_MAX_CONNECTIONS,
    INGEST_CONNECTIONS_REFUSED,
    INGEST_PEER_IDENTITIES,
    INGEST_PACKETS,
    INGEST_BYTES,
    INGEST_MESSAGES,
    INGEST_MESSAGES_INVALID,
    INGEST_MESSAGES_INVALID_LAST_TIMESTAMP_SECONDS,
    INGEST_VALUES_DROPPED,
    HTTP_CONNECTIONS_CLOSED,
    HTTP_REQUESTS_REFUSED,
    HTTP_AUTH_FAILURES,
    HTTP_TLS_RELOADS,
    EXPORTER_LOG_MESSAGES_SUPPRESSED,
    SCRAPE_COLLECTOR_DURATION_SECONDS,
    SCRAPE_COLLECTOR_SUCCESS,
    EXPORTER_SAMPLE_LIMIT,
    EXPORTER_SAMPLES,
    EXPORTER_SERIES_SHED,
    PROCESS_CPU_SECONDS,
    PROCESS_RESIDENT_MEMORY_BYTES,
    PROCESS_VIRTUAL_MEMORY_BYTES,
    PROCESS_OPEN_FDS,
    PROCESS_MAX_FDS,
    PROCESS_START_TIME_SECONDS,
)

SECTIONS: dict[str, tuple[Family, ...]] = {
    "training": TRAINING_TABLE,
    "gpu": GPU_TABLE,
    "rank_gpu": RANK_GPU_TABLE,
    "health": HEALTH_TABLE,
    "layers": LAYER_TABLE,
    "exporter": EXPORTER_TABLE,
}
"""The tables of docs/metrics.md, in order, each in the reference's row order."""

ALL: tuple[Family, ...] = tuple(f for section in SECTIONS.values() for f in section)
"""Every family the exporter can expose, each once."""

BY_NAME: dict[str, Family] = {f.name: f for f in ALL}
"""Rows by :attr:`Family.name`."""


def markdown_table(families: tuple[Family, ...]) -> str:
    """The reference's table of ``families``: one row each, in the given order."""
    lines = [
        "| metric | type | unit | labels | meaning and source |",
        "|---|---|---|---|---|",
    ]
    for f in families:
        labels = f.labels + (("le",) if f.type == HISTOGRAM else ())
        lines.append(
            f"| `{f.exposed}` | {f.type} | {f.unit} | {', '.join(labels) or '–'} | {f.doc} |"
        )
    return "\n".join(lines) + "\n"
