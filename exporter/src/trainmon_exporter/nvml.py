"""NVML: the only module that imports ``pynvml`` (distribution ``nvidia-ml-py``).

Three layers:

- :class:`NvmlBackend`, the typed interface the sampler needs (device count, handles and the
  reads below), with :class:`PynvmlBackend` as the real implementation. Tests substitute a
  fake backend, or drive ``PynvmlBackend`` against a fake ``libnvidia-ml.so.1``.
- The error policy: every ``pynvml.NVMLError`` becomes one of the typed errors here.
  :class:`NvmlUnavailable` (no library, no driver, driver/library version mismatch, no
  permission to the device nodes) makes the GPU collector fail with a one-line hint while
  training metrics keep flowing; :class:`NotSupported` omits that one reading;
  :class:`FunctionNotFound` (an older driver) is logged once per function; :class:`GpuLost`
  drops that GPU's series and is counted.
- :class:`GpuSampler`, a daemon thread that reads every GPU each ``interval`` seconds into an
  immutable :class:`GpuSnapshot`. Scrapes read the latest snapshot and never call NVML, so a
  slow or hung driver call delays only the next sample, never ingest or ``/metrics``.

Units: every value the sampler stores is already in the base unit of the metric that carries it
(bytes, watts, joules, Celsius, hertz, 0–1 ratios); each conversion sits next to the NVML call
that produced the raw value.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import pynvml

log = logging.getLogger("trainmon_exporter.nvml")

T = TypeVar("T")

# --------------------------------------------------------------------------- errors


class NvmlError(Exception):
    """An NVML call failed. ``code`` is the ``nvmlReturn_t`` value (-1 when not from NVML)."""

    def __init__(self, message: str, code: int = -1) -> None:
        super().__init__(message)
        self.code = code


class NvmlUnavailable(NvmlError):
    """NVML cannot be used on this host at all; ``hint`` says what to do about it."""

    def __init__(self, message: str, code: int = -1, hint: str = "") -> None:
        super().__init__(message, code)
        self.hint = hint


class NotSupported(NvmlError):
    """The device does not support this reading (``NVML_ERROR_NOT_SUPPORTED``)."""


class FunctionNotFound(NvmlError):
    """The installed driver's NVML lacks this function (``NVML_ERROR_FUNCTION_NOT_FOUND``)."""


class GpuLost(NvmlError):
    """The GPU fell off the bus or stopped answering (``NVML_ERROR_GPU_IS_LOST``)."""


HINTS: dict[int, str] = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: (
        "libnvidia-ml.so.1 was not found: run on a host with the NVIDIA driver, or start the "
        "container with the NVIDIA runtime (docker compose -f docker-compose.yml "
        "-f docker-compose.gpu.yml up)"
    ),
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: (
        "the NVIDIA kernel driver is not loaded (nvidia-smi fails the same way)"
    ),
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
        "the NVML library and the kernel driver differ in version: reload the nvidia module "
        "or reboot after the driver upgrade"
    ),
    pynvml.NVML_ERROR_NO_PERMISSION: (
        "no permission to open /dev/nvidia*: run the exporter in the video group or with the "
        "NVIDIA runtime"
    ),
}
"""One-line hints for the errors that make NVML unusable (keys: ``nvmlReturn_t`` codes)."""


def translate(exc: pynvml.NVMLError, where: str = "") -> NvmlError:
    """Map a ``pynvml.NVMLError`` to the typed errors of this module."""
    code = int(getattr(exc, "value", -1))
    try:
        text = str(exc)
    except Exception:  # str() asks the library, which may be the thing that is broken
        text = f"NVML error {code}"
    message = f"{where}: {text}" if where else text
    if code in HINTS:
        return NvmlUnavailable(message, code, HINTS[code])
    if code == pynvml.NVML_ERROR_NOT_SUPPORTED:
        return NotSupported(message, code)
    if code == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
        return FunctionNotFound(message, code)
    if code == pynvml.NVML_ERROR_GPU_IS_LOST:
        return GpuLost(message, code)
    return NvmlError(message, code)


# --------------------------------------------------------------------------- backend

CLOCK_SM = pynvml.NVML_CLOCK_SM
CLOCK_MEM = pynvml.NVML_CLOCK_MEM

