"""Build trainmon's Grafana dashboards (JSON in deploy/grafana/dashboards/).

    python deploy/grafana/build_dashboards.py        # rewrite the JSON files

Dashboards as code: panels share helpers, so units, datasource and variables stay consistent.
The tests regenerate the JSON and compare. They also round-trip it through
grafana-foundation-sdk (no unknown keys), parse every query with promtool, and check every
metric name against the exporter's metric catalog (trainmon_exporter.catalog).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards"
DS = {"type": "prometheus", "uid": "${datasource}"}
# A run is (cluster, namespace, run) fleet-wide. On a single Prometheus neither label exists.
# Every variable's "All" is the regex .* (ALL_VALUE), which also matches a label that is absent:
# an alert or series without run, rank or instance still shows under "All".
ALL_VALUE = ".*"
CLUSTER = 'cluster=~"$cluster"'
RUN = 'cluster=~"$cluster", namespace=~"$namespace", run=~"$run"'
SEL = f'{RUN}, rank=~"$rank"'
FLEET = "cluster, namespace"
# The clock-event reasons that mean a slowed GPU: trainmon_exporter.nvml.SLOWDOWN_REASONS (the
# alert TrainmonGpuThrottled matches these; sw_power_cap is normal at full load). A test keeps
# this copy equal to it, so this script runs without the exporter installed.
SLOWDOWN_REASONS = (
    "hw_slowdown",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
)


def variables(extra: tuple[tuple[str, str], ...] = ()) -> dict[str, Any]:
    def query_var(name: str, query: str) -> dict[str, Any]:
        var = {
            "type": "query",
            "name": name,
            "label": name,
            "datasource": DS,
            "query": {"query": query, "refId": name},
            "refresh": 2,
            "multi": True,
            "includeAll": True,
            "current": {"text": "All", "value": "$__all"},
            "sort": 1,
            "allValue": ALL_VALUE,
        }
        return var

    return {
        "list": [
            {
                "type": "datasource",
                "name": "datasource",
                "label": "Data source",
                "query": "prometheus",
                "current": {"text": "Prometheus", "value": "trainmon-prometheus"},
            },
            query_var("cluster", "label_values(trainmon_run_info, cluster)"),
            query_var("namespace", f"label_values(trainmon_run_info{{{CLUSTER}}}, namespace)"),
            query_var(
                "run",
                'label_values(trainmon_run_info{cluster=~"$cluster", namespace=~"$namespace"}, run)',
            ),
            query_var("rank", f"label_values(trainmon_rank_info{{{RUN}}}, rank)"),
            *(query_var(name, query) for name, query in extra),
        ]
    }


class Layout:
    """Places panels left to right, 24 grid units wide."""

    def __init__(self) -> None:
        self.x = self.y = self.row_h = 0
        self.next_id = 1

    def place(self, w: int, h: int) -> dict[str, int]:
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        pos = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.x += w
        self.row_h = max(self.row_h, h)
        return pos

    def id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def panel(
    lay: Layout,
    title: str,
    targets: list[tuple[str, str]],
    *,
    unit: str = "short",
    kind: str = "timeseries",
    w: int = 12,
    h: int = 8,
    description: str = "",
    log_scale: bool = False,
    stacked: bool = False,
) -> dict[str, Any]:
    custom: dict[str, Any] = {}
    if kind == "timeseries":
        custom = {"lineWidth": 1, "fillOpacity": 0, "showPoints": "never"}
        if log_scale:
            custom["scaleDistribution"] = {"type": "log", "log": 10}
        if stacked:
            custom["fillOpacity"] = 60
            custom["stacking"] = {"mode": "normal", "group": "A"}
    p: dict[str, Any] = {
        "type": kind,
        "id": lay.id(),
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": lay.place(w, h),
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
        "options": {},
        "targets": [
            {"refId": chr(65 + i), "datasource": DS, "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
    }
    if kind == "timeseries":
        p["options"] = {
            "legend": {"showLegend": True, "displayMode": "list", "placement": "bottom"},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    return p


def row(lay: Layout, title: str) -> dict[str, Any]:
    lay.x, lay.y, lay.row_h = 0, lay.y + lay.row_h, 0
    pos = lay.place(24, 1)
    lay.x, lay.row_h = 24, 1
    return {
        "type": "row",
        "id": lay.id(),
        "title": title,
        "gridPos": pos,
        "collapsed": False,
        "panels": [],
    }


def events(counter: str, by: str = f"{FLEET}, run, rank") -> str:
    """Events a counter counted over the dashboard's time range, per ``by``."""
    return f"sum by ({by}) (increase({counter}{{{SEL}}}[$__range]))"


