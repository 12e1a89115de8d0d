"""Per-rank series that need the rank's GPU: MFU, model FLOP/s and its process's GPU memory.

The join key is the GPU UUID the client reports (``torch.cuda.get_device_properties(i).uuid``
in NVML's ``GPU-…`` form), never a device index: ``CUDA_VISIBLE_DEVICES`` renumbers devices
inside the trainer. A rank's process is found in NVML's process list by the PID the kernel
gave the exporter for the socket peer (``SO_PEERCRED``), which is in the exporter's PID
namespace, so it matches NVML's host PIDs when the exporter shares the host's PID namespace
(compose: ``pid: host``); the client's own PID is the fallback.

MFU (PaLM, Chowdhery et al. 2022, appendix B)::

    model FLOP/s = tokens/s x flops_per_token       (client: 6 x num_params by default)
    MFU          = model FLOP/s / peak dense FLOP/s of that GPU model for the client's dtype

with the peak from :mod:`trainmon_exporter.peaks` or the ``peak_flops`` setting
(:func:`trainmon_exporter.derive.mfu`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client.metrics_core import Metric

from trainmon_exporter import catalog, derive
from trainmon_exporter.collectors import CollectorContext, register
from trainmon_exporter.sampler import NOT_STARTED, GpuSampler, GpuSnapshot

MFU_REASONS = (
    "no_flops_per_token",
    "no_gpu_uuid",
    "gpu_not_sampled",
    "unknown_gpu_model",
    "unknown_dtype",
)
"""Why a rank has no MFU (label ``reason`` of ``trainmon_train_mfu_unavailable``)."""


@register("rank_gpu")
class RankGpuCollector:
    """Joins the store's ranks to the sampler's GPUs by UUID at scrape time."""

    name = "rank_gpu"

    def __init__(self, ctx: CollectorContext) -> None:
        self.store = ctx.store
        self.sampler: GpuSampler | None = ctx.gpus
        self.window_s = ctx.settings.rate_window_seconds
        self.override = ctx.settings.peak_flops

    def collect(self) -> Iterable[Metric]:
        """Return the MFU, model FLOP/s, peak and per-rank GPU memory families."""
        snap: GpuSnapshot = self.sampler.snapshot if self.sampler is not None else NOT_STARTED
        gpus = snap.by_uuid()
        pids = snap.process_memory()
        achieved = catalog.TRAIN_MODEL_FLOPS_PER_SECOND.gauge()
        peak = catalog.TRAIN_PEAK_FLOPS_PER_SECOND.gauge()
        mfu = catalog.TRAIN_MFU_RATIO.gauge()
        unavailable = catalog.TRAIN_MFU_UNAVAILABLE.gauge()
        memory = catalog.RANK_GPU_MEMORY_USED_BYTES.gauge()
        now = time.time()
        for s in self.store.iter_ranks():
            labels = [s.namespace, s.run, str(s.rank)]
            pid = derive.process_pid(s)
            if pid in pids:
                memory.add_metric(labels, pids[pid])
            rates = derive.rates(s, now, self.window_s)
            tps = None if rates is None else rates.tokens_per_second
            m, _ = derive.mfu(s, tps, gpus, self.override)
            if m.model_flops is not None:
                achieved.add_metric(labels, m.model_flops)
            if m.peak is not None:
                peak.add_metric(labels, m.peak)
            if m.mfu is not None:
                mfu.add_metric(labels, m.mfu)
            if m.reason:
                unavailable.add_metric([*labels, m.reason], 1.0)
        return [achieved, peak, mfu, unavailable, memory]