FIELD_MEMORY_TEMP = pynvml.NVML_FI_DEV_MEMORY_TEMP  # 82, °C
FIELD_PCIE_TX_BYTES = pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES  # 197, bytes, cumulative
FIELD_PCIE_RX_BYTES = pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES  # 198
FIELD_NVLINK_TX_KIB = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX  # 138, KiB, cumulative
FIELD_NVLINK_RX_KIB = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX  # 139

GPM_SM_ACTIVE = pynvml.NVML_GPM_METRIC_SM_UTIL  # 2, % of SMs busy
GPM_SM_OCCUPANCY = pynvml.NVML_GPM_METRIC_SM_OCCUPANCY  # 3, % of max resident warps
GPM_TENSOR_ACTIVE = pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL  # 5, % of time tensor pipes busy
GPM_DRAM_ACTIVE = pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL  # 10, % of peak DRAM bandwidth

CLOCK_EVENT_REASONS: dict[str, int] = {
    "gpu_idle": pynvml.nvmlClocksEventReasonGpuIdle,
    "applications_clocks_setting": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
    "sw_power_cap": pynvml.nvmlClocksEventReasonSwPowerCap,
    "hw_slowdown": pynvml.nvmlClocksEventReasonHwSlowdown,
    "sync_boost": pynvml.nvmlClocksEventReasonSyncBoost,
    "sw_thermal_slowdown": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
    "hw_thermal_slowdown": pynvml.nvmlClocksEventReasonHwThermalSlowdown,
    "hw_power_brake_slowdown": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
    "display_clock_setting": pynvml.nvmlClocksEventReasonDisplayClockSetting,
}
"""``reason`` label → bit of ``nvmlDeviceGetCurrentClocksEventReasons`` (NVML's names, snake
case). ``sw_power_cap``, ``hw_slowdown`` and the two thermal reasons are the ones that mean a
training job runs slower than the hardware could."""


class NvmlBackend(Protocol):
    """What the sampler reads from NVML. Every method raises only :class:`NvmlError` kinds."""

    def init(self) -> None:
        """``nvmlInit``; raises :class:`NvmlUnavailable` when NVML cannot be used."""
        ...

    def shutdown(self) -> None:
        """``nvmlShutdown``."""
        ...

    def driver_version(self) -> str:
        """``nvmlSystemGetDriverVersion``."""
        ...

    def device_count(self) -> int:
        """``nvmlDeviceGetCount``."""
        ...

    def handle(self, index: int) -> Any:
        """``nvmlDeviceGetHandleByIndex``: an opaque handle for the other calls."""
        ...

    def name(self, h: Any) -> str:
        """``nvmlDeviceGetName``, e.g. ``NVIDIA H100 80GB HBM3``."""
        ...

    def uuid(self, h: Any) -> str:
        """``nvmlDeviceGetUUID``, ``GPU-…`` (or ``MIG-…``)."""
        ...

    def pci(self, h: Any) -> tuple[str, int]:
        """``nvmlDeviceGetPciInfo``: (bus id ``00000000:3B:00.0``, ``pciDeviceId``)."""
        ...

    def memory(self, h: Any) -> tuple[int, int, int]:
        """``nvmlDeviceGetMemoryInfo``: (total, free, used) bytes."""
        ...

    def utilization(self, h: Any) -> tuple[int, int]:
        """``nvmlDeviceGetUtilizationRates``: (gpu %, memory %)."""
        ...

    def power_usage(self, h: Any) -> int:
        """``nvmlDeviceGetPowerUsage`` (mW)."""
        ...

    def power_limit(self, h: Any) -> int:
        """``nvmlDeviceGetEnforcedPowerLimit`` (mW)."""
        ...

    def energy(self, h: Any) -> int:
        """``nvmlDeviceGetTotalEnergyConsumption`` (mJ since the driver loaded)."""
        ...

    def temperature(self, h: Any) -> int:
        """``nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)`` (°C)."""
        ...

    def clock(self, h: Any, which: int) -> int:
        """``nvmlDeviceGetClockInfo`` (MHz)."""
        ...

    def max_clock(self, h: Any, which: int) -> int:
        """``nvmlDeviceGetMaxClockInfo`` (MHz)."""
        ...

    def clock_event_reasons(self, h: Any) -> int:
        """``nvmlDeviceGetCurrentClocksEventReasons`` (bit mask)."""
        ...

    def ecc_errors(self, h: Any, uncorrected: bool, aggregate: bool) -> int:
        """``nvmlDeviceGetTotalEccErrors`` (count)."""
        ...

    def remapped_rows(self, h: Any) -> tuple[int, int, int, int]:
        """``nvmlDeviceGetRemappedRows``: (correctable, uncorrectable, pending, failure)."""
        ...

    def field_values(self, h: Any, ids: Sequence[int]) -> list[float | NvmlError]:
        """``nvmlDeviceGetFieldValues`` (scope 0): one value or error per field id."""
        ...

    def processes(self, h: Any) -> list[tuple[int, int | None]]:
        """``nvmlDeviceGetComputeRunningProcesses``: (host pid, used bytes or None)."""
        ...

    def gpm_supported(self, h: Any) -> bool:
        """``nvmlGpmQueryDeviceSupport`` (Hopper and newer)."""
        ...

    def gpm_sample(self, h: Any) -> Any:
        """``nvmlGpmSampleAlloc`` + ``nvmlGpmSampleGet``."""
        ...

    def gpm_metrics(self, first: Any, second: Any, ids: Sequence[int]) -> dict[int, float]:
        """``nvmlGpmMetricsGet`` between two samples: metric id → value (percent)."""
        ...

    def gpm_free(self, sample: Any) -> None:
        """``nvmlGpmSampleFree``."""
        ...

    def xid_events(self, handles: Sequence[Any]) -> Any:
        """``nvmlEventSetCreate`` + ``nvmlDeviceRegisterEvents(XidCriticalError)``."""
        ...

    def poll_xid(self, events: Any) -> tuple[Any, int] | None:
        """``nvmlEventSetWait(…, 0 ms)``: (handle, XID) or None when no event is pending."""
        ...


