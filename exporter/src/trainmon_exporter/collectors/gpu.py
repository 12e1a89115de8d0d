"""Per-GPU series from the NVML sampler's latest snapshot (collector ``gpu``).

The scrape never calls NVML: it formats the last
:class:`~trainmon_exporter.sampler.GpuSnapshot`, mapping each typed reading
(:class:`~trainmon_exporter.sampler.GpuReadings`) to its catalog family. Labels are ``gpu``
(NVML index) and ``uuid``, as in dcgm-exporter, so its dashboards and trainmon's can be
joined; identity (name, PCI bus id, driver) lives in ``trainmon_gpu_info``.

No NVML is a state the collector reports, not a failure of the collector:
``trainmon_gpu_nvml_available`` says whether NVML is sampling and ``trainmon_gpu_expected``
whether this node should have GPU metrics; the alert ``TrainmonGpuMetricsUnavailable`` fires
only when both say "expected but not sampling". The hint is in the log, ``/readyz`` and the
status page. The error counters exist at 0 on every node, GPUs or not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.metrics_core import Metric

from trainmon_exporter import catalog
from trainmon_exporter.catalog import Family
from trainmon_exporter.collectors import CollectorContext, register
from trainmon_exporter.nvml import ERROR_KINDS
from trainmon_exporter.sampler import GpuReadings, GpuSampler

# (family, its reading of a GPU, in the base unit; None omits the sample)
_READINGS: tuple[tuple[Family, Callable[[GpuReadings], float | None]], ...] = (
    (catalog.GPU_UTILIZATION_RATIO, lambda r: r.utilization_ratio),
    (catalog.GPU_MEMORY_UTILIZATION_RATIO, lambda r: r.memory_utilization_ratio),
    (catalog.GPU_MEMORY_USED_BYTES, lambda r: r.memory_used_bytes),
    (catalog.GPU_MEMORY_FREE_BYTES, lambda r: r.memory_free_bytes),
    (catalog.GPU_MEMORY_SIZE_BYTES, lambda r: r.memory_total_bytes),
    (catalog.GPU_POWER_USAGE_WATTS, lambda r: r.power_usage_watts),
    (catalog.GPU_POWER_LIMIT_WATTS, lambda r: r.power_limit_watts),
    (catalog.GPU_TEMPERATURE_CELSIUS, lambda r: r.temperature_celsius),
    (catalog.GPU_MEMORY_TEMPERATURE_CELSIUS, lambda r: r.memory_temperature_celsius),
    (catalog.GPU_SM_CLOCK_HERTZ, lambda r: r.sm_clock_hertz),
    (catalog.GPU_MEMORY_CLOCK_HERTZ, lambda r: r.memory_clock_hertz),
    (catalog.GPU_SM_CLOCK_MAX_HERTZ, lambda r: r.sm_clock_max_hertz),
    (catalog.GPU_MEMORY_CLOCK_MAX_HERTZ, lambda r: r.memory_clock_max_hertz),
    (catalog.GPU_REMAPPED_ROWS_PENDING, lambda r: _flag(r.remapped_rows_pending)),
    (catalog.GPU_REMAPPED_ROWS_FAILED, lambda r: _flag(r.remapped_rows_failed)),
    (catalog.GPU_PROCESSES, lambda r: None if r.processes is None else float(r.processes)),
    (catalog.GPU_SM_ACTIVE_RATIO, lambda r: r.sm_active_ratio),
    (catalog.GPU_SM_OCCUPANCY_RATIO, lambda r: r.sm_occupancy_ratio),
    (catalog.GPU_TENSOR_ACTIVE_RATIO, lambda r: r.tensor_active_ratio),
    (catalog.GPU_DRAM_ACTIVE_RATIO, lambda r: r.dram_active_ratio),
    (catalog.GPU_ENERGY_CONSUMPTION_JOULES, lambda r: r.energy_joules),
    (catalog.GPU_PCIE_TRANSMIT_BYTES, lambda r: r.pcie_transmit_bytes),
    (catalog.GPU_PCIE_RECEIVE_BYTES, lambda r: r.pcie_receive_bytes),
    (catalog.GPU_NVLINK_TRANSMIT_BYTES, lambda r: r.nvlink_transmit_bytes),
    (catalog.GPU_NVLINK_RECEIVE_BYTES, lambda r: r.nvlink_receive_bytes),
    (catalog.GPU_SLOW_SAMPLE_TIMESTAMP_SECONDS, lambda r: r.slow_sampled_at),
)


def _flag(v: bool | None) -> float | None:
    return None if v is None else (1.0 if v else 0.0)


@register("gpu")
class GpuCollector:
    """Formats the sampler's snapshot: the NVML state always, per-GPU series while sampling."""

    name = "gpu"

    def __init__(self, ctx: CollectorContext) -> None:
        if ctx.gpus is None:
            raise ValueError("the gpu collector needs a GpuSampler in its context")
        self.sampler: GpuSampler = ctx.gpus

    def collect(self) -> Iterable[Metric]:
        """Return every GPU family (types, units and sources: docs/metrics.md)."""
        snap = self.sampler.snapshot
        lost = catalog.GPU_LOST.counter()
        lost.add_metric([], float(snap.lost_total))
        lost_at = catalog.GPU_LOST_LAST_TIMESTAMP_SECONDS.gauge()
        if snap.lost_at is not None:
            lost_at.add_metric([], snap.lost_at)
        errors = catalog.GPU_READ_ERRORS.counter()
        for kind in ERROR_KINDS:
            errors.add_metric([kind], float(snap.read_errors.get(kind, 0)))
        available = catalog.GPU_NVML_AVAILABLE.gauge()
        available.add_metric([], 1.0 if snap.ok else 0.0)
        expected = catalog.GPU_EXPECTED.gauge()
        expected.add_metric([], 1.0 if snap.expected else 0.0)
        devices = catalog.GPU_DEVICES.gauge()
        devices.add_metric([], float(len(snap.gpus)))
        state = [available, expected, devices, lost, lost_at, errors]
        if not snap.ok:
            return state
        readings = [
            (f.gauge() if f.type == catalog.GAUGE else f.counter(), read) for f, read in _READINGS
        ]
        info = catalog.GPU_INFO.gauge()
        clock_events = catalog.GPU_CLOCK_EVENT_REASON_ACTIVE.gauge()
        ecc = catalog.GPU_ECC_ERRORS.counter()
        remapped = catalog.GPU_REMAPPED_ROWS.counter()
        xid = catalog.GPU_XID_ERRORS.counter()
        xid_at = catalog.GPU_XID_ERRORS_LAST_TIMESTAMP_SECONDS.gauge()
        for g in snap.gpus:
            labels = [str(g.index), g.uuid]
            for fam, read in readings:
                value = read(g.readings)
                if value is not None:
                    fam.add_metric(labels, value)
            device_id = f"0x{g.pci_device_id:08x}" if g.pci_device_id else ""
            info.add_metric([*labels, g.name, g.pci_bus_id, device_id, snap.driver_version], 1.0)
            for reason, active in g.clock_events.items():
                clock_events.add_metric([*labels, reason], active)
            for (error_type, counter_type), count in g.ecc.items():
                ecc.add_metric([*labels, error_type, counter_type], count)
            for cause, rows in g.remapped_rows.items():
                remapped.add_metric([*labels, cause], rows)
            for code, n in sorted(g.xid.items()):
                xid.add_metric([*labels, code], float(n))
            for code, when in sorted(g.xid_at.items()):
                xid_at.add_metric([*labels, code], when)
        duration = catalog.GPU_SAMPLE_DURATION_SECONDS.gauge()
        duration.add_metric([], snap.sample_seconds)
        age = catalog.GPU_SAMPLE_TIMESTAMP_SECONDS.gauge()
        age.add_metric([], snap.taken_at)
        return [
            *(fam for fam, _ in readings),
            info,
            clock_events,
            ecc,
            remapped,
            xid,
            xid_at,
            duration,
            age,
            *state,
        ]