def annotation(name: str, color: str, expr: str) -> dict[str, Any]:
    return {
        "name": name,
        "enable": True,
        "iconColor": color,
        "datasource": DS,
        "expr": expr,
    }


def dashboard(
    uid: str,
    title: str,
    description: str,
    panels: list[dict[str, Any]],
    annotations: list[dict[str, Any]],
    extra_variables: tuple[tuple[str, str], ...] = (),
) -> dict[str, Any]:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["trainmon"],
        "editable": False,
        "schemaVersion": 39,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "timezone": "browser",
        "graphTooltip": 1,
        "templating": variables(extra_variables),
        "annotations": {"list": annotations},
        "panels": panels,
    }


def training() -> dict[str, Any]:
    lay = Layout()
    rank_legend = "{{run}} rank {{rank}}"
    panels = [
        row(lay, "Loss and optimisation"),
        panel(
            lay,
            "Loss and its EMA",
            [
                (f"trainmon_train_loss{{{SEL}}}", f"loss {rank_legend}"),
                (f"trainmon_train_loss_ema{{{SEL}}}", f"EMA {rank_legend}"),
            ],
        ),
        panel(
            lay,
            "Validation loss",
            [
                (f"trainmon_eval_loss{{{SEL}}}", rank_legend),
            ],
            description="Run.eval(step, val_loss=...)",
        ),
        panel(lay, "Learning rate", [(f"trainmon_train_learning_rate{{{SEL}}}", rank_legend)], w=8),
        panel(
            lay,
            "Gradient norm and its rolling mean",
            [
                (f"trainmon_train_grad_norm{{{SEL}}}", f"grad norm {rank_legend}"),
                (f"trainmon_train_grad_norm_mean{{{SEL}}}", f"mean {rank_legend}"),
            ],
            w=8,
            log_scale=True,
        ),
        panel(
            lay,
            "Loss z-score",
            [(f"trainmon_train_loss_zscore{{{SEL}}}", rank_legend)],
            w=8,
            description="Spikes are counted from z = 4 (minor), 6 (major), 10 (severe).",
        ),
        row(lay, "Speed"),
        panel(
            lay,
            "Tokens per second",
            [
                (f"trainmon_train_tokens_per_second{{{SEL}}}", rank_legend),
                (f"run:trainmon_train_tokens_per_second:sum{{{RUN}}}", "{{run}} total"),
            ],
        ),
        panel(
            lay,
            "MFU, and the GPU's tensor-core activity",
            [
                (f"trainmon_train_mfu_ratio{{{SEL}}}", "MFU " + rank_legend),
                (f"run:trainmon_train_mfu_ratio:avg{{{RUN}}}", "MFU {{run}} mean"),
                (
                    f'max by ({FLEET}, run, rank, uuid) (trainmon_rank_info{{{SEL}, uuid!=""}}) '
                    "* on (cluster, uuid) group_left () max by (cluster, uuid) "
                    f"(trainmon_gpu_tensor_active_ratio{{{CLUSTER}}})",
                    "tensor active " + rank_legend,
                ),
            ],
            unit="percentunit",
            description="MFU = tokens/s x FLOPs per token / the GPU's dense peak for the dtype "
            "(trainmon_train_mfu_unavailable says why a rank has none). Tensor active is NVML "
            "GPM's view of the same GPU (Hopper and newer).",
        ),
        panel(
            lay,
            "Step time (heatmap)",
            [
                (
                    f"sum by (le) (increase(trainmon_train_step_duration_seconds_bucket{{{SEL}}}"
                    "[$__rate_interval]))",
                    "{{le}}",
                ),
            ],
            kind="heatmap",
            unit="s",
        ),
        panel(
            lay,
            "Median step time per rank",
            [
                (f"trainmon_train_step_time_median_seconds{{{SEL}}}", rank_legend),
            ],
            unit="s",
            w=8,
        ),
        panel(
            lay,
            "Throughput ratio (1 = usual)",
            [
                (f"trainmon_train_throughput_ratio{{{SEL}}}", rank_legend),
            ],
            unit="percentunit",
            w=8,
        ),
        panel(
            lay,
            "Straggler ratio (1 = like the others)",
            [
                (f"trainmon_train_straggler_ratio{{{SEL}}}", rank_legend),
            ],
            w=8,
        ),
        row(lay, "Where the time goes"),
        panel(
            lay,
            "Badput by kind (share of the job's time, last 5 minutes)",
            [
                (
                    f"run:trainmon_train_badput_seconds:increase5m{{{RUN}}} / on ({FLEET}, run) "
                    f"group_left () run:trainmon_train_accounted_seconds:increase5m{{{RUN}}}",
                    "{{run}} {{kind}}",
                ),
            ],
            unit="percentunit",
            stacked=True,
            description="Each badput kind's share of the job's time (every rank's, on every "
            "node that accounted it): startup, data loading, checkpoint save and restore, "
            "evaluation, hang, wasted progress (at-risk time included), recovery (with the time "
            "between two nodes), other. The job goes at its slowest loader's pace: its data "
            "loading is the largest share of any rank (recording rules; docs/goodput.md). What "
            "is left of 100 % trained.",
        ),
        panel(
            lay,
            "Goodput",
            [
                (f"run:trainmon_train_goodput:ratio{{{RUN}}}", "{{run}} over its life"),
                (f"run:trainmon_train_goodput:ratio_1h{{{RUN}}}", "{{run}} last hour"),
                (f"run:trainmon_train_goodput:ratio5m{{{RUN}}}", "{{run}} last 5 minutes"),
            ],
            unit="percentunit",
            description="The job's productive plus uncheckpointed step time over all its "
            "ranks' wall-clock, across restarts on other nodes, at its critical path "
            "(recording rules; docs/goodput.md).",
        ),
        panel(
            lay,
            "The rank the job waits on for its input",
            [
                (
                    f"run:trainmon_train_badput_seconds:data_loading_critical_rank{{{RUN}}}",
                    "{{run}} rank {{rank}} on {{hostname}}",
                ),
            ],
            unit="percentunit",
            kind="stat",
            w=12,
            h=6,
            description="The rank with the largest share of its time waiting for data over the "
            "last 5 minutes, and where it runs: in a synchronous job every rank waits that "
            "long (docs/goodput.md#the-jobs-critical-path).",
        ),
        panel(
            lay,
            "Ranks whose data loading is not measured",
            [
                (
                    f"count by ({FLEET}, run) (trainmon_train_data_loading_measured{{{SEL}}} == 0)",
                    "{{run}}",
                ),
            ],
            kind="stat",
            w=12,
            h=6,
            description="Ranks that never reported a data wait (Run.timed(), data_time): their "
            "data loading is inside their step time, not zero (docs/goodput.md).",
        ),
        row(lay, "Events (counted at every step)"),
        panel(
            lay,
            "Non-finite values",
            [
                (
                    events("trainmon_train_nonfinite_values_total", f"{FLEET}, run, rank, field"),
                    "{{field}} " + rank_legend,
                ),
            ],
            kind="stat",
            w=6,
            h=6,
        ),
        panel(
            lay,
            "Loss spikes",
            [
                (
                    events("trainmon_train_loss_spikes_total"),
                    rank_legend,
                ),
            ],
            kind="stat",
            w=6,
            h=6,
        ),
        panel(
            lay,
            "Gradient explosions",
            [
                (
                    events("trainmon_train_grad_explosions_total"),
                    rank_legend,
                ),
            ],
            kind="stat",
            w=6,
            h=6,
        ),
        panel(
            lay,
            "Crashes and hangs",
            [
                (
                    events("trainmon_run_crashes_total"),
                    "crashes " + rank_legend,
                ),
                (
                    events("trainmon_train_hangs_total"),
                    "hangs " + rank_legend,
                ),
            ],
            kind="stat",
            w=6,
            h=6,
        ),
    ]
    annotations = [
        annotation(
            "NaN/Inf", "red", f"increase(trainmon_train_nonfinite_values_total{{{RUN}}}[1m]) > 0"
        ),
        annotation(
            "Loss spike",
            "orange",
            f"sum without (severity) (increase(trainmon_train_loss_spikes_total{{{RUN}}}[1m])) > 0",
        ),
        annotation("Crash", "purple", f"increase(trainmon_run_crashes_total{{{RUN}}}[1m]) > 0"),
    ]
    return dashboard(
        "trainmon-training",
        "trainmon / Training overview",
        "Loss, optimisation, speed and step-level events per run and rank.",
        panels,
        annotations,
    )