class PynvmlBackend:
    """:class:`NvmlBackend` over nvidia-ml-py (ctypes calls into ``libnvidia-ml.so.1``)."""

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except pynvml.NVMLError as exc:
            raise translate(exc, fn.__name__) from None

    def init(self) -> None:  # noqa: D102
        self._call(pynvml.nvmlInit)

    def shutdown(self) -> None:  # noqa: D102
        self._call(pynvml.nvmlShutdown)

    def driver_version(self) -> str:  # noqa: D102
        return _text(self._call(pynvml.nvmlSystemGetDriverVersion))

    def device_count(self) -> int:  # noqa: D102
        return int(self._call(pynvml.nvmlDeviceGetCount))

    def handle(self, index: int) -> Any:  # noqa: D102
        return self._call(pynvml.nvmlDeviceGetHandleByIndex, index)

    def name(self, h: Any) -> str:  # noqa: D102
        return _text(self._call(pynvml.nvmlDeviceGetName, h))

    def uuid(self, h: Any) -> str:  # noqa: D102
        return _text(self._call(pynvml.nvmlDeviceGetUUID, h))

    def pci(self, h: Any) -> tuple[str, int]:  # noqa: D102
        info = self._call(pynvml.nvmlDeviceGetPciInfo, h)
        return _text(info.busId), int(info.pciDeviceId)

    def memory(self, h: Any) -> tuple[int, int, int]:  # noqa: D102
        m = self._call(pynvml.nvmlDeviceGetMemoryInfo, h)
        return int(m.total), int(m.free), int(m.used)

    def utilization(self, h: Any) -> tuple[int, int]:  # noqa: D102
        u = self._call(pynvml.nvmlDeviceGetUtilizationRates, h)
        return int(u.gpu), int(u.memory)

    def power_usage(self, h: Any) -> int:  # noqa: D102
        return int(self._call(pynvml.nvmlDeviceGetPowerUsage, h))

    def power_limit(self, h: Any) -> int:  # noqa: D102
        return int(self._call(pynvml.nvmlDeviceGetEnforcedPowerLimit, h))

    def energy(self, h: Any) -> int:  # noqa: D102
        return int(self._call(pynvml.nvmlDeviceGetTotalEnergyConsumption, h))

    def temperature(self, h: Any) -> int:  # noqa: D102
        return int(self._call(pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU))

    def clock(self, h: Any, which: int) -> int:  # noqa: D102
        return int(self._call(pynvml.nvmlDeviceGetClockInfo, h, which))

    def max_clock(self, h: Any, which: int) -> int:  # noqa: D102
        return int(self._call(pynvml.nvmlDeviceGetMaxClockInfo, h, which))

    def clock_event_reasons(self, h: Any) -> int:  # noqa: D102
        return int(self._call(pynvml.nvmlDeviceGetCurrentClocksEventReasons, h))

    def ecc_errors(self, h: Any, uncorrected: bool, aggregate: bool) -> int:  # noqa: D102
        kind = (
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
            if uncorrected
            else pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
        )
        counter = pynvml.NVML_AGGREGATE_ECC if aggregate else pynvml.NVML_VOLATILE_ECC
        return int(self._call(pynvml.nvmlDeviceGetTotalEccErrors, h, kind, counter))

    def remapped_rows(self, h: Any) -> tuple[int, int, int, int]:  # noqa: D102
        c, u, p, f = self._call(pynvml.nvmlDeviceGetRemappedRows, h)
        return int(c), int(u), int(p), int(f)

    def field_values(self, h: Any, ids: Sequence[int]) -> list[float | NvmlError]:  # noqa: D102
        raw = self._call(pynvml.nvmlDeviceGetFieldValues, h, [(i, 0) for i in ids])
        out: list[float | NvmlError] = []
        for v in raw:
            if v.nvmlReturn != pynvml.NVML_SUCCESS:
                out.append(translate(pynvml.NVMLError(v.nvmlReturn), f"field {v.fieldId}"))
            else:
                out.append(_field_value(v))
        return out

    def processes(self, h: Any) -> list[tuple[int, int | None]]:  # noqa: D102
        procs = self._call(pynvml.nvmlDeviceGetComputeRunningProcesses, h)
        return [
            (int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory)) for p in procs
        ]

    def gpm_supported(self, h: Any) -> bool:  # noqa: D102
        return bool(self._call(pynvml.nvmlGpmQueryDeviceSupport, h).isSupportedDevice)

    def gpm_sample(self, h: Any) -> Any:  # noqa: D102
        sample = self._call(pynvml.nvmlGpmSampleAlloc)
        try:
            return self._call(pynvml.nvmlGpmSampleGet, h, sample)
        except NvmlError:
            self.gpm_free(sample)
            raise

    def gpm_metrics(self, first: Any, second: Any, ids: Sequence[int]) -> dict[int, float]:  # noqa: D102
        req = pynvml.c_nvmlGpmMetricsGet_t()
        req.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        req.numMetrics = len(ids)
        req.sample1 = first
        req.sample2 = second
        for i, metric in enumerate(ids):
            req.metrics[i].metricId = metric
        self._call(pynvml.nvmlGpmMetricsGet, req)
        return {
            int(req.metrics[i].metricId): float(req.metrics[i].value)
            for i in range(len(ids))
            if req.metrics[i].nvmlReturn == pynvml.NVML_SUCCESS
        }

    def gpm_free(self, sample: Any) -> None:  # noqa: D102
        try:
            pynvml.nvmlGpmSampleFree(sample)
        except pynvml.NVMLError:
            pass

    def xid_events(self, handles: Sequence[Any]) -> Any:  # noqa: D102
        events = self._call(pynvml.nvmlEventSetCreate)
        registered = 0
        for h in handles:
            try:
                self._call(
                    pynvml.nvmlDeviceRegisterEvents, h, pynvml.nvmlEventTypeXidCriticalError, events
                )
                registered += 1
            except NotSupported:
                continue
        if not registered:
            raise NotSupported("no device supports XID critical-error events")
        return events

    def poll_xid(self, events: Any) -> tuple[Any, int] | None:  # noqa: D102
        try:
            data = pynvml.nvmlEventSetWait(events, 0)
        except pynvml.NVMLError as exc:
            if getattr(exc, "value", None) == pynvml.NVML_ERROR_TIMEOUT:
                return None
            raise translate(exc, "nvmlEventSetWait") from None
        return data.device, int(data.eventData)


