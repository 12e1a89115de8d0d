"""Per-GPU series from the NVML sampler's latest snapshot (collector ``gpu``).

The scrape never calls NVML: it formats the last :class:`~trainmon_exporter.nvml.GpuSnapshot`.
Labels are ``gpu`` (NVML index) and ``uuid``, as in dcgm-exporter, so its dashboards and
trainmon's can be joined; identity (name, PCI bus id, driver) lives in ``trainmon_gpu_info``.

No NVML is a state the collector reports, not a failure of the collector:
``trainmon_gpu_nvml_available`` says whether NVML is sampling and ``trainmon_gpu_expected``
whether this node should have GPU metrics; the alert ``TrainmonGpuMetricsUnavailable`` fires
only when both say "expected but not sampling". The hint is in the log, ``/readyz`` and the
status page. The error counters exist at 0 on every node, GPUs or not.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from trainmon_exporter.collectors import CollectorContext, register
from trainmon_exporter.nvml import ERROR_KINDS, GpuSampler

GL = ["gpu", "uuid"]

GAUGES: tuple[tuple[str, str], ...] = (
    (
        "trainmon_gpu_utilization_ratio",
        "Share of the last sample period (1/6 s to 1 s, by "
        "product) in which a kernel ran (nvmlDeviceGetUtilizationRates().gpu / 100). Not "
        "throughput: compare trainmon_gpu_sm_active_ratio.",
    ),
    (
        "trainmon_gpu_memory_utilization_ratio",
        "Share of the last sample period in which device "
        "memory was read or written (nvmlDeviceGetUtilizationRates().memory / 100).",
    ),
    (
        "trainmon_gpu_memory_used_bytes",
        "Device memory in use, all processes and the driver "
        "(nvmlDeviceGetMemoryInfo().used, bytes).",
    ),
    (
        "trainmon_gpu_memory_free_bytes",
        "Device memory free (nvmlDeviceGetMemoryInfo().free, bytes).",
    ),
    (
        "trainmon_gpu_memory_size_bytes",
        "Device memory total (nvmlDeviceGetMemoryInfo().total, bytes).",
    ),
    (
        "trainmon_gpu_power_usage_watts",
        "Board power draw (nvmlDeviceGetPowerUsage, mW / 1000). "
        "For energy use the counter trainmon_gpu_energy_consumption_joules_total.",
    ),
    (
        "trainmon_gpu_power_limit_watts",
        "Enforced power limit (nvmlDeviceGetEnforcedPowerLimit, mW / 1000).",
    ),
    (
        "trainmon_gpu_temperature_celsius",
        "GPU die temperature (nvmlDeviceGetTemperature, or nvmlDeviceGetTemperatureV where "
        "a driver lacks it; NVML_TEMPERATURE_GPU, °C).",
    ),
    (
        "trainmon_gpu_memory_temperature_celsius",
        "HBM temperature where the device reports it "
        "(nvmlDeviceGetFieldValues NVML_FI_DEV_MEMORY_TEMP, °C).",
    ),
    ("trainmon_gpu_sm_clock_hertz", "SM clock (nvmlDeviceGetClockInfo NVML_CLOCK_SM, MHz x 1e6)."),
    (
        "trainmon_gpu_memory_clock_hertz",
        "Memory clock (nvmlDeviceGetClockInfo NVML_CLOCK_MEM, MHz x 1e6).",
    ),
    (
        "trainmon_gpu_sm_clock_max_hertz",
        "Highest SM clock (nvmlDeviceGetMaxClockInfo NVML_CLOCK_SM, MHz x 1e6).",
    ),
    (
        "trainmon_gpu_memory_clock_max_hertz",
        "Highest memory clock (nvmlDeviceGetMaxClockInfo NVML_CLOCK_MEM, MHz x 1e6).",
    ),
    (
        "trainmon_gpu_remapped_rows_pending",
        "1 if remapped memory rows wait for a GPU reset to "
        "take effect (nvmlDeviceGetRemappedRows isPending).",
    ),
    (
        "trainmon_gpu_remapped_rows_failed",
        "1 if a row remapping failed: the GPU needs service "
        "(nvmlDeviceGetRemappedRows failureOccurred).",
    ),
    (
        "trainmon_gpu_processes",
        "Compute processes on the GPU (len(nvmlDeviceGetComputeRunningProcesses_v3), or "
        "_v2 / v1 on drivers without it).",
    ),
    (
        "trainmon_gpu_sm_active_ratio",
        "Share of SMs busy between two samples (NVML GPM "
        "NVML_GPM_METRIC_SM_UTIL / 100; Hopper and newer).",
    ),
    (
        "trainmon_gpu_sm_occupancy_ratio",
        "Resident warps over the maximum between two samples "
        "(NVML GPM NVML_GPM_METRIC_SM_OCCUPANCY / 100).",
    ),
    (
        "trainmon_gpu_tensor_active_ratio",
        "Share of time the tensor pipes were busy between two "
        "samples (NVML GPM NVML_GPM_METRIC_ANY_TENSOR_UTIL / 100): the hardware's view of MFU.",
    ),
    (
        "trainmon_gpu_dram_active_ratio",
        "DRAM bandwidth used over its peak between two samples "
        "(NVML GPM NVML_GPM_METRIC_DRAM_BW_UTIL / 100).",
    ),
)

COUNTERS: tuple[tuple[str, str], ...] = (
    (
        "trainmon_gpu_energy_consumption_joules",
        "Energy since the driver loaded (nvmlDeviceGetTotalEnergyConsumption, mJ / 1000).",
    ),
    (
        "trainmon_gpu_pcie_transmit_bytes",
        "Bytes sent over PCIe (nvmlDeviceGetFieldValues NVML_FI_DEV_PCIE_COUNT_TX_BYTES).",
    ),
    (
        "trainmon_gpu_pcie_receive_bytes",
        "Bytes received over PCIe (nvmlDeviceGetFieldValues NVML_FI_DEV_PCIE_COUNT_RX_BYTES).",
    ),
    (
        "trainmon_gpu_nvlink_transmit_bytes",
        "Data bytes sent over NVLink, all links "
        "(nvmlDeviceGetFieldValues NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, KiB x 1024).",
    ),
    (
        "trainmon_gpu_nvlink_receive_bytes",
        "Data bytes received over NVLink, all links "
        "(nvmlDeviceGetFieldValues NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, KiB x 1024).",
    ),
)


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
        lost = CounterMetricFamily(
            "trainmon_gpu_lost",
            "GPUs that NVML reported lost (NVML_ERROR_GPU_IS_LOST) since the exporter started; "
            "their series are dropped.",
        )
        lost.add_metric([], float(snap.lost_total))
        errors = CounterMetricFamily(
            "trainmon_gpu_read_errors",
            "NVML reads that failed other than 'not supported' or a function the driver lacks, "
            "by nvmlReturn_t name ('other': another code; 'exception': a Python exception in "
            "the bindings).",
            labels=["error"],
        )
        for kind in ERROR_KINDS:
            errors.add_metric([kind], float(snap.read_errors.get(kind, 0)))
        available = GaugeMetricFamily(
            "trainmon_gpu_nvml_available",
            "1 while NVML is initialised and sampling; 0 with no NVIDIA library or driver (a "
            "node without GPUs) or NVML failing (sampler state).",
        )
        available.add_metric([], 1.0 if snap.ok else 0.0)
        expected = GaugeMetricFamily(
            "trainmon_gpu_expected",
            "1 when this node should have GPU metrics: --require-gpus, NVML worked since the "
            "exporter started, or NVML is installed but cannot be used; 0 on a node without "
            "an NVIDIA driver (sampler state).",
        )
        expected.add_metric([], 1.0 if snap.expected else 0.0)
        devices = GaugeMetricFamily("trainmon_gpu_devices", "GPUs sampled in the last pass.")
        devices.add_metric([], float(len(snap.gpus)))
        state = [available, expected, devices, lost, errors]
        if not snap.ok:
            return state
        gauges = {n: GaugeMetricFamily(n, h, labels=GL) for n, h in GAUGES}
        counters = {n: CounterMetricFamily(n, h, labels=GL) for n, h in COUNTERS}
        info = GaugeMetricFamily(
            "trainmon_gpu_info",
            "Always 1; a GPU's identity: nvmlDeviceGetName, nvmlDeviceGetPciInfo (bus id, "
            "device id) and nvmlSystemGetDriverVersion.",
            labels=[*GL, "name", "pci_bus_id", "pci_device_id", "driver_version"],
        )
        clock_events = GaugeMetricFamily(
            "trainmon_gpu_clock_event_reason_active",
            "1 while NVML reports this reason for holding clocks down "
            "(nvmlDeviceGetCurrentClocksEventReasons bit; ...ThrottleReasons before R535); "
            "sw_power_cap, hw_slowdown and the thermal reasons slow training.",
            labels=[*GL, "reason"],
        )
        ecc = CounterMetricFamily(
            "trainmon_gpu_ecc_errors",
            "ECC memory errors (nvmlDeviceGetTotalEccErrors): error_type corrected|uncorrected; "
            "counter_type volatile (since the driver loaded) | aggregate (lifetime).",
            labels=[*GL, "error_type", "counter_type"],
        )
        remapped = CounterMetricFamily(
            "trainmon_gpu_remapped_rows",
            "Memory rows remapped (nvmlDeviceGetRemappedRows), by cause correctable|uncorrectable.",
            labels=[*GL, "cause"],
        )
        xid = CounterMetricFamily(
            "trainmon_gpu_xid_errors",
            "XID critical errors (NVML event nvmlEventTypeXidCriticalError) since the exporter "
            "started, by XID code (see NVIDIA's XID catalogue); past 32 codes on one GPU, "
            "new ones count as 'other'.",
            labels=[*GL, "xid"],
        )
        for g in snap.gpus:
            labels = [str(g.index), g.uuid]
            for key, value in g.values.items():
                fam = gauges.get(key) or counters.get(key)
                if fam is not None:
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
        duration = GaugeMetricFamily(
            "trainmon_gpu_sample_duration_seconds",
            "Wall time of the last NVML sampling pass over all GPUs (s, time.perf_counter).",
        )
        duration.add_metric([], snap.sample_seconds)
        age = GaugeMetricFamily(
            "trainmon_gpu_sample_timestamp_seconds",
            "When the last NVML sampling pass finished (Unix s).",
        )
        age.add_metric([], snap.taken_at)
        return [
            *gauges.values(),
            *counters.values(),
            info,
            clock_events,
            ecc,
            remapped,
            xid,
            duration,
            age,
            *state,
        ]