def health() -> dict[str, Any]:
    lay = Layout()
    rank_legend = "{{run}} rank {{rank}}"
    panels = [
        row(lay, "Alerts and liveness"),
        panel(
            lay,
            "Alerts firing",
            [
                (f'ALERTS{{alertstate="firing", {RUN}}}', "{{alertname}} {{run}} {{rank}}"),
            ],
            kind="table",
            w=12,
        ),
        panel(
            lay,
            "Ranks connected",
            [(f"trainmon_run_up{{{SEL}}}", rank_legend)],
            kind="state-timeline",
            w=12,
        ),
        panel(
            lay,
            "Step overdue (seconds since step / median step time)",
            [
                (f"trainmon_train_step_overdue_ratio{{{SEL}}}", rank_legend),
            ],
            w=12,
        ),
        panel(
            lay,
            "Client drops",
            [
                (
                    f"sum by ({FLEET}, run, rank, reason) (rate(trainmon_client_dropped_messages_total{{{SEL}}}"
                    "[$__rate_interval]))",
                    "{{reason}} " + rank_legend,
                ),
            ],
            unit="ops",
            w=12,
        ),
        row(lay, "Monitoring cost"),
        panel(
            lay,
            "Monitoring share of wall time",
            [
                (f"trainmon_monitoring_overhead_ratio{{{SEL}}}", "all monitoring " + rank_legend),
                (f"trainmon_client_overhead_ratio{{{SEL}}}", "trainmon client " + rank_legend),
            ],
            unit="percentunit",
            w=12,
            description="Budget: 5 % (monitoring_budget_ratio).",
        ),
        panel(
            lay,
            "Time per tracked operation",
            [
                (
                    f"sum by ({FLEET}, run, rank, operation) (rate(trainmon_monitoring_seconds_total{{{SEL}}}"
                    "[$__rate_interval]))",
                    "{{operation}} " + rank_legend,
                ),
            ],
            unit="percentunit",
            w=12,
        ),
        row(lay, "Checkpoints and evaluation"),
        panel(
            lay,
            "Checkpoint age",
            [
                (f"time() - trainmon_checkpoint_last_timestamp_seconds{{{SEL}}}", rank_legend),
            ],
            unit="s",
            w=8,
        ),
        panel(
            lay,
            "Checkpoint duration",
            [
                (f"trainmon_checkpoint_last_duration_seconds{{{SEL}}}", rank_legend),
            ],
            unit="s",
            w=8,
        ),
        panel(
            lay,
            "Train/validation gap",
            [
                (f"trainmon_eval_generalization_gap_ratio{{{SEL}}}", rank_legend),
            ],
            unit="percentunit",
            w=8,
        ),
        row(lay, "Memory"),
        panel(
            lay,
            "Allocated memory",
            [
                (f"trainmon_train_memory_allocated_bytes{{{SEL}}}", rank_legend),
            ],
            unit="bytes",
        ),
        panel(
            lay,
            "Memory growth per step",
            [
                (f"trainmon_train_memory_growth_bytes_per_step{{{SEL}}}", rank_legend),
            ],
            unit="bytes",
        ),
        row(lay, "Layers (Run.watch)"),
        panel(
            lay,
            "Update ratio by layer",
            [
                (f"trainmon_layer_update_ratio{{{SEL}}}", "{{layer}} " + rank_legend),
            ],
            log_scale=True,
        ),
        panel(
            lay,
            "Gradient norm by layer",
            [
                (f"trainmon_layer_grad_norm{{{SEL}}}", "{{layer}} " + rank_legend),
            ],
            log_scale=True,
        ),
        panel(
            lay,
            "Layer-to-layer gradient gain",
            [
                (f"trainmon_train_grad_gain_mean{{{SEL}}}", "gain " + rank_legend),
                (f"trainmon_train_grad_gain_drift_ratio{{{SEL}}}", "drift " + rank_legend),
            ],
            w=24,
        ),
    ]
    annotations = [
        annotation("Hang", "red", f"increase(trainmon_train_hangs_total{{{RUN}}}[1m]) > 0"),
        annotation(
            "Memory leak", "orange", f"increase(trainmon_train_memory_leaks_total{{{RUN}}}[1m]) > 0"
        ),
    ]
    return dashboard(
        "trainmon-health",
        "trainmon / Run health",
        "Alerts, liveness, monitoring cost, checkpoints, evaluation, memory, layers.",
        panels,
        annotations,
    )