def _text(v: str | bytes) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else v


_VALUE_MEMBER = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}
"""``nvmlValueType_t`` → the member of the ``nvmlValue_t`` union that holds the value."""


def _field_value(v: Any) -> float:
    return float(getattr(v.value, _VALUE_MEMBER.get(int(v.valueType), "ullVal")))


# --------------------------------------------------------------------------- samples


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU at one sampling pass. Readings the device does not support are absent.

    ``values`` maps a metric name (``trainmon_gpu_*``, see docs/metrics.md) to its value in the
    metric's base unit; the labelled families have their own fields.
    """

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    pci_device_id: int
    values: dict[str, float]
    clock_events: dict[str, float]
    ecc: dict[tuple[str, str], float]
    remapped_rows: dict[str, float]
    xid: dict[int, int]
    processes: tuple[tuple[int, int | None], ...]


@dataclass(frozen=True, slots=True)
class GpuSnapshot:
    """The sampler's latest pass, replaced whole (readers never see a half-written one).

    ``error`` is set (with ``hint``) when NVML is unusable; ``gpus`` is then empty.
    """

    ok: bool
    error: str = ""
    hint: str = ""
    driver_version: str = ""
    gpus: tuple[GpuSample, ...] = ()
    lost_total: int = 0
    read_errors: dict[str, int] = field(default_factory=dict)
    sample_seconds: float = 0.0
    samples_total: int = 0
    taken_at: float = 0.0

    def by_uuid(self) -> dict[str, GpuSample]:
        """GPUs keyed by UUID (the rank ↔ GPU join key)."""
        return {g.uuid: g for g in self.gpus}

    def process_memory(self) -> dict[int, float]:
        """GPU memory (bytes) per host PID, summed over GPUs, from each GPU's process list."""
        pids: dict[int, float] = {}
        for g in self.gpus:
            for pid, used in g.processes:
                if used is not None:
                    pids[pid] = pids.get(pid, 0.0) + used
        return pids


