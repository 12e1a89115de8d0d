"""Exporter configuration: one :class:`Settings` object, built once in ``main()``.

Why this module is one module of about 600 lines: every setting is a flag and an environment
variable with its description (what ``--help`` and docs/exporter.md show), its default and its
validation, so most of the module is the settings' own documentation; the analytics thresholds
live here too so that there is one place where configuration is.

Every field is settable as a CLI flag (``--series-ttl-seconds 300``) or an environment variable
with the ``TRAINMON_`` prefix (``TRAINMON_SERIES_TTL_SECONDS=300``; nested fields use ``__``:
``TRAINMON_COLLECTORS__TRAINING=false``). Flags win over the environment.
"""

from __future__ import annotations

import difflib
import grp
import json
import math
import pwd
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from trainmon_client import _names as N
from trainmon_client import _protocol as P
from trainmon_exporter._defaults import DEFAULT_PORT, default_socket

DEFAULT_STEP_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)


WEEK_S = 7 * 86400
"""Upper bound of the longest durations (series TTL, idle timeout), seconds."""
MAX_WINDOW_STEPS = 10_000
"""Upper bound of every window counted in steps: each rank keeps that many values per window
(a deque of Python floats, about 32 bytes each), so 1024 ranks at the bound hold about 330 MB
per window."""

SEVERITIES = ("minor", "major", "severe")
"""Loss and grad-norm spike severities, in increasing order (``AnalyticsSettings.spike_z``)."""


class AnalyticsSettings(BaseModel):
    """Thresholds and windows of the detectors (``TRAINMON_ANALYTICS__<NAME>``).

    Every number is finite and bounded on both sides (``inf``, ``nan`` and a window of 10^12
    steps are refused), as in :class:`Settings`.
    """

    model_config = ConfigDict(allow_inf_nan=False)

    ema_decay: float = Field(0.99, gt=0, lt=1, description="EMA decay d in ema = d*ema + (1-d)*x")
    window_steps: int = Field(
        100, ge=5, le=MAX_WINDOW_STEPS, description="steps in the rolling mean/std windows"
    )
    min_history_steps: int = Field(
        20, ge=2, le=MAX_WINDOW_STEPS, description="values needed before judging"
    )
    spike_z: dict[str, float] = Field(
        default_factory=lambda: {"minor": 4.0, "major": 6.0, "severe": 10.0},
        description="z-score at which a spike reaches each severity",
    )
    rel_std_floor: float = Field(
        1e-3, ge=0, le=10, description="std floor as a share of |mean| (constant series)"
    )
    spike_persist_steps: int = Field(
        10,
        ge=1,
        le=MAX_WINDOW_STEPS,
        description="consecutive spikes after which the values are a new level",
    )
    grad_explosion_norm: float = Field(
        100.0, gt=0, le=1e12, description="grad norm above: explosion"
    )
    grad_explosion_ratio: float = Field(
        10.0,
        gt=1,
        le=1e6,
        description="grad norm above this multiple of its rolling mean: explosion",
    )
    grad_vanishing_norm: float = Field(1e-8, ge=0, le=1e3, description="grad norm below: vanishing")
    hang_factor: float = Field(
        2.0, gt=0, le=1000, description="hung after this many median step times"
    )
    hang_grace_seconds: float = Field(30.0, ge=0, le=86400, description="plus this grace (s)")
    step_time_window_steps: int = Field(
        50, ge=3, le=MAX_WINDOW_STEPS, description="steps in the step-time median"
    )
    throughput_recent_steps: int = Field(
        20, ge=3, le=MAX_WINDOW_STEPS, description="steps in the recent rate"
    )
    throughput_baseline_steps: int = Field(
        500, ge=10, le=MAX_WINDOW_STEPS, description="steps in the baseline rate"
    )
    trend_window_steps: int = Field(
        200, ge=10, le=MAX_WINDOW_STEPS, description="steps in the EMA slope fit"
    )
    plateau_tolerance: float = Field(0.01, ge=0, le=1, description="relative EMA change = plateau")
    eval_slow_improvement: float = Field(
        0.01, ge=-1, le=1, description="improvement per eval below: slow"
    )
    eval_overfit_gap: float = Field(
        0.30, ge=0, le=100, description="val/train gap ratio above: overfitting"
    )
    eval_plateau_change: float = Field(0.01, ge=0, le=1, description="relative change below: flat")
    eval_plateau_evals: int = Field(
        3, ge=2, le=1000, description="evaluations that must all be flat"
    )
    monitoring_budget_ratio: float = Field(
        0.05, gt=0, le=1, description="monitoring share of wall time above: over budget"
    )
    throughput_drop_ratio: float = Field(
        0.7, gt=0, lt=1, description="throughput ratio below: a drop (an episode is counted)"
    )
    straggler_ratio: float = Field(
        1.5, gt=1, le=1000, description="straggler ratio above: a straggler (an episode is counted)"
    )
    input_bound_ratio: float = Field(
        0.6, gt=0, lt=1, description="data-loading share of step time above: input-bound"
    )
    update_ratio_high: float = Field(
        0.1, gt=0, le=1e6, description="a layer's update ratio ||dw||/||w|| above this is too high"
    )
    update_ratio_low: float = Field(
        1e-7, ge=0, le=1, description="a layer's update ratio below this is too low (frozen)"
    )
    gain_drift_factor: float = Field(
        2.0, gt=1, le=1e6, description="mean gradient gain off its baseline by this factor: drift"
    )
    leak_window_steps: int = Field(
        200, ge=10, le=MAX_WINDOW_STEPS, description="steps of mem_allocated in the leak fit"
    )
    leak_min_growth_ratio: float = Field(
        0.05, gt=0, le=100, description="growth across the window, as a share of the mean, to flag"
    )
    leak_min_r2: float = Field(
        0.9, ge=0, le=1, description="how steady (R^2 of the linear fit) the growth must be"
    )
    gain_baseline_checks: int = Field(
        10, ge=1, le=10_000, description="watch checks whose median mean gain is the baseline"
    )
    gain_window_checks: int = Field(
        5,
        ge=1,
        le=10_000,
        description="watch checks whose median mean gain is compared to the baseline",
    )
    gain_drift_checks: int = Field(
        3,
        ge=1,
        le=10_000,
        description="consecutive drifted checks that start (or in range, end) an episode",
    )
    rollback_repeats: int = Field(
        3,
        ge=1,
        le=1000,
        description=(
            "rollbacks that count as repeated: the time of the rank's this-many-th latest "
            "rollback is exported, and an alert compares it with its window"
        ),
    )

    @field_validator("spike_z")
    @classmethod
    def _check_spike_z(cls, value: dict[str, float]) -> dict[str, float]:
        if set(value) != set(SEVERITIES):
            raise ValueError(f"needs exactly the keys {SEVERITIES}")
        z = [value[s] for s in SEVERITIES]
        if z != sorted(z) or z[0] <= 0 or z[-1] > 1e6:
            raise ValueError("thresholds must be positive, at most 1e6, and increase with severity")
        return value

    @model_validator(mode="after")
    def _check(self) -> AnalyticsSettings:
        if self.throughput_recent_steps >= self.throughput_baseline_steps:
            raise ValueError("throughput_recent_steps must be below throughput_baseline_steps")
        return self