GPU = f'{CLUSTER}, instance=~"$instance", gpu=~"$gpu"'
NODE = f'{CLUSTER}, instance=~"$instance"'


def on_ranks(gpu_metric: str) -> str:
    """A per-GPU series relabelled with the run and rank on that GPU (join on the UUID)."""
    return (
        f'max by ({FLEET}, run, rank, uuid) (trainmon_rank_info{{{SEL}, uuid!=""}}) '
        f"* on (cluster, uuid) group_left (gpu) max by (cluster, uuid, gpu) ({gpu_metric})"
    )


def slow_rate(counter: str) -> str:
    """The rate of a slow reading (energy, PCIe), exact whenever its reads happened.

    The exporter reads those counters every ``nvml_slow_interval_seconds`` (15 s) and says
    when in ``trainmon_gpu_slow_sample_timestamp_seconds``; ``rate()`` alone would see each
    read up to that long late at either end of the window. Dividing the counter's increase
    by its read time's over the same window gives the rate between the reads themselves
    (Prometheus extrapolates both alike, so that cancels).
    """
    return (
        f"increase({counter}{{{GPU}}}[$__rate_interval]) / "
        f"delta(trainmon_gpu_slow_sample_timestamp_seconds{{{GPU}}}[$__rate_interval])"
    )