NOT_STARTED = GpuSnapshot(ok=False, error="GPU sampling has not run yet")


@dataclass(slots=True)
class _Gpu:
    index: int
    handle: Any
    uuid: str
    name: str
    pci_bus_id: str
    pci_device_id: int
    static: dict[str, float]
    gpm: bool
    gpm_prev: Any = None
    xid: dict[int, int] = field(default_factory=dict)


class GpuSampler:
    """Samples every GPU each ``interval`` seconds on its own daemon thread.

    ``start()`` returns at once; NVML initialisation happens on the thread, retried every
    ``retry_seconds`` while NVML is unavailable (a driver loaded after the exporter started is
    picked up). :attr:`snapshot` is the latest :class:`GpuSnapshot`.

    Per pass and GPU it makes about 20 NVML calls (the sampling cost is in
    ``trainmon_gpu_sample_duration_seconds`` and docs/performance.md).
    """

    def __init__(
        self,
        backend: NvmlBackend,
        interval: float = 1.0,
        retry_seconds: float = 30.0,
        processes: bool = True,
    ) -> None:
        self.backend = backend
        self.interval = interval
        self.retry_seconds = retry_seconds
        self.sample_processes = processes
        self.snapshot: GpuSnapshot = NOT_STARTED
        self._gpus: list[_Gpu] = []
        self._events: Any = None
        self._driver = ""
        self._initialised = False
        self._lost_total = 0
        self._read_errors: dict[str, int] = {}
        self._missing_functions: set[str] = set()
        self._samples_total = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the sampling thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="trainmon-nvml", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread, free GPM samples and shut NVML down."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._release()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._initialised and not self.open():
                self._stop.wait(self.retry_seconds)
                continue
            try:
                self.sample_once()
            except NvmlUnavailable as exc:  # the driver went away under us: start over
                self._publish_failure(str(exc), exc.hint)
                self._release()
                self._gpus = []
                continue
            except Exception:  # the thread must outlive any surprise
                log.exception("GPU sampling pass failed")
            self._stop.wait(self.interval)

    def open(self) -> bool:
        """Initialise NVML and enumerate GPUs; on failure publish why. Returns success."""
        try:
            self.backend.init()
        except NvmlUnavailable as exc:
            self._publish_failure(str(exc), exc.hint)
            return False
        except NvmlError as exc:
            self._publish_failure(str(exc), "")
            return False
        self._initialised = True
        try:
            self._driver = self._read(self.backend.driver_version) or ""
            count = self.backend.device_count()
        except NvmlError as exc:
            self._publish_failure(str(exc), getattr(exc, "hint", ""))
            self._release()
            return False
        self._gpus = []
        for i in range(count):
            try:
                self._gpus.append(self._discover(i))
            except GpuLost as exc:
                self._lost(i, str(exc))
            except NvmlError as exc:
                log.error("GPU %d skipped: %s", i, exc)
                self._count_error(exc)
        try:
            self._events = self.backend.xid_events([g.handle for g in self._gpus])
        except NvmlError as exc:
            self._note_unsupported("XID events", exc)
            self._events = None
        log.info(
            "NVML driver %s: sampling %d GPU(s) every %.3g s",
            self._driver or "?",
            len(self._gpus),
            self.interval,
        )
        return True

    def _release(self) -> None:
        for g in self._gpus:
            if g.gpm_prev is not None:
                self.backend.gpm_free(g.gpm_prev)
                g.gpm_prev = None
        if self._initialised:
            self._initialised = False
            try:
                self.backend.shutdown()
            except NvmlError:
                pass

    def _discover(self, index: int) -> _Gpu:
        b = self.backend
        h = b.handle(index)
        bus, device_id = b.pci(h)
        static: dict[str, float] = {}
        for key, fn in (
            ("trainmon_gpu_sm_clock_max_hertz", lambda: b.max_clock(h, CLOCK_SM) * 1e6),
            ("trainmon_gpu_memory_clock_max_hertz", lambda: b.max_clock(h, CLOCK_MEM) * 1e6),
        ):
            v = self._read(fn)
            if v is not None:
                static[key] = v
        gpm = bool(self._read(lambda: b.gpm_supported(h)))
        return _Gpu(index, h, b.uuid(h), b.name(h), bus, device_id, static, gpm)

    # ------------------------------------------------------------------ sampling

    def sample_once(self) -> GpuSnapshot:
        """Read every live GPU once and publish the new snapshot (also returns it)."""
        t0 = time.perf_counter()
        self._drain_xid()
        samples = []
        for g in list(self._gpus):
            try:
                samples.append(self._sample(g))
            except GpuLost as exc:
                self._gpus.remove(g)
                if g.gpm_prev is not None:
                    self.backend.gpm_free(g.gpm_prev)
                    g.gpm_prev = None
                self._lost(g.index, str(exc), g.uuid)
            except NvmlUnavailable:
                raise
            except NvmlError as exc:  # one broken GPU never hides the others
                self._count_error(exc)
                log.warning("GPU %d (%s) not sampled: %s", g.index, g.uuid, exc)
        self._samples_total += 1
        snap = GpuSnapshot(
            ok=True,
            driver_version=self._driver,
            gpus=tuple(samples),
            lost_total=self._lost_total,
            read_errors=dict(self._read_errors),
            sample_seconds=time.perf_counter() - t0,
            samples_total=self._samples_total,
            taken_at=time.time(),
        )
        self.snapshot = snap
        return snap

    def _sample(self, g: _Gpu) -> GpuSample:
        b, h, r = self.backend, g.handle, self._read
        v: dict[str, float] = dict(g.static)

        def put(key: str, value: float | None) -> None:
            if value is not None:
                v[key] = value

        mem = r(lambda: b.memory(h))
        if mem is not None:
            v["trainmon_gpu_memory_size_bytes"] = float(mem[0])
            v["trainmon_gpu_memory_free_bytes"] = float(mem[1])
            v["trainmon_gpu_memory_used_bytes"] = float(mem[2])
        util = r(lambda: b.utilization(h))
        if util is not None:
            v["trainmon_gpu_utilization_ratio"] = util[0] / 100.0
            v["trainmon_gpu_memory_utilization_ratio"] = util[1] / 100.0
        put("trainmon_gpu_power_usage_watts", _scaled(r(lambda: b.power_usage(h)), 1e-3))
        put("trainmon_gpu_power_limit_watts", _scaled(r(lambda: b.power_limit(h)), 1e-3))
        put("trainmon_gpu_energy_consumption_joules", _scaled(r(lambda: b.energy(h)), 1e-3))
        put("trainmon_gpu_temperature_celsius", _scaled(r(lambda: b.temperature(h)), 1.0))
        put("trainmon_gpu_sm_clock_hertz", _scaled(r(lambda: b.clock(h, CLOCK_SM)), 1e6))
        put("trainmon_gpu_memory_clock_hertz", _scaled(r(lambda: b.clock(h, CLOCK_MEM)), 1e6))

        fields = r(
            lambda: b.field_values(
                h,
                (
                    FIELD_MEMORY_TEMP,
                    FIELD_PCIE_TX_BYTES,
                    FIELD_PCIE_RX_BYTES,
                    FIELD_NVLINK_TX_KIB,
                    FIELD_NVLINK_RX_KIB,
                ),
            )
        )
        if fields is not None:
            for key, scale, value in zip(
                (
                    "trainmon_gpu_memory_temperature_celsius",
                    "trainmon_gpu_pcie_transmit_bytes",
                    "trainmon_gpu_pcie_receive_bytes",
                    "trainmon_gpu_nvlink_transmit_bytes",
                    "trainmon_gpu_nvlink_receive_bytes",
                ),
                (1.0, 1.0, 1.0, 1024.0, 1024.0),
                fields,
                strict=True,
            ):
                if isinstance(value, GpuLost):
                    raise value
                if isinstance(value, NvmlError):
                    if not isinstance(value, NotSupported):
                        self._count_error(value)
                    continue
                v[key] = value * scale

        reasons = r(lambda: b.clock_event_reasons(h))
        clock_events = (
            {}
            if reasons is None
            else {name: 1.0 if reasons & bit else 0.0 for name, bit in CLOCK_EVENT_REASONS.items()}
        )
        ecc: dict[tuple[str, str], float] = {}
        for error_type, uncorrected in (("corrected", False), ("uncorrected", True)):
            for counter_type, aggregate in (("volatile", False), ("aggregate", True)):
                n = r(functools.partial(b.ecc_errors, h, uncorrected, aggregate))
                if n is None:
                    break  # ECC off or unsupported: the other counters say the same
                ecc[(error_type, counter_type)] = float(n)
        remapped: dict[str, float] = {}
        rows = r(lambda: b.remapped_rows(h))
        if rows is not None:
            remapped = {"correctable": float(rows[0]), "uncorrectable": float(rows[1])}
            v["trainmon_gpu_remapped_rows_pending"] = 1.0 if rows[2] else 0.0
            v["trainmon_gpu_remapped_rows_failed"] = 1.0 if rows[3] else 0.0

        procs: tuple[tuple[int, int | None], ...] = ()
        if self.sample_processes:
            listed = r(lambda: b.processes(h))
            if listed is not None:
                procs = tuple(listed)
                v["trainmon_gpu_processes"] = float(len(procs))

        if g.gpm:
            self._sample_gpm(g, v)
        return GpuSample(
            index=g.index,
            uuid=g.uuid,
            name=g.name,
            pci_bus_id=g.pci_bus_id,
            pci_device_id=g.pci_device_id,
            values=v,
            clock_events=clock_events,
            ecc=ecc,
            remapped_rows=remapped,
            xid=dict(g.xid),
            processes=procs,
        )

    def _sample_gpm(self, g: _Gpu, v: dict[str, float]) -> None:
        """GPM metrics are rates between two samples: the previous pass's and this one's."""
        b = self.backend
        current = self._read(lambda: b.gpm_sample(g.handle))
        if current is None:
            return
        prev, g.gpm_prev = g.gpm_prev, current
        if prev is None:
            return
        try:
            got = self._read(
                lambda: b.gpm_metrics(
                    prev,
                    current,
                    (GPM_SM_ACTIVE, GPM_SM_OCCUPANCY, GPM_TENSOR_ACTIVE, GPM_DRAM_ACTIVE),
                )
            )
        finally:
            b.gpm_free(prev)
        if not got:
            return
        for key, metric in (
            ("trainmon_gpu_sm_active_ratio", GPM_SM_ACTIVE),
            ("trainmon_gpu_sm_occupancy_ratio", GPM_SM_OCCUPANCY),
            ("trainmon_gpu_tensor_active_ratio", GPM_TENSOR_ACTIVE),
            ("trainmon_gpu_dram_active_ratio", GPM_DRAM_ACTIVE),
        ):
            if metric in got:
                v[key] = got[metric] / 100.0

    def _drain_xid(self, limit: int = 1024) -> None:
        """Count every pending XID event without waiting (``nvmlEventSetWait`` with 0 ms)."""
        if self._events is None:
            return
        by_handle = {id(g.handle): g for g in self._gpus}
        by_address = {_address(g.handle): g for g in self._gpus}
        for _ in range(limit):
            try:
                got = self.backend.poll_xid(self._events)
            except NvmlError as exc:
                self._count_error(exc)
                return
            if got is None:
                return
            handle, xid = got
            g = by_handle.get(id(handle)) or by_address.get(_address(handle))
            if g is None:
                continue
            g.xid[xid] = g.xid.get(xid, 0) + 1
            log.error("GPU %d (%s): XID %d", g.index, g.uuid, xid)

    def _read(self, fn: Callable[[], T]) -> T | None:
        """One NVML read under the error policy; GpuLost propagates to drop the GPU."""
        try:
            return fn()
        except (GpuLost, NvmlUnavailable):
            raise
        except NotSupported:
            return None
        except FunctionNotFound as exc:
            where = str(exc).split(":", 1)[0]
            if where not in self._missing_functions and len(self._missing_functions) < 256:
                self._missing_functions.add(where)
                log.warning("%s: not in this driver's NVML; that reading is omitted", where)
            return None
        except NvmlError as exc:
            self._count_error(exc)
            return None

    def _count_error(self, exc: NvmlError) -> None:
        kind = _error_kind(exc)
        self._read_errors[kind] = self._read_errors.get(kind, 0) + 1

    def _note_unsupported(self, what: str, exc: NvmlError) -> None:
        if isinstance(exc, (NotSupported, FunctionNotFound)):
            log.info("%s not available: %s", what, exc)
        else:
            self._count_error(exc)
            log.warning("%s failed: %s", what, exc)

    def _lost(self, index: int, message: str, uuid: str = "") -> None:
        self._lost_total += 1
        log.error("GPU %d %s is lost and no longer sampled: %s", index, uuid, message)

    def _publish_failure(self, error: str, hint: str) -> None:
        if error != self.snapshot.error:
            log.warning("GPU metrics unavailable: %s%s", error, f". HINT: {hint}" if hint else "")
        self.snapshot = GpuSnapshot(ok=False, error=error, hint=hint, taken_at=time.time())