class CollectorToggles(BaseModel):
    """Which collectors run at scrape time (node_exporter's ``--collector.<name>``)."""

    training: bool = Field(True, description="per-(run, rank) training series")
    health: bool = Field(True, description="spikes, hangs, throughput, evaluation, cost")
    layers: bool = Field(True, description="per-layer series from Run.watch")
    exporter: bool = Field(True, description="the exporter's own build info and state sizes")
    process: bool = Field(True, description="process_* CPU, memory and file-descriptor series")
    gpu: bool = Field(True, description="per-GPU series from NVML (needs the NVIDIA driver)")
    rank_gpu: bool = Field(
        True, description="per-rank MFU, model FLOP/s and process GPU memory (joins on uuid)"
    )


class Settings(BaseSettings):
    """The per-node sidecar exporter for training runs.

    Every flag has an environment twin: --series-ttl-seconds is TRAINMON_SERIES_TTL_SECONDS,
    --collectors.training is TRAINMON_COLLECTORS__TRAINING; flags win. Settings are explained
    in docs/exporter.md.
    """

    model_config = SettingsConfigDict(
        env_prefix="TRAINMON_",
        env_nested_delimiter="__",
        cli_prog_name="trainmon-exporter",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        # --web.config.file as in node_exporter and Prometheus, besides --web-config-file
        cli_shortcuts={"web-config-file": "web.config.file"},
        extra="ignore",
        allow_inf_nan=False,  # every float: inf and nan are refused
    )

    listen: str = Field(
        f"127.0.0.1:{DEFAULT_PORT}",
        description="HTTP address HOST:PORT for /metrics, the API and the status page "
        "(env TRAINMON_LISTEN). Use 0.0.0.0 to let a remote Prometheus scrape it; whoever "
        "can reach the port then reads every run's metrics (no authentication).",
    )
    socket: Path = Field(
        default_factory=lambda: Path(default_socket()),
        description="Unix socket the training clients connect to (env TRAINMON_SOCKET); its "
        "directory must be shared with the trainers. Default: /run/trainmon/trainmon.sock for "
        "root or where this user may create it, else $XDG_RUNTIME_DIR/trainmon/trainmon.sock "
        "(a trainer's default finds either).",
    )
    socket_mode: str = Field(
        "0660",
        description="Octal permissions of the socket file. Connecting needs write permission, "
        "so 0660 admits the owner and the socket's group (--socket-group); 0666 admits every "
        "local user. The owner must keep read and write.",
    )
    socket_group: str | None = Field(
        None,
        description="Group (name or number) of the socket file: the trainers' group on a "
        "shared node. Default: the exporter's group, or the directory's if it is set-group-ID.",
    )
    allowed_uids: Annotated[tuple[int, ...], NoDecode] = Field(
        (),
        description="If set (with allowed_gids), only processes of these users (names or "
        "numbers) may send data; others are refused (peer_not_allowed). Empty: anyone who can "
        "open the socket.",
    )
    allowed_gids: Annotated[tuple[int, ...], NoDecode] = Field(
        (),
        description="If set (with allowed_uids), processes whose primary or supplementary "
        "group (names or numbers) is listed may send data.",
    )
    owner_claims_dir: Path | None = Field(
        Path("/run/trainmon-owners"),
        description="Directory of owner claims: a file per run id holding the uid that alone "
        "may write to that run (the Slurm prolog writes slurm-<job id> before the job starts). "
        "Read at each HELLO; ignored (trainmon_owner_claims_invalid_total) unless the directory "
        "and the file belong to root or the exporter's user and are writable by no one else. "
        "Absent: no claims; empty: off.",
    )
    default_namespace: str | None = Field(
        None,
        description="Namespace of the ranks whose client reports none (a Kubernetes name; "
        "absent or empty: none). In a Kubernetes DaemonSet, the exporter's own (downward "
        "API), which Prometheus gives their series: their runs are then keyed as they are "
        "labelled, so a client claiming that namespace meets them, and their owner, here.",
    )
    kubelet_pod_logs_dir: Path | None = Field(
        None,
        description="Kubernetes node exporter: the kubelet's pod log directory (/var/log/pods, "
        "mounted read-only), whose entries name each pod of the node as NAMESPACE_NAME_UID. "
        "With it, each trainer's pod is found from its process's cgroup (needs the host's PID "
        "namespace): its namespace is then verified, a HELLO naming another is refused "
        "(namespace_mismatch), and quotas, fair shares and run ownership are that namespace's "
        "rather than the uid's. Read only if root's or the exporter's and writable by no one "
        "else. Absent or empty: off (every tenant is a uid).",
    )
    ingest_poll_interval_seconds: float = Field(
        0.1,
        ge=0,
        le=5,
        description="How often trainer sockets are drained (s). Polling means a trainer's send "
        "never wakes the exporter, which keeps the client's flush cheap; 0 reads each packet "
        "as it arrives instead.",
    )
    ingest_max_connections: int = Field(
        1024,
        ge=1,
        le=65536,
        description="Most trainer connections open at once; more are accepted and closed at "
        'once (trainmon_ingest_connections_refused_total{reason="max_connections"}), unless '
        "the new one's tenant holds less than its fair share: then the largest holder's "
        "connection that never sent a HELLO or a step closes instead (fair_share). Lowered at "
        "start to fit the open-file limit, keeping descriptors for HTTP.",
    )
    ingest_max_connections_per_uid: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="Most trainer connections one tenant (verified namespace, else uid: "
        "SO_PEERCRED at connect) may hold open at once; more from it are accepted and closed "
        'at once (trainmon_ingest_connections_refused_total{reason="uid_quota"}) while other '
        "tenants still get in. Default: a quarter of ingest_max_connections, at least 64 (8 "
        "GPUs x 8 processes) or all of it when it is smaller. At most "
        "ingest_max_connections.",
    )
    ingest_hello_timeout_seconds: float = Field(
        10.0,
        gt=0,
        allow_inf_nan=False,
        le=3600,
        description="A connection that has not sent its HELLO this long after connecting is "
        "closed (reason hello_timeout). The client sends it with the connect.",
    )
    ingest_idle_timeout_seconds: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        le=WEEK_S,
        description="Close a trainer connection silent for this long (s; reason "
        "idle_timeout; the rank shows disconnected, not crashed, and the client reconnects at "
        "its next send). 0, the default, never does: a trainer stuck in a collective is "
        "silent too, and must stay connected for the hang alert.",
    )
    ingest_max_bytes_per_second: float = Field(
        4 * 2**20,
        gt=0,
        allow_inf_nan=False,
        le=2**30,
        description="Most bytes one trainer connection may deliver per second (about 20,000 "
        "steps of 10 fields); more waits in its socket buffer, so one flooding client cannot "
        "starve the others or HTTP.",
    )
    http_limit_concurrency: int = Field(
        64,
        ge=4,
        le=4096,
        description="Most HTTP connections at once (uvicorn limit_concurrency). A new "
        "connection at the limit closes the oldest one with no request in progress (idle or "
        "half-sent; reason evicted), else the one whose answer has waited longest for its "
        "client to read it (reason unread); when every other one has a request in progress "
        "that is not waiting on its client, new requests get 503.",
    )
    http_timeout_keep_alive_seconds: int = Field(
        5,
        ge=1,
        le=3600,
        description="An idle keep-alive HTTP connection closes after this long (s; uvicorn "
        "timeout_keep_alive).",
    )
    http_header_timeout_seconds: float = Field(
        10.0,
        gt=0,
        allow_inf_nan=False,
        le=3600,
        description="An HTTP connection must complete its request head within this long of "
        "connecting or of its previous response (s), else it is closed (reason header_timeout; "
        "uvicorn has no such timeout of its own).",
    )
    http_write_timeout_seconds: float = Field(
        15.0,
        gt=0,
        allow_inf_nan=False,
        le=3600,
        description="A response the client leaves unread this long (s) aborts its connection "
        "and frees the buffered body (reason write_timeout). Above Prometheus' default 10 s "
        "scrape timeout.",
    )
    http_max_concurrent_scrapes: int = Field(
        4,
        ge=1,
        le=64,
        description="Most distinct /metrics bodies kept in memory at once for clients still "
        "reading them. Scrapes are never refused: one collection at a time is shared by every "
        "scrape that arrived while the previous one ran. A newer body beyond this closes the "
        "connection that has gone longest without reading its answer "
        '(trainmon_http_connections_closed_total{reason="unread"}).',
    )
    web_config_file: Path | None = Field(
        None,
        description="Web configuration file (YAML, the Prometheus exporter toolkit's format, "
        "also --web.config.file): tls_server_config serves HTTPS, basic_auth_users requires "
        "a user and password (bcrypt hashes) on every route. Read at start; an invalid file "
        "stops the exporter; the certificate, key and client CA it names are read again when "
        "they change. See docs/exporter.md, TLS and basic auth.",
    )
    http_max_concurrent_auth_checks: int = Field(
        2,
        ge=1,
        le=64,
        description="Most bcrypt password checks in progress at once (each takes about 0.1 s "
        "of a core at cost 10); more wait their turn, one per client address: a second "
        "request with unverified credentials from an address that has a check in progress "
        "or waiting gets 503 at once "
        '(trainmon_http_auth_failures_total{reason="check_limit"}). Credentials already '
        "verified are not checked again.",
    )
    http_max_concurrent_api: int = Field(
        8,
        ge=1,
        le=256,
        description="Most JSON API (/api/v1/*) and status page requests in progress at once "
        "(each builds its body in a worker thread and holds it until written); more get 503 "
        'at once (trainmon_http_requests_refused_total{reason="api_limit"}).',
    )
    series_ttl_seconds: float = Field(
        600.0,
        gt=0,
        le=WEEK_S,
        description="How long a finished or disconnected rank's series stay exported (s).",
    )
    state_file: Path | None = Field(
        None,
        description="The exporter's state file: each rank's time accounting (goodput) and the "
        "accounting of ranks that left, written atomically every state_save_interval_seconds "
        "and at shutdown, read at start, so a restart (crash, upgrade) loses none of it. "
        "Default: beside the socket (<socket>.state; /run is emptied at reboot: point it at "
        "/var/lib/trainmon/state.json to keep it across reboots). off: none. A file that is "
        "corrupt, not the exporter's, of a later version or writable by another user is "
        "refused (trainmon_exporter_state_refused_total), logged and set aside (<file>.refused).",
    )
    state_save_interval_seconds: float = Field(
        5.0,
        ge=0.1,
        le=3600,
        allow_inf_nan=False,
        description="How often the state file is written (s): at most this much accounting "
        "is lost when the exporter is killed (a clean stop writes it at once).",
    )
    goodput_retention_seconds: float = Field(
        86_400.0,
        ge=0,
        le=30 * 86_400,
        allow_inf_nan=False,
        description="How long a rank that left without a clean finish keeps its time "
        "accounting after its series TTL (s), its goodput series still exported (at most "
        "max_ranks such ranks; trainmon_exporter_departed_ranks): a restart that comes back "
        "later, here or on another node, is then accounted whole. 0: not kept.",
    )
    prometheus_url: str | None = Field(
        None,
        description="A Prometheus (or compatible) query URL that evaluates the shipped "
        "recording rules over every node (http(s)://host:port[/path]): the JSON API, the status "
        "page and trainmon status then show each run's job-wide goodput read from it "
        "(run:trainmon_train_goodput:ratio...), refreshed every 10 s. Unset: the figures of "
        "the ranks this exporter holds only.",
    )
    rate_window_seconds: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Window for tokens/s, samples/s and client overhead ratio (s).",
    )
    rank_retention_seconds: float = Field(
        60.0,
        ge=0,
        le=604800,
        allow_inf_nan=False,
        description="A disconnected (crashed, failed or finished) rank stays exported at least "
        "this long (s), whoever connects: no new rank evicts it sooner, so its crash alert can "
        "fire. Two scrape intervals of 15 s and a margin; at most series_ttl_seconds.",
    )
    max_ranks: int = Field(
        256,
        ge=1,
        le=65536,
        description="Most (run, rank) pairs tracked at once. A new one evicts a disconnected "
        "pair past rank_retention_seconds (its own tenant's first); else, for a tenant below "
        "its fair share (max_ranks over the tenants holding ranks), a connected pair of a "
        "tenant above it, one that never stepped first; else it is refused (too_many_ranks). "
        "256 x 124 series per rank fits max_series with room for custom metrics and layers.",
    )
    max_ranks_per_uid: int = Field(
        64,
        ge=1,
        le=65536,
        description="Most (run, rank) pairs one tenant holds, connected or not: its verified "
        "namespace (kubelet_pod_logs_dir), else its uid (SO_PEERCRED). At its quota a "
        "tenant's new rank evicts only its own pairs past rank_retention_seconds, else it is "
        "refused (uid_rank_quota); other tenants are not. A quarter of max_ranks, so at least "
        "four users fit a full node; capped at max_ranks.",
    )
    max_layers: int = Field(
        128,
        ge=0,
        le=10_000,
        description="Most layers per rank exported from Run.watch; more are dropped (reason "
        "layer_cap).",
    )
    max_custom_metrics: int = Field(
        256,
        ge=0,
        le=10_000,
        description="Most distinct custom metric names per rank; more are refused (reason "
        "custom_cap).",
    )
    max_operations: int = Field(
        64,
        ge=1,
        le=10_000,
        description="Most distinct operation names (Run.track, and watch) per rank; more are "
        'refused (trainmon_ingest_values_dropped_total{reason="operation_cap"}).',
    )
    max_series: int = Field(
        50_000,
        ge=1000,
        le=5_000_000,
        description="Series budget of every rank together in the exposition (an estimate per "
        "rank, custom metric, evaluation value, operation and layer). A new name past it is "
        'refused (trainmon_ingest_values_dropped_total{reason="series_budget"}) and a new '
        "rank evicts disconnected ones first. 50,000 series is about 5 MB and well under a "
        "second per scrape (docs/exporter.md).",
    )
    max_series_per_uid: int = Field(
        12_500,
        ge=1000,
        le=5_000_000,
        description="One tenant's (verified namespace, else uid) share of max_series (its "
        "ranks' series together): a new rank past it is refused (uid_series_quota), a new name "
        "dropped (series_budget). A quarter "
        "of max_series, above max_ranks_per_uid x 124 so a uid can reach its rank quota; "
        "capped at max_series.",
    )
    scrape_sample_limit: int = Field(
        10_000,
        ge=1000,
        le=5_000_000,
        description="Most samples one scrape of /metrics carries, every histogram bucket and "
        "the exporter's own series counted: set it to the sample_limit (PodMonitor "
        "sampleLimit) Prometheus scrapes this exporter with, which fails a whole scrape past "
        "it. Past it the exporter leaves out per-layer series first, then custom metrics, "
        "evaluation values and operations, never run health, crash or non-finite counters or "
        "GPU series while the ranks and GPUs fit (trainmon_exporter_series_shed).",
    )
    layer_ranks: str = Field(
        "0",
        description="Ranks whose per-layer series (Run.watch) are exported: all, none, or "
        "ranks and ranges such as 0,8-15 or 0-1023:8 (every 8th rank). Under data "
        "parallelism every rank sees the same layers, so rank 0 stands for all; the layers of "
        "other ranks still feed their update-ratio and gradient-gain checks and are counted in "
        'trainmon_ingest_values_dropped_total{reason="layer_rank"}.',
    )
    step_duration_buckets: tuple[float, ...] = Field(
        DEFAULT_STEP_BUCKETS,
        max_length=64,
        description="Upper bounds (s) of trainmon_train_step_duration_seconds buckets.",
    )
    nvml_interval_seconds: float = Field(
        1.0,
        ge=0.1,
        le=60,
        description="How often the NVML sampler reads every GPU (s), on its own thread. 1 s "
        "keeps GPU series fresher than any scrape interval at well under 1 % of a core for 8 "
        "GPUs (docs/performance.md).",
    )
    nvml_slow_interval_seconds: float = Field(
        15.0,
        ge=0.1,
        le=600,
        description="How often the NVML sampler reads the slow readings (s): the energy "
        "counter (2.3-2.8 ms a call on an H200) and the PCIe byte counters (135 us each); "
        "every other reading, power and SM activity among them, is read every "
        "nvml_interval_seconds. Rounded to a whole number of those passes, at least one. "
        "They are cumulative counters: a longer interval costs resolution of rate() over "
        "short windows, never a joule or a byte (docs/exporter.md#gpu-sampling).",
    )
    nvml_processes: bool = Field(
        True,
        description="Read each GPU's compute processes (per-rank GPU memory), every pass: "
        "6 us a call on an H200; turn off on hosts with many processes.",
    )
    require_gpus: bool = Field(
        False,
        description="Refuse to start when NVML is unusable (no library, no driver) or sees "
        "no GPU, instead of serving training metrics without GPU series; NVML failing later "
        "then counts as a failure, never as a node without GPUs.",
    )
    peak_flops: float | None = Field(
        None,
        gt=0,
        le=1e18,
        description="Peak dense FLOP/s per GPU for MFU, overriding the built-in table for "
        "every GPU of this node (e.g. 989.5e12). Also gives MFU without NVML.",
    )
    hang_capture: bool = Field(
        True,
        description="Ask a rank judged hung for its Python stacks and its collective state "
        "(PyTorch's Flight Recorder), over its own connection, once per hang episode "
        "(docs/hangs.md). Off: hangs are judged and alerted as before, without evidence.",
    )
    hang_capture_timeout_seconds: float = Field(
        10.0,
        ge=1,
        le=600,
        description="Seconds a hung rank has to answer before its evidence says no answer "
        '(trainmon_hang_captures_total{result="no_answer"}): native code holding the GIL, a '
        "stopped process, or a client that predates capture. A late answer is still taken.",
    )
    hang_capture_max_bytes: int = Field(
        32768,
        ge=1024,
        le=P.MAX_CAPTURE_BYTES,
        description="Most bytes of JSON one rank's answer may carry; the client cuts other "
        "threads' stacks first to fit. A larger answer is refused "
        '(trainmon_hang_evidence_dropped_total{reason="too_large"}).',
    )
    hang_evidence_max_bytes: int = Field(
        4 * 2**20,
        ge=64 * 1024,
        le=2**30,
        description="Most bytes of hang evidence (answers' JSON) the exporter keeps for all "
        "ranks together. Evidence of ranks no longer hung goes first, oldest first (reason "
        "evicted); an answer that still does not fit is refused (reason budget).",
    )
    hang_native_stacks: bool = Field(
        False,
        description="Also read a hung rank's native and Python stacks with py-spy (dump "
        "--native) when py-spy is installed and the exporter may ptrace the trainer (same "
        "uid, or CAP_SYS_PTRACE, and the Yama ptrace scope allows it). Off by default: the "
        "client's capture needs no ptrace.",
    )
    status_peers: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="Other exporters (http(s)://HOST:PORT, comma-separated) whose ranks of "
        "the runs hung here the status page merges into their hang view: the other nodes of "
        "a multi-node job. Read only while a run here has hang evidence, each within 2 s; "
        "only runs that have ranks here are taken.",
    )
    status_peer_ca_file: Path | None = Field(
        None, description="PEM CA(s) that signed the status peers' certificates (https)."
    )
    status_peer_user: str | None = Field(
        None, description="Basic auth user for the status peers (their web config's)."
    )
    status_peer_password_file: Path | None = Field(
        None, description="File holding the status peers' basic auth password."
    )
    log_level: str = Field("info", description="critical, error, warning, info or debug.")
    log_max_repeats: int = Field(
        10,
        ge=1,
        le=10_000,
        description="Most lines logged per message (same text before its values are filled "
        "in) per log_repeat_interval_seconds; the rest are counted in "
        "trainmon_exporter_log_messages_suppressed_total and summed up in the next line.",
    )
    log_repeat_interval_seconds: float = Field(
        60.0, gt=0, allow_inf_nan=False, le=86400, description="Interval of log_max_repeats (s)."
    )
    collectors: CollectorToggles = CollectorToggles()
    analytics: AnalyticsSettings = AnalyticsSettings()

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:{DEFAULT_PORT}), got {value!r}")
        return value

    @field_validator("socket_mode")
    @classmethod
    def _check_mode(cls, value: str) -> str:
        try:
            mode = int(value, 8)
        except ValueError:
            raise ValueError(f"expected octal permissions like 0660, got {value!r}") from None
        if not 0 <= mode <= 0o777:
            raise ValueError(f"permissions out of range: {value!r}")
        if mode & 0o600 != 0o600:
            raise ValueError(
                f"{value!r} denies the exporter's own user read or write on its socket; use "
                "0660 (owner and group) or 0600 (owner only)"
            )
        return value

    @field_validator("layer_ranks")
    @classmethod
    def _check_layer_ranks(cls, value: str) -> str:
        RankSet.parse(value)
        return value.strip().lower()

    @field_validator("socket_group")
    @classmethod
    def _check_group(cls, value: str | None) -> str | None:
        if value is None or value.strip() == "":
            return None
        _gid(value)
        return value

    @field_validator("default_namespace")
    @classmethod
    def _default_namespace(cls, value: str | None) -> str | None:
        if value and not N.valid_namespace(value):
            raise ValueError("must be a Kubernetes namespace name (RFC 1123 label) or empty")
        return value or None

    @field_validator("prometheus_url")
    @classmethod
    def _prometheus_url(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        if not re.match(r"https?://[^/\s]+(/\S*)?\Z", value.strip()):
            raise ValueError("must be an http:// or https:// URL")
        return value.strip()

    @field_validator("state_file", mode="before")
    @classmethod
    def _state_file(cls, value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.strip() == ""):
            return None
        if isinstance(value, str) and value.strip().lower() == "off":
            return Path("off")
        if not Path(value).is_absolute():
            raise ValueError("must be an absolute path, or off")
        return value

    @property
    def state_path(self) -> Path | None:
        """Where the state file is (beside the socket by default); None: off."""
        if self.state_file is None:
            return self.socket.with_name(self.socket.name + ".state")
        return None if self.state_file == Path("off") else self.state_file

    @field_validator("owner_claims_dir", "kubelet_pod_logs_dir", mode="before")
    @classmethod
    def _claims_dir(cls, value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.strip() == ""):
            return None
        if not Path(value).is_absolute():
            raise ValueError("must be an absolute path")
        return value

    @field_validator("allowed_uids", mode="before")
    @classmethod
    def _uids(cls, value: Any) -> Any:
        return _ids(value, _uid)

    @field_validator("allowed_gids", mode="before")
    @classmethod
    def _gids(cls, value: Any) -> Any:
        return _ids(value, _gid)

    @field_validator("status_peers", mode="before")
    @classmethod
    def _peers(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list | tuple):
            if len(value) > MAX_STATUS_PEERS:
                raise ValueError(f"at most {MAX_STATUS_PEERS} peers")
            for v in value:
                if not re.fullmatch(r"https?://[^/\s]+/?", str(v)):
                    raise ValueError(f"expected http(s)://HOST:PORT, got {v!r}")
            return tuple(str(v).rstrip("/") for v in value)
        return value

    @field_validator("log_level")
    @classmethod
    def _check_level(cls, value: str) -> str:
        value = value.lower()
        if value not in ("critical", "error", "warning", "info", "debug"):
            raise ValueError(f"unknown log level {value!r}")
        return value

    @model_validator(mode="after")
    def _check_uid_quota(self) -> Settings:
        per_uid = self.ingest_max_connections_per_uid
        if per_uid is not None and per_uid > self.ingest_max_connections:
            raise ValueError(
                f"ingest_max_connections_per_uid ({per_uid}) must be at most "
                f"ingest_max_connections ({self.ingest_max_connections})"
            )
        return self

    def connections_per_uid(self, cap: int) -> int:
        """Connections one uid may hold when at most ``cap`` are open in all.

        ``cap`` is ``ingest_max_connections`` as lowered to fit the open-file limit; the
        quota is :attr:`ingest_max_connections_per_uid` if set, else ``cap // 4`` but at least
        ``min(64, cap)``; never more than ``cap``.
        """
        per_uid = self.ingest_max_connections_per_uid
        if per_uid is None:
            per_uid = max(min(64, cap), cap // 4)
        return max(1, min(per_uid, cap))

    @field_validator("step_duration_buckets")
    @classmethod
    def _check_buckets(cls, b: tuple[float, ...]) -> tuple[float, ...]:
        if not all(math.isfinite(x) for x in b):
            raise ValueError("buckets must be finite numbers (the +Inf bucket is always added)")
        if not b or any(x <= 0 for x in b) or list(b) != sorted(set(b)):
            raise ValueError("buckets must be positive and strictly increasing")
        if b[-1] > WEEK_S:
            raise ValueError(f"buckets are at most {WEEK_S} s (a week)")
        return b

    @property
    def host(self) -> str:
        """Host part of :attr:`listen` (brackets of an IPv6 literal removed)."""
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        """Port part of :attr:`listen`."""
        return int(self.listen.rpartition(":")[2])

    @property
    def layer_rank_set(self) -> RankSet:
        """:attr:`layer_ranks` parsed."""
        return RankSet.parse(self.layer_ranks)

    @property
    def socket_permissions(self) -> int:
        """:attr:`socket_mode` as an integer."""
        return int(self.socket_mode, 8)

    @property
    def socket_gid(self) -> int | None:
        """:attr:`socket_group` as a group id (None: the default group)."""
        return None if self.socket_group is None else _gid(self.socket_group)


class RankSet:
    """A set of ranks written as ``all``, ``none`` or ``0,8-15,0-1023:8`` (Slurm's array syntax).

    Each comma-separated item is a rank ``N``, a range ``A-B`` (both ends included) or a range
    with a step ``A-B:S`` (``A``, ``A+S``, ... up to ``B``). Held as ranges, so membership costs
    one comparison per item whatever the ranks' count.
    """

    MAX_ITEMS = 256
    """Most comma-separated items: a bound on the setting's size and on each look-up."""

    __slots__ = ("items", "text")

    def __init__(self, text: str, items: tuple[tuple[int, int, int], ...] | None) -> None:
        self.text = text
        self.items = items  # (first, last, step); None: every rank

    @classmethod
    def parse(cls, text: str) -> RankSet:
        """Parse ``text``.

        Raises:
            ValueError: not ``all``/``none``, a malformed item, a range whose end is below
                its start, a step below 1, or more than :attr:`MAX_ITEMS` items.
        """
        spec = text.strip().lower()
        if spec in ("all", "*"):
            return cls(spec, None)
        if spec in ("none", ""):
            return cls(spec, ())
        parts = [p.strip() for p in spec.split(",")]
        if len(parts) > cls.MAX_ITEMS:
            raise ValueError(f"at most {cls.MAX_ITEMS} comma-separated items, got {len(parts)}")
        items = []
        for part in parts:
            m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", part)
            if m is None:
                raise ValueError(
                    f"expected all, none or ranks like 0,8-15,0-1023:8; got {part!r} in {text!r}"
                )
            first = int(m.group(1))
            last = int(m.group(2)) if m.group(2) else first
            step = int(m.group(3)) if m.group(3) else 1
            if last < first or step < 1:
                raise ValueError(f"{part!r}: a range A-B:S needs A <= B and S >= 1")
            items.append((first, last, step))
        return cls(spec, tuple(items))

    def __contains__(self, rank: object) -> bool:
        if not isinstance(rank, int):
            return False
        if self.items is None:
            return True
        return any(a <= rank <= b and (rank - a) % s == 0 for a, b, s in self.items)

    def __repr__(self) -> str:
        return f"RankSet({self.text!r})"


def _gid(value: str) -> int:
    value = value.strip()
    if value.isdigit():
        if int(value) >= MAX_ID:
            raise ValueError(f"group ids are from 0 to {MAX_ID - 1}, got {value}")
        return int(value)  # a number need not have a name (e.g. a Kubernetes fsGroup)
    try:
        return grp.getgrnam(value).gr_gid
    except KeyError:
        raise ValueError(f"unknown group {value!r}") from None


def _uid(value: str) -> int:
    value = value.strip()
    if value.isdigit():
        if int(value) >= MAX_ID:
            raise ValueError(f"user ids are from 0 to {MAX_ID - 1}, got {value}")
        return int(value)
    try:
        return pwd.getpwnam(value).pw_uid
    except KeyError:
        raise ValueError(f"unknown user {value!r}") from None


def _ids(value: Any, resolve: Any) -> Any:
    """A list of ids from numbers, names, or one string of them (JSON or comma-separated)."""
    if isinstance(value, str):
        if value.lstrip().startswith("["):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError(f"expected a JSON list or a,b,c; got {value!r}") from None
        else:
            value = [v for v in value.split(",") if v.strip()]
    if isinstance(value, list | tuple):
        ids = tuple(v if isinstance(v, int) else resolve(str(v)) for v in value)
        if any(not 0 <= i < MAX_ID for i in ids):
            raise ValueError(f"ids are from 0 to {MAX_ID - 1}")
        return ids
    return value


MAX_STATUS_PEERS = 64
"""Most status peers (each is read, in parallel, when the status page shows a hang)."""
MAX_ID = 2**32 - 1
"""Linux user and group ids are below 2^32 - 1 (which stands for "no id")."""


CLIENT_VARIABLES = frozenset(
    {
        "TRAINMON_RUN",
        "TRAINMON_SOCKET",
        "TRAINMON_FLUSH_INTERVAL",
        "TRAINMON_EXPORTER_UID",
        "TRAINMON_AUTORUN",
        "TRAINMON_AUTORUN_PID",
        "TRAINMON_HOOKS",
        "TRAINMON_METRICS",
    }
)
"""``TRAINMON_*`` variables the training client reads (often set in the exporter's
environment too)."""
STATUS_VARIABLES = frozenset({"TRAINMON_STATUS_PASSWORD"})
"""``TRAINMON_*`` variables ``trainmon status`` reads."""


def environment_names() -> frozenset[str]:
    """Every ``TRAINMON_*`` variable the exporter, the client or ``trainmon status`` reads."""
    names = set(CLIENT_VARIABLES | STATUS_VARIABLES)
    for name, field in Settings.model_fields.items():
        names.add(f"TRAINMON_{name.upper()}")
        nested = field.annotation
        if isinstance(nested, type) and issubclass(nested, BaseModel):
            names.update(f"TRAINMON_{name.upper()}__{sub.upper()}" for sub in nested.model_fields)
    return frozenset(names)


def unknown_environment(environ: Mapping[str, str]) -> list[str]:
    """One warning line per ``TRAINMON_*`` variable nothing reads (a misspelt setting?).

    Names are compared case-insensitively, as settings are read. The closest valid name is
    suggested when one is close enough (:func:`difflib.get_close_matches`).
    """
    known = environment_names()
    suffixes = {k.removeprefix("TRAINMON_"): k for k in known}
    lines = []
    for key in sorted(environ):
        upper = key.upper()
        if not upper.startswith("TRAINMON_") or upper in known:
            continue
        close = difflib.get_close_matches(upper.removeprefix("TRAINMON_"), suffixes, 1, 0.6)
        hint = f"did you mean {suffixes[close[0]]}?" if close else "see trainmon-exporter --help"
        lines.append(f"unknown environment variable {key} is ignored; {hint}")
    return lines
