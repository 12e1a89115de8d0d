"""Active series of a real exporter, counted per rank, per GPU, per node, per run and per layer.

One exporter process (``python -m trainmon_exporter``) samples 8 GPUs of the compiled fake
``libnvidia-ml.so.1`` (every reading of an H100 SXM set) through the real nvidia-ml-py. One run
of 8 ranks, each on its own GPU, uses every feature a rank can produce series for: all
standard fields, tokens and samples, a NaN, evaluations, a checkpoint, a tracked operation,
MFU (the rank's GPU and FLOPs per token) and its process's GPU memory. Rank 0 watches a small
model with activations and quantiles on. The analytics windows are shortened so that every
gauge that needs a full window (trend, plateau, leak, throughput baseline) exists after a few
dozen steps: window lengths change when a series appears, never which series there are.

A series is counted by its labels, from one ``/metrics`` scrape:

- *layer*: it has a ``layer`` label (divided by watched ranks x layers);
- *rank*: a ``rank`` label and no ``layer`` (the largest count of any one rank);
- *run*: a ``run`` label and no ``rank`` (run-level series the exporter computes);
- *GPU*: a ``gpu`` or ``uuid`` label and neither of the above (the largest count of any GPU);
- *node*: everything else (build info, ingest and scrape counters, ``process_*``).

Custom metrics add 1 series per distinct name per rank (at most ``max_custom_metrics``), and
each XID code a GPU reports adds 1 to that GPU: neither is in the counts, which are those of a
rank without custom metrics and of GPUs without XIDs. ``python benchmarks/cardinality.py``
prints the figures.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

import trainmon_client

from ..conftest import ExporterProcess, child_env, free_port, short_tmpdir, tiny_model, wait_for
from ..fakes.libnvml import CONFIG_ENV, build, h100, write_config

GPUS = 8
RANKS = 8
SHORT_WINDOWS = {
    "TRAINMON_ANALYTICS__STEP_TIME_WINDOW_STEPS": "5",
    "TRAINMON_ANALYTICS__THROUGHPUT_RECENT_STEPS": "3",
    "TRAINMON_ANALYTICS__THROUGHPUT_BASELINE_STEPS": "10",
    "TRAINMON_ANALYTICS__TREND_WINDOW_STEPS": "10",
    "TRAINMON_ANALYTICS__LEAK_WINDOW_STEPS": "10",
    "TRAINMON_ANALYTICS__GAIN_BASELINE_CHECKS": "1",
}
STEPS = 40


@dataclass(frozen=True)
class Figures:
    """Series counts from one scrape (see the module docstring for the classes)."""

    per_rank: int
    per_gpu: int
    per_node: int
    per_run: int
    per_layer: float
    total: int
    layers: int  # layers watched on rank 0
    by_class: dict[str, int]  # every series counted once, by class

    def rows(self) -> list[tuple[str, float]]:
        return [
            ("rank", self.per_rank),
            ("GPU", self.per_gpu),
            ("node", self.per_node),
            ("run", self.per_run),
            ("layer", self.per_layer),
        ]


def classify(labels: dict[str, str]) -> str:
    if "layer" in labels:
        return "layer"
    if "rank" in labels:
        return "rank"
    if "run" in labels:
        return "run"
    if "gpu" in labels or "uuid" in labels:
        return "gpu"
    return "node"


def count(text: str) -> tuple[Counter[str], Counter[tuple[str, str]]]:
    """``(series by class, series by (class, unit))`` of an exposition; unit = rank or GPU."""
    by_class: Counter[str] = Counter()
    by_unit: Counter[tuple[str, str]] = Counter()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            cls = classify(s.labels)
            by_class[cls] += 1
            if cls == "rank":
                by_unit[(cls, f"{s.labels['run']}/{s.labels['rank']}")] += 1
            elif cls == "gpu":
                by_unit[(cls, s.labels.get("uuid") or s.labels["gpu"])] += 1
    return by_class, by_unit


def _drive(rank: int, run: trainmon_client.Run) -> None:
    """Every feature that gives a rank series, over STEPS steps."""
    import torch

    model = opt = None
    if rank == 0:
        model, opt = tiny_model()
        run.watch(model, opt, every=2, quantiles_every=2, activations=True, budget=1.0)
    for i in range(STEPS):
        if model is not None and opt is not None:
            loss = (model(torch.randn(16, 8)) - 1).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        with run.track("data"):
            pass
        run.log(
            i,
            loss=3.0 - 0.01 * i,
            lr=1e-3,
            grad_norm=0.7,
            tokens=4096,
            samples=8,
            batch_size=8,
            seq_len=512,
            mem_allocated=1e9 + 1e6 * i,
            mem_reserved=2e9,
            mem_peak=1.5e9,
            alloc_retries=0,
            ooms=0,
        )
        if i % 10 == 9:
            run.eval(i, val_loss=2.5 - 0.001 * i)
        if i == 20:
            run.checkpoint(i, seconds=0.5)
        time.sleep(0.02)
    run.log(STEPS, loss=float("nan"))


def measure(workdir: Path | None = None) -> Figures:
    """Start the exporter, drive the run, scrape once, count (about 10 s)."""
    work = workdir or short_tmpdir()
    lib = build(work / "nvml")
    cfg = work / "gpus.conf"
    gpus = [h100(i, procs=f"{os.getpid()}:{2**30}") for i in range(GPUS)]
    write_config(cfg, gpus)
    env = child_env(LD_LIBRARY_PATH=str(lib.parent), **{CONFIG_ENV: str(cfg)}, **SHORT_WINDOWS)
    sock_dir = short_tmpdir()
    ex = ExporterProcess(
        sock_dir / "t.sock", free_port(), "--nvml-interval-seconds", "0.2", env=env
    ).start()
    try:
        wait_for(lambda: "trainmon_gpu_devices 8.0" in _scrape(ex), timeout=20)
        runs = [
            trainmon_client.init(
                run="budget",
                rank=r,
                local_rank=r,
                world_size=RANKS,
                socket_path=ex.socket,
                num_params=124_000_000,
                gpu_uuid=str(gpus[r]["uuid"]),
                flush_interval=0.0,
            )
            for r in range(RANKS)
        ]
        for r, run in enumerate(runs):
            _drive(r, run)
        wait_for(lambda: all(_stepped(ex, r) for r in range(RANKS)), timeout=20)
        text = _scrape(ex)
        for run in runs:
            run.finish()
    finally:
        ex.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    by_class, by_unit = count(text)
    layers = len(
        {
            s.labels["layer"]
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if "layer" in s.labels
        }
    )
    per_rank = max(n for (cls, _), n in by_unit.items() if cls == "rank")
    per_gpu = max(n for (cls, _), n in by_unit.items() if cls == "gpu")
    return Figures(
        per_rank=per_rank,
        per_gpu=per_gpu,
        per_node=by_class["node"],
        per_run=by_class["run"],
        per_layer=by_class["layer"] / layers if layers else 0.0,
        total=sum(by_class.values()),
        layers=layers,
        by_class=dict(by_class),
    )


def _scrape(ex: ExporterProcess) -> str:
    return httpx.get(ex.url + "/metrics", timeout=10).text


def _stepped(ex: ExporterProcess, rank: int) -> bool:
    runs: list[dict[str, Any]] = ex.runs()["runs"]
    for run in runs:
        for k in run["ranks"]:
            if k["rank"] == rank and k["step"] == STEPS:
                return True
    return False


BUDGET = {"rank": 127, "GPU": 42, "node": 160, "run": 2, "layer": 15}
"""Series per unit; "rank" is a rank with every feature and ``watch()`` on (one tracked
operation), "layer" a watched layer with activations and gradient quantiles."""
SLACK = 0.8
"""A measured figure below ``SLACK x budget`` means the budget is stale (or the scenario broke)."""
GPUS_PER_NODE = 8
LAYERS = 128  # max_layers' default: the most a rank exports
GPUS_PER_RUN = 64  # runs of 8 nodes: the "layers on rank 0" column's assumption


def fleet(gpus: int, layers: str = "none") -> int:
    """Active series of a fleet of ``gpus`` GPUs, one rank per GPU, 8 GPUs a node.

    ``layers``: ``"none"``, ``"rank0"`` (the default ``layer_ranks``: rank 0 of each run of
    GPUS_PER_RUN ranks watches LAYERS layers) or ``"all"`` (every rank watches LAYERS layers).
    """
    b = BUDGET
    runs = math.ceil(gpus / GPUS_PER_RUN)
    total = gpus * (b["rank"] + b["GPU"]) + gpus // GPUS_PER_NODE * b["node"] + runs * b["run"]
    watching = {"none": 0, "rank0": runs, "all": gpus}[layers]
    return total + watching * LAYERS * b["layer"]


def table() -> str:
    """The fleet table of docs/scaling.md, computed from BUDGET."""

    def m(n: int) -> str:
        return f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n / 1e3:.0f} k"

    lines = [
        "| GPUs | nodes | runs | no layers | layers on rank 0 of each run | layers on every rank |",
        "|---|---|---|---|---|---|",
    ]
    for gpus in (1_000, 10_000):
        cells = [m(fleet(gpus, k)) for k in ("none", "rank0", "all")]
        lines.append(
            f"| {gpus:,} | {gpus // GPUS_PER_NODE:,} | {math.ceil(gpus / GPUS_PER_RUN)} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)
