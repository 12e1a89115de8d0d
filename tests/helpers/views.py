"""View models built by hand (:mod:`trainmon_exporter.views.api`), for the views' unit tests.

Each builder fills every field with a plausible value; keywords replace them.
"""

from __future__ import annotations

from typing import Any

from trainmon_exporter.views.api import (
    EventView,
    FrameView,
    GoodputView,
    GpusResponse,
    GpuView,
    HangView,
    PendingCollectiveView,
    ProcessGroupView,
    RankView,
    RunsResponse,
    RunView,
    ThreadView,
)

T = 1_800_000_000.0
"""The views' "now" (Unix seconds)."""

HOSTILE = "a\x1b[31mred\x1b]0;owned\x07b\x1b]8;;http://x\x1b\\c\x9b2Jd\x9d0;t\x9ce\x7ff\ng\u202eh"
"""A string with terminal controls: ESC, a CSI colour, OSC retitles ended by BEL and by ST,
the C1 CSI and OSC bytes with an ST, DEL, a newline and a bidirectional override."""


def controls(text: str) -> list[str]:
    """The control characters in ``text`` other than newlines (what a view must not print)."""
    return [c for c in text if c != "\n" and not c.isprintable()]


def event(kind: str = "loss_spike", step: int | None = 1377, **kw: Any) -> EventView:
    fields: dict[str, Any] = {
        "kind": kind,
        "step": step,
        "time": T - 5,
        "value": 9.0,
        "count": 1,
        "last_step": step,
    }
    return EventView(**(fields | kw))


def rank(rank: int = 0, **kw: Any) -> RankView:
    """A running rank of 8 on GPU ``rank`` with a loss, 123456 tokens/s and 41.7 % MFU."""
    fields: dict[str, Any] = {
        "rank": rank,
        "local_rank": rank,
        "world_size": 8,
        "hostname": f"gpu-node-{rank + 7}.cluster.example.org",
        "gpu_uuid": f"GPU-{rank}",
        "gpu": rank,
        "dtype": "bf16",
        "up": True,
        "status": "running",
        "step": 1499,
        "last_step_time": T - 0.5,
        "seconds_since_last_step": 0.5,
        "steps_total": 1500,
        "tokens_total": 1.5e8,
        "samples_total": 1.5e5,
        "tokens_per_second": 123456.0,
        "samples_per_second": 120.5,
        "client_overhead_ratio": 0.00123,
        "step_time_mean_seconds": 0.8125,
        "model_flops_per_second": 4.1e14,
        "mfu_ratio": 0.417,
        "mfu_unavailable_reason": None,
        "gpu_memory_used_bytes": 60 * 2**30,
        "loss_ema": 2.5678,
        "values": {"loss": 2.3456, "lr": 3e-4, "grad_norm": 1.25},
        "custom": {},
        "nonfinite": {},
        "dropped": {"disconnected": 0, "backpressure": 0, "encode_error": 0, "in_flight": 0},
        "refused_values": 0,
        "crashes": 0,
        "health": [],
        "events": [],
        "goodput": goodput(),
    }
    return RankView(**(fields | kw))


def goodput(**kw: Any) -> GoodputView:
    """91.2 % goodput over an hour, data loading the largest badput."""
    fields: dict[str, Any] = {
        "ratio": 0.912,
        "productive_seconds": 3000.0,
        "uncheckpointed_seconds": 283.2,
        "badput_seconds": {"startup": 90.0, "data_loading": 166.8, "checkpoint_save": 60.0},
        "largest_badput": "data_loading",
        "data_loading_share": 0.05,
        "input_bound": False,
    }
    return GoodputView(**(fields | kw))


def runs(*ranks: RankView, run: str = "gpt2-medium-finetune") -> RunsResponse:
    """One run holding ``ranks``."""
    world = max((r.world_size for r in ranks), default=1)
    return RunsResponse(
        time=T, runs=[RunView(run=run, world_size=world, owner_uid=1000, ranks=list(ranks))]
    )