def link_panel(lay: Layout, title: str, link: str, legend: str) -> dict[str, Any]:
    """Transmit and receive rates of a GPU's ``link`` byte counters (pcie or nvlink)."""
    targets = []
    for way, short in (("transmit", "tx"), ("receive", "rx")):
        counter = f"trainmon_gpu_{link}_{way}_bytes_total"
        expr = (
            slow_rate(counter) if link == "pcie" else f"rate({counter}{{{GPU}}}[$__rate_interval])"
        )
        targets.append((expr, f"{short} {legend}"))
    return panel(lay, title, targets, unit="Bps")


def gpu() -> dict[str, Any]:
    lay = Layout()
    g = "GPU {{gpu}} {{instance}} {{cluster}}"
    ranked = "{{run}} rank {{rank}} (GPU {{gpu}})"
    panels = [
        row(lay, "Utilisation"),
        panel(
            lay,
            "GPU utilisation (a kernel was running)",
            [(f"trainmon_gpu_utilization_ratio{{{GPU}}}", g)],
            unit="percentunit",
            w=8,
            description="nvmlDeviceGetUtilizationRates: the share of time any kernel ran. Not "
            "throughput; compare SM active and tensor active.",
        ),
        panel(
            lay,
            "SM active and tensor active (GPM)",
            [
                (f"trainmon_gpu_sm_active_ratio{{{GPU}}}", "SM active " + g),
                (f"trainmon_gpu_tensor_active_ratio{{{GPU}}}", "tensor active " + g),
                (f"trainmon_gpu_sm_occupancy_ratio{{{GPU}}}", "occupancy " + g),
            ],
            unit="percentunit",
            w=8,
            description="NVML GPM metrics, Hopper and newer; empty on older GPUs.",
        ),
        panel(
            lay,
            "MFU of the ranks on these GPUs",
            [
                (
                    f"max by ({FLEET}, run, rank) (trainmon_train_mfu_ratio{{{SEL}}}) "
                    f"* on ({FLEET}, run, rank) group_left (uuid) max by ({FLEET}, run, rank, uuid) "
                    f'(trainmon_rank_info{{{SEL}, uuid!=""}})',
                    "{{run}} rank {{rank}} {{uuid}}",
                ),
            ],
            unit="percentunit",
            w=8,
        ),
        row(lay, "Memory"),
        panel(
            lay,
            "Memory used",
            [
                (f"trainmon_gpu_memory_used_bytes{{{GPU}}}", "used " + g),
                (f"trainmon_gpu_memory_size_bytes{{{GPU}}}", "total " + g),
            ],
            unit="bytes",
            w=8,
        ),
        panel(
            lay,
            "Memory used / total",
            [
                (
                    f"trainmon_gpu_memory_used_bytes{{{GPU}}} / "
                    f"trainmon_gpu_memory_size_bytes{{{GPU}}}",
                    g,
                )
            ],
            unit="percentunit",
            w=8,
            description="TrainmonGpuMemoryPressure fires above 95 % for 5 minutes.",
        ),
        panel(
            lay,
            "Per rank: process memory (NVML) and allocator",
            [
                (f"trainmon_rank_gpu_memory_used_bytes{{{SEL}}}", "NVML {{run}} rank {{rank}}"),
                (
                    f"trainmon_train_memory_reserved_bytes{{{SEL}}}",
                    "reserved {{run}} rank {{rank}}",
                ),
                (f"trainmon_train_memory_peak_bytes{{{SEL}}}", "peak {{run}} rank {{rank}}"),
            ],
            unit="bytes",
            w=8,
            description="Allocator figures need init(cuda_memory=True).",
        ),
        row(lay, "Power, clocks and temperature"),
        panel(
            lay,
            "Power",
            [
                (f"trainmon_gpu_power_usage_watts{{{GPU}}}", g),
                (slow_rate("trainmon_gpu_energy_consumption_joules_total"), "average " + g),
                (f"trainmon_gpu_power_limit_watts{{{GPU}}}", "limit " + g),
            ],
            unit="watt",
            w=8,
            description="nvmlDeviceGetPowerUsage, read every pass; average: the energy "
            "counter's rate between its reads (every nvml_slow_interval_seconds).",
        ),
        panel(
            lay,
            "SM clock against its maximum",
            [
                (f"trainmon_gpu_sm_clock_hertz{{{GPU}}}", g),
                (f"trainmon_gpu_sm_clock_max_hertz{{{GPU}}}", "max " + g),
            ],
            unit="hertz",
            w=8,
        ),
        panel(
            lay,
            "Temperature",
            [
                (f"trainmon_gpu_temperature_celsius{{{GPU}}}", g),
                (f"trainmon_gpu_memory_temperature_celsius{{{GPU}}}", "memory " + g),
            ],
            unit="celsius",
            w=8,
        ),
        panel(
            lay,
            "Clock-event (throttle) reasons active",
            [
                (
                    f'trainmon_gpu_clock_event_reason_active{{{GPU}, reason!="gpu_idle"}} > 0',
                    "{{reason}} " + g,
                )
            ],
            unit="short",
            w=12,
            description="nvmlDeviceGetCurrentClocksEventReasons. sw_power_cap is normal at full "
            f"load; {', '.join(SLOWDOWN_REASONS[:-1])} and {SLOWDOWN_REASONS[-1]} alert "
            "(TrainmonGpuThrottled).",
        ),
        panel(
            lay,
            "Step time of each rank next to its GPU's power",
            [
                (f"trainmon_train_step_time_median_seconds{{{SEL}}}", "step {{run}} rank {{rank}}"),
                (on_ranks(f"trainmon_gpu_power_usage_watts{{{GPU}}}"), "W " + ranked),
            ],
            unit="s",
            w=12,
            description="Joined on the GPU UUID the client reports, not on indices.",
        ),
        row(lay, "Interconnect"),
        link_panel(lay, "PCIe", "pcie", g),
        link_panel(lay, "NVLink", "nvlink", g),
        row(lay, "Errors (over the dashboard's range)"),
        panel(
            lay,
            "XID errors",
            [
                (
                    f"sum by (cluster, instance, gpu, xid) (increase(trainmon_gpu_xid_errors_total"
                    f"{{{GPU}}}[$__range]))",
                    "XID {{xid}} " + g,
                )
            ],
            kind="stat",
            w=6,
            h=6,
        ),
        panel(
            lay,
            "Uncorrectable ECC errors",
            [
                (
                    "sum by (cluster, instance, gpu) (increase(trainmon_gpu_ecc_errors_total"
                    f'{{{GPU}, error_type="uncorrected", counter_type="volatile"}}[$__range]))',
                    g,
                )
            ],
            kind="stat",
            w=6,
            h=6,
        ),
        panel(
            lay,
            "Remapped rows",
            [
                (f"trainmon_gpu_remapped_rows_total{{{GPU}}}", "{{cause}} " + g),
                (f"trainmon_gpu_remapped_rows_pending{{{GPU}}}", "pending " + g),
            ],
            kind="stat",
            w=6,
            h=6,
        ),
        panel(
            lay,
            "GPUs lost, NVML read errors",
            [
                (
                    f"sum by (cluster, instance) (increase(trainmon_gpu_lost_total{{{NODE}}}"
                    "[$__range]))",
                    "lost {{instance}} {{cluster}}",
                ),
                (
                    f"sum by (cluster, instance) (increase(trainmon_gpu_read_errors_total{{{NODE}}}"
                    "[$__range]))",
                    "read errors {{instance}} {{cluster}}",
                ),
            ],
            kind="stat",
            w=6,
            h=6,
        ),
    ]
    annotations = [
        annotation("XID", "red", f"increase(trainmon_gpu_xid_errors_total{{{NODE}}}[1m]) > 0"),
    ]
    return dashboard(
        "trainmon-gpu",
        "trainmon / GPUs",
        "NVML telemetry per GPU, joined to the ranks that run on each (on the GPU UUID).",
        panels,
        annotations,
        (
            ("instance", f"label_values(trainmon_gpu_info{{{CLUSTER}}}, instance)"),
            ("gpu", f"label_values(trainmon_gpu_info{{{NODE}}}, gpu)"),
        ),
    )


DASHBOARDS = {"training.json": training, "health.json": health, "gpu.json": gpu}


def render() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {name: json.dumps(build(), indent=2) + "\n" for name, build in DASHBOARDS.items()}


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in render().items():
        (OUT / name).write_text(text)
        print("wrote", OUT / name)