def _scaled(value: int | None, k: float) -> float | None:
    return None if value is None else value * k


def _address(handle: Any) -> int | None:
    """The C pointer value behind a ctypes device handle (events return new wrappers)."""
    try:
        import ctypes

        return ctypes.cast(handle, ctypes.c_void_p).value
    except Exception:
        return None


def _error_kind(exc: NvmlError) -> str:
    """A bounded label for an NVML error: ``nvmlReturn_t`` names, lower case, or ``other``."""
    names = {
        pynvml.NVML_ERROR_UNINITIALIZED: "uninitialized",
        pynvml.NVML_ERROR_INVALID_ARGUMENT: "invalid_argument",
        pynvml.NVML_ERROR_NO_PERMISSION: "no_permission",
        pynvml.NVML_ERROR_NOT_FOUND: "not_found",
        pynvml.NVML_ERROR_TIMEOUT: "timeout",
        pynvml.NVML_ERROR_UNKNOWN: "unknown",
        pynvml.NVML_ERROR_NO_DATA: "no_data",
        pynvml.NVML_ERROR_MEMORY: "memory",
        pynvml.NVML_ERROR_IRQ_ISSUE: "irq_issue",
        pynvml.NVML_ERROR_RESET_REQUIRED: "reset_required",
        pynvml.NVML_ERROR_CORRUPTED_INFOROM: "corrupted_inforom",
        pynvml.NVML_ERROR_GPU_IS_LOST: "gpu_is_lost",
    }
    return names.get(exc.code, "other")