def gpu(index: int = 0, **kw: Any) -> GpuView:
    """An H100 at 93 % with 71 of 80 GiB used."""
    fields: dict[str, Any] = {
        "index": index,
        "uuid": f"GPU-{index}",
        "name": "NVIDIA H100 80GB HBM3",
        "pci_bus_id": f"00000000:1{index}:00.0",
        "utilization_ratio": 0.93,
        "memory_used_bytes": 71 * 2**30,
        "memory_size_bytes": 80 * 2**30,
        "power_usage_watts": 612.0,
        "temperature_celsius": 67.0,
        "sm_clock_hertz": 1.98e9,
        "tensor_active_ratio": 0.61,
        "slowdown_reasons": [],
        "xid_errors": 0,
    }
    return GpuView(**(fields | kw))


def gpus(*views: GpuView, **kw: Any) -> GpusResponse:
    """An NVML pass that found ``views``."""
    fields: dict[str, Any] = {
        "time": T,
        "ok": True,
        "error": "",
        "hint": "",
        "driver_version": "550.54.15",
        "lost_total": 0,
        "sample_seconds": 0.0042,
        "gpus": list(views),
    }
    return GpusResponse(**(fields | kw))


def no_gpus(error: str = "NVML Shared Library Not Found", hint: str = "") -> GpusResponse:
    """No NVML pass: ``error`` says why."""
    return gpus(ok=False, error=error, hint=hint, driver_version="", sample_seconds=0.0)


TORCH = "/venv/lib/python3.11/site-packages/torch/distributed"
LOOP = [
    FrameView(file="/job/train.py", line=90, function="<module>", user=True),
    FrameView(file="/job/train.py", line=61, function="train", user=True),
]
IN_ALL_REDUCE = [
    *LOOP,
    FrameView(file=f"{TORCH}/c10d_logger.py", line=83, function="wrapper", user=False),
    FrameView(file=f"{TORCH}/distributed_c10d.py", line=3252, function="all_reduce", user=False),
]
"""A training thread waiting in ``dist.all_reduce`` at train.py:61."""
IN_LOADER = [*LOOP[:1], FrameView(file="/job/train.py", line=57, function="load_batch", user=True)]
"""A training thread stuck in its data loader at train.py:57, before the all-reduce."""


def hang(
    frames: list[FrameView] | None = None,
    enqueued: int = 12,
    status: str = "captured",
    **kw: Any,
) -> HangView:
    """A rank's capture: its training thread at ``frames``, its group 0 at ``enqueued``.

    The collective is pending when the innermost frame is torch's (``all_reduce``).
    """
    frames = IN_ALL_REDUCE if frames is None else frames
    waits = bool(frames) and not frames[-1].user
    user = [f for f in frames if f.user]
    pending = (
        PendingCollectiveView(
            seq=enqueued,
            op="gloo:all_reduce",
            p2p=False,
            sizes=[[1000]],
            out_sizes=[[1000]],
            dtypes=["Float"],
            state="scheduled",
            seconds=30.0,
        )
        if waits
        else None
    )
    fields: dict[str, Any] = {
        "hung": True,
        "status": status,
        "step": 1499,
        "requested_at": T - 30,
        "answered_at": T - 29.5,
        "frame": f"{user[-1].function} (train.py:{user[-1].line})" if user else "(no answer)",
        "collective": "gloo:all_reduce" if waits else "",
        "threads": [
            ThreadView(
                name="MainThread", id=1, training=True, state="S", cpu=0.0, frames=frames, omitted=0
            )
        ],
        "threads_omitted": 0,
        "distributed": "ok",
        "distributed_detail": "",
        "groups": [
            ProcessGroupView(
                id="0",
                name="default_pg",
                enqueued=enqueued,
                started=-1,
                completed=enqueued - 1 if waits else enqueued,
                pending=pending,
            )
        ],
        "notes": [],
        "capture_seconds": 0.1,
        "gpu_power_watts": None,
        "gpu_power_limit_watts": None,
        "gpu_sm_active_ratio": None,
        "native": None,
    }
    if status != "captured":
        fields |= {"threads": [], "groups": [], "frame": None, "collective": ""}
        if status == "no_answer":
            fields["frame"] = "(no answer)"
    return HangView(**(fields | kw))
