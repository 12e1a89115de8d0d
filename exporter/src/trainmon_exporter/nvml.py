"""NVML: the only module that imports ``pynvml`` (distribution ``nvidia-ml-py``).

Three layers:

- :class:`NvmlBackend`, the typed interface the sampler needs (device count, handles and the
  reads below), with :class:`PynvmlBackend` as the real implementation. Tests substitute a
  fake backend, or drive ``PynvmlBackend`` against a fake ``libnvidia-ml.so.1``.
- The error policy: every exception a binding raises becomes one of the typed errors here.
  :class:`NvmlUnavailable` (no library, no driver, driver/library version mismatch, no
  permission to the device nodes) at initialisation stops GPU sampling with a one-line hint
  while training metrics keep flowing; :class:`NotSupported` omits that one reading;
  :class:`FunctionNotFound` (an older or newer driver without that entry point) makes
  :class:`PynvmlBackend` try the next version of the call, and omits the reading when none
  exists; :class:`GpuLost` drops that GPU's series and is counted. Anything else, Python
  exceptions from the bindings included, omits that one reading and is counted.
- :class:`GpuSampler`, a daemon thread that reads every GPU each ``interval`` seconds into an
  immutable :class:`GpuSnapshot`. Scrapes read the latest snapshot and never call NVML, so a
  slow or hung driver call delays only the next sample, never ingest or ``/metrics``.

No NVIDIA library or driver (``NVML_ERROR_LIBRARY_NOT_FOUND``, ``NVML_ERROR_DRIVER_NOT_LOADED``)
is a state of the node, :data:`NO_DRIVER`, not a failure: the sampler reports it and keeps
retrying quietly. It is :data:`FAILED` only when GPUs are expected: ``require_gpus`` is set,
NVML worked earlier in this process, or NVML is installed but cannot be used (version
mismatch, no permission, any other initialisation error).

Units: every value the sampler stores is already in the base unit of the metric that carries it
(bytes, watts, joules, Celsius, hertz, 0–1 ratios); each conversion sits next to the NVML call
that produced the raw value.
"""

from __future__ import annotations

import ctypes
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


ABSENT_CODES = frozenset({pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED})
"""Initialisation errors that mean "no NVIDIA driver on this node" rather than "broken"."""

MISSING_ENTRY_CODES = frozenset(
    {
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        getattr(pynvml, "NVML_ERROR_DEPRECATED", 26),
        getattr(pynvml, "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", 25),
    }
)
"""Return codes that say an entry point (or its struct version) is not usable with this
driver: the call's next version is tried (:class:`FunctionNotFound`)."""


_LIBRARY_MISMATCH: Any = getattr(pynvml, "NVMLLibraryMismatchError", ())


def translate(exc: BaseException, where: str = "") -> NvmlError:
    """Map any exception a pynvml call raised to the typed errors of this module.

    ``pynvml.NVMLError`` by its ``nvmlReturn_t`` code; ``pynvml.NVMLLibraryMismatchError``
    (raised *instead of* an ``NVMLError`` by nvidia-ml-py's unversioned wrappers when the
    library lacks the newest version, e.g. ``nvmlDeviceGetComputeRunningProcesses_v3`` on
    R470) as :class:`FunctionNotFound`; anything else as a plain :class:`NvmlError` with
    ``code`` -1 (a Python-level failure in the bindings, e.g. undecodable text).
    """
    if isinstance(exc, NvmlError):
        return exc
    if isinstance(exc, _LIBRARY_MISMATCH):
        return FunctionNotFound(
            f"{where}: not in this driver's NVML", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
        )
    if not isinstance(exc, pynvml.NVMLError):
        return NvmlError(f"{where}: {type(exc).__name__}: {exc}", -1)
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
    if code in MISSING_ENTRY_CODES:
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


class _ProcessInfoV1(ctypes.Structure):
    """``nvmlProcessInfo_v1_t`` of nvml.h: what the unversioned symbol fills.

    nvidia-ml-py wraps only the ``_v2``/``_v3`` struct (with MIG instance ids).
    """

    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


def _legacy_call(symbol: str, *args: Any) -> None:
    """Call an NVML entry point that nvidia-ml-py does not wrap, with its error handling.

    Uses nvidia-ml-py's own symbol lookup (``_nvmlGetFunctionPointer``, cached, raising
    ``NVMLError_FunctionNotFound`` for a missing symbol) and return check.
    """
    fn = pynvml._nvmlGetFunctionPointer(symbol)
    pynvml._nvmlCheckReturn(fn(*args))


def _binding(name: str) -> Callable[..., Any]:
    """nvidia-ml-py's wrapper ``name``, or one that reports the function missing.

    The stand-in is for an nvidia-ml-py older than the wrapper (``>=12.535`` is required;
    wrappers added since are optional).
    """
    fn: Callable[..., Any] | None = getattr(pynvml, name, None)
    if fn is not None:
        return fn

    def missing(*_: Any) -> Any:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    return missing


def _procs_modern(name: str) -> Callable[[Any], list[tuple[int, int | None]]]:
    fn = _binding(name)

    def read(h: Any) -> list[tuple[int, int | None]]:
        return [
            (int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory)) for p in fn(h)
        ]

    return read


def _procs_v1(h: Any) -> list[tuple[int, int | None]]:
    """``nvmlDeviceGetComputeRunningProcesses`` (v1 struct), sized like nvidia-ml-py does."""
    count = ctypes.c_uint(0)
    fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses")
    ret = fn(h, ctypes.byref(count), None)
    if ret == pynvml.NVML_SUCCESS:
        return []
    if ret != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
        raise pynvml.NVMLError(ret)
    count.value = count.value * 2 + 5  # room for processes started in between
    infos = (_ProcessInfoV1 * count.value)()
    pynvml._nvmlCheckReturn(fn(h, ctypes.byref(count), infos))
    na = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
    return [
        (int(p.pid), None if p.usedGpuMemory == na else int(p.usedGpuMemory))
        for p in infos[: count.value]
    ]


def _pci_v3(h: Any) -> tuple[str, int]:
    info = pynvml.nvmlDeviceGetPciInfo_v3(h)
    return _text(info.busId), int(info.pciDeviceId)


def _pci_legacy(symbol: str) -> Callable[[Any], tuple[str, int]]:
    """``nvmlDeviceGetPciInfo_v2`` / ``nvmlDeviceGetPciInfo``: the pre-``_v3`` layout.

    That layout has a 16-byte ``busId`` first, where ``_v3`` has ``busIdLegacy``. The buffer
    is the larger ``_v3`` struct; the bus id is rebuilt from domain/bus/device in ``_v3``'s
    format (``00000000:3B:00.0``), so the label is the same whichever version answered.
    """

    def read(h: Any) -> tuple[str, int]:
        info = pynvml.nvmlPciInfo_t()
        _legacy_call(symbol, h, ctypes.byref(info))
        bus_id = f"{info.domain:08X}:{info.bus:02X}:{info.device:02X}.0"
        return bus_id, int(info.pciDeviceId)

    return read


def _memory_v1(h: Any) -> tuple[int, int, int]:
    m = pynvml.nvmlDeviceGetMemoryInfo(h)
    return int(m.total), int(m.free), int(m.used)


def _memory_v2(h: Any) -> tuple[int, int, int]:
    """``nvmlDeviceGetMemoryInfo_v2``, with v1's meaning of ``used``.

    ``_v2`` splits the driver's reservation out of ``used``; total - free keeps v1's meaning
    (processes plus reservation), so the series means the same on every driver.
    """
    m = pynvml.nvmlDeviceGetMemoryInfo(h, version=getattr(pynvml, "nvmlMemory_v2", 0x02000028))
    return int(m.total), int(m.free), int(m.total) - int(m.free)


_TEMPERATURE_V = _binding("nvmlDeviceGetTemperatureV")
_GPM_QUERY = _binding("nvmlGpmQueryDeviceSupport")
_GPM_ALLOC = _binding("nvmlGpmSampleAlloc")
_GPM_GET = _binding("nvmlGpmSampleGet")
_GPM_METRICS = _binding("nvmlGpmMetricsGet")

Variants = tuple[tuple[str, Callable[..., Any]], ...]

VARIANTS: dict[str, Variants] = {
    # R470 and earlier lack _v3 (nvidia-ml-py's unversioned wrapper then raises
    # NVMLLibraryMismatchError); _v2 exists from R470 (CUDA 11.4), v1 on every driver.
    "processes": (
        (
            "nvmlDeviceGetComputeRunningProcesses_v3",
            _procs_modern("nvmlDeviceGetComputeRunningProcesses_v3"),
        ),
        (
            "nvmlDeviceGetComputeRunningProcesses_v2",
            _procs_modern("nvmlDeviceGetComputeRunningProcesses_v2"),
        ),
        ("nvmlDeviceGetComputeRunningProcesses", _procs_v1),
    ),
    # nvidia-ml-py's nvmlDeviceGetPciInfo calls _v3 only.
    "pci": (
        ("nvmlDeviceGetPciInfo_v3", _pci_v3),
        ("nvmlDeviceGetPciInfo_v2", _pci_legacy("nvmlDeviceGetPciInfo_v2")),
        ("nvmlDeviceGetPciInfo", _pci_legacy("nvmlDeviceGetPciInfo")),
    ),
    # "Clocks event reasons" from R535 (CUDA 12.2); "throttle reasons" (same bits) before,
    # deprecated since and announced to go with CUDA 14.
    "clock_event_reasons": (
        (
            "nvmlDeviceGetCurrentClocksEventReasons",
            _binding("nvmlDeviceGetCurrentClocksEventReasons"),
        ),
        (
            "nvmlDeviceGetCurrentClocksThrottleReasons",
            _binding("nvmlDeviceGetCurrentClocksThrottleReasons"),
        ),
    ),
    # nvmlDeviceGetTemperature is on every driver but deprecated; TemperatureV from R570.
    "temperature": (
        (
            "nvmlDeviceGetTemperature",
            lambda h: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
        ),
        (
            "nvmlDeviceGetTemperatureV",
            lambda h: _TEMPERATURE_V(h, pynvml.NVML_TEMPERATURE_GPU),
        ),
    ),
    # v1 on every driver; _v2 (R510+) only if a future driver drops v1.
    "memory": (
        ("nvmlDeviceGetMemoryInfo", _memory_v1),
        ("nvmlDeviceGetMemoryInfo_v2", _memory_v2),
    ),
}
"""Each reading with versioned entry points → its versions, preferred first (symbol name,
call). Which symbol each driver branch exports: tests/fakes/libnvml/fake_nvml.c."""


class PynvmlBackend:
    """:class:`NvmlBackend` over nvidia-ml-py (ctypes calls into ``libnvidia-ml.so.1``).

    Every call raises only :class:`NvmlError` kinds, whatever the bindings raise. A reading
    with several versions (:data:`VARIANTS`) uses the first one this driver has; a version
    found missing (:class:`FunctionNotFound`, or ``NVMLLibraryMismatchError``) is skipped
    from then on, for every GPU (the library is one per process), and a reading none of
    whose versions exists fails at once without asking the library again, so an old driver
    costs no extra call per pass.
    """

    def __init__(self) -> None:
        self._first: dict[str, int] = {}  # reading -> index of the first version not missing

    def _call(self, where: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except Exception as exc:  # every binding failure becomes a typed error
            raise translate(exc, where) from None

    def _versioned(self, reading: str, *args: Any) -> Any:
        variants = VARIANTS[reading]
        i = self._first.get(reading, 0)
        while i < len(variants):
            symbol, fn = variants[i]
            try:
                return fn(*args)
            except Exception as exc:
                err = translate(exc, symbol)
                if not isinstance(err, FunctionNotFound):
                    raise err from None
                i += 1
                self._first[reading] = i
                if i < len(variants):
                    log.info("%s is not in this driver's NVML: using %s", symbol, variants[i][0])
        raise FunctionNotFound(
            f"{variants[0][0]}: no version of it in this driver's NVML",
            pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        )

    def init(self) -> None:  # noqa: D102
        self._call("nvmlInit", pynvml.nvmlInit)

    def shutdown(self) -> None:  # noqa: D102
        self._call("nvmlShutdown", pynvml.nvmlShutdown)

    def driver_version(self) -> str:  # noqa: D102
        return _text(self._call("nvmlSystemGetDriverVersion", pynvml.nvmlSystemGetDriverVersion))

    def device_count(self) -> int:  # noqa: D102
        return int(self._call("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount))

    def handle(self, index: int) -> Any:  # noqa: D102
        return self._call("nvmlDeviceGetHandleByIndex", pynvml.nvmlDeviceGetHandleByIndex, index)

    def name(self, h: Any) -> str:  # noqa: D102
        return _text(self._call("nvmlDeviceGetName", pynvml.nvmlDeviceGetName, h))

    def uuid(self, h: Any) -> str:  # noqa: D102
        return _text(self._call("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, h))

    def pci(self, h: Any) -> tuple[str, int]:  # noqa: D102
        bus_id, device_id = self._versioned("pci", h)
        return str(bus_id), int(device_id)

    def memory(self, h: Any) -> tuple[int, int, int]:  # noqa: D102
        total, free, used = self._versioned("memory", h)
        return int(total), int(free), int(used)

    def utilization(self, h: Any) -> tuple[int, int]:  # noqa: D102
        u = self._call("nvmlDeviceGetUtilizationRates", pynvml.nvmlDeviceGetUtilizationRates, h)
        return int(u.gpu), int(u.memory)

    def power_usage(self, h: Any) -> int:  # noqa: D102
        return int(self._call("nvmlDeviceGetPowerUsage", pynvml.nvmlDeviceGetPowerUsage, h))

    def power_limit(self, h: Any) -> int:  # noqa: D102
        return int(
            self._call("nvmlDeviceGetEnforcedPowerLimit", pynvml.nvmlDeviceGetEnforcedPowerLimit, h)
        )

    def energy(self, h: Any) -> int:  # noqa: D102
        return int(
            self._call(
                "nvmlDeviceGetTotalEnergyConsumption",
                pynvml.nvmlDeviceGetTotalEnergyConsumption,
                h,
            )
        )

    def temperature(self, h: Any) -> int:  # noqa: D102
        return int(self._versioned("temperature", h))

    def clock(self, h: Any, which: int) -> int:  # noqa: D102
        return int(self._call("nvmlDeviceGetClockInfo", pynvml.nvmlDeviceGetClockInfo, h, which))

    def max_clock(self, h: Any, which: int) -> int:  # noqa: D102
        return int(
            self._call("nvmlDeviceGetMaxClockInfo", pynvml.nvmlDeviceGetMaxClockInfo, h, which)
        )

    def clock_event_reasons(self, h: Any) -> int:  # noqa: D102
        return int(self._versioned("clock_event_reasons", h))

    def ecc_errors(self, h: Any, uncorrected: bool, aggregate: bool) -> int:  # noqa: D102
        kind = (
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
            if uncorrected
            else pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
        )
        counter = pynvml.NVML_AGGREGATE_ECC if aggregate else pynvml.NVML_VOLATILE_ECC
        return int(
            self._call(
                "nvmlDeviceGetTotalEccErrors", pynvml.nvmlDeviceGetTotalEccErrors, h, kind, counter
            )
        )

    def remapped_rows(self, h: Any) -> tuple[int, int, int, int]:  # noqa: D102
        c, u, p, f = self._call("nvmlDeviceGetRemappedRows", pynvml.nvmlDeviceGetRemappedRows, h)
        return int(c), int(u), int(p), int(f)

    def field_values(self, h: Any, ids: Sequence[int]) -> list[float | NvmlError]:  # noqa: D102
        raw = self._call(
            "nvmlDeviceGetFieldValues",
            pynvml.nvmlDeviceGetFieldValues,
            h,
            [(i, 0) for i in ids],
        )
        out: list[float | NvmlError] = []
        for field_id, v in zip(ids, raw, strict=True):
            rc = int(v.nvmlReturn)
            if rc == pynvml.NVML_SUCCESS:
                out.append(_field_value(v))
            elif rc in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                # INVALID_ARGUMENT: a field id newer than this driver (the PCIe byte
                # counters, 197/198, are first in R555's nvml.h).
                out.append(NotSupported(f"field {field_id}: not on this driver/device", rc))
            else:
                out.append(translate(pynvml.NVMLError(rc), f"field {field_id}"))
        return out

    def processes(self, h: Any) -> list[tuple[int, int | None]]:  # noqa: D102
        return list(self._versioned("processes", h))

    def gpm_supported(self, h: Any) -> bool:  # noqa: D102
        got = self._call("nvmlGpmQueryDeviceSupport", _GPM_QUERY, h)
        return bool(got.isSupportedDevice)

    def gpm_sample(self, h: Any) -> Any:  # noqa: D102
        sample = self._call("nvmlGpmSampleAlloc", _GPM_ALLOC)
        try:
            return self._call("nvmlGpmSampleGet", _GPM_GET, h, sample)
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
        self._call("nvmlGpmMetricsGet", _GPM_METRICS, req)
        return {
            int(req.metrics[i].metricId): float(req.metrics[i].value)
            for i in range(len(ids))
            if req.metrics[i].nvmlReturn == pynvml.NVML_SUCCESS
        }

    def gpm_free(self, sample: Any) -> None:  # noqa: D102
        try:
            pynvml.nvmlGpmSampleFree(sample)
        except Exception:  # freeing never fails the pass
            pass

    def xid_events(self, handles: Sequence[Any]) -> Any:  # noqa: D102
        events = self._call("nvmlEventSetCreate", pynvml.nvmlEventSetCreate)
        registered = 0
        for h in handles:
            try:
                self._call(
                    "nvmlDeviceRegisterEvents",
                    pynvml.nvmlDeviceRegisterEvents,
                    h,
                    pynvml.nvmlEventTypeXidCriticalError,
                    events,
                )
                registered += 1
            except (NotSupported, FunctionNotFound):
                continue
        if not registered:
            raise NotSupported("no device supports XID critical-error events")
        return events

    def poll_xid(self, events: Any) -> tuple[Any, int] | None:  # noqa: D102
        try:
            data = pynvml.nvmlEventSetWait(events, 0)
        except Exception as exc:
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

STARTING = "starting"
SAMPLING = "sampling"
NO_DRIVER = "no_driver"
FAILED = "failed"
STATES = (STARTING, SAMPLING, NO_DRIVER, FAILED)
"""The sampler's state (``GpuSnapshot.state``, ``/readyz`` ``gpus.state``): not opened yet;
sampling; no NVIDIA library or driver on this node and none expected (a state, not an
error); GPUs expected but NVML unusable (the failure ``TrainmonGpuMetricsUnavailable``
alerts on)."""

ERROR_KINDS: tuple[str, ...] = (
    "uninitialized",
    "invalid_argument",
    "no_permission",
    "not_found",
    "insufficient_size",
    "insufficient_power",
    "timeout",
    "irq_issue",
    "corrupted_inforom",
    "reset_required",
    "operating_system",
    "memory",
    "no_data",
    "unknown",
    "other",
    "exception",
)
"""Every value of the ``error`` label of ``trainmon_gpu_read_errors_total`` (each exists at
0): the ``nvmlReturn_t`` names a read can fail with, lower case; ``other`` for any other
code; ``exception`` for a Python exception from the bindings rather than an NVML code.
"Not supported", a missing function and "GPU is lost" are not read errors (omitted, logged
once, and ``trainmon_gpu_lost_total`` respectively)."""

MAX_XID_CODES = 32
"""Distinct XID codes counted per GPU; later new codes are counted under ``xid="other"``
(NVIDIA's XID catalogue has about 150 codes; one GPU reporting more than 32 is broken)."""


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU at one sampling pass. Readings the device does not support are absent.

    ``values`` maps a metric name (``trainmon_gpu_*``, see docs/metrics.md) to its value in the
    metric's base unit; the labelled families have their own fields. Identity fields NVML
    could not read are empty (``""``; ``pci_device_id`` 0): the GPU is still sampled.
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
    xid: dict[str, int]
    processes: tuple[tuple[int, int | None], ...]


@dataclass(frozen=True, slots=True)
class GpuSnapshot:
    """The sampler's latest pass, replaced whole (readers never see a half-written one).

    ``ok`` is true while NVML is sampling (``state == SAMPLING``). Otherwise ``error`` (and
    ``hint``) say why and ``gpus`` is empty; ``state`` tells "no driver on this node"
    (:data:`NO_DRIVER`) from a failure (:data:`FAILED`). ``expected`` is true when this node
    should have GPU metrics (``require_gpus``, NVML worked earlier, or NVML is installed but
    failing).
    """

    ok: bool
    state: str = STARTING
    expected: bool = False
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
        """GPUs keyed by UUID (the rank ↔ GPU join key); GPUs without a UUID are left out."""
        return {g.uuid: g for g in self.gpus if g.uuid}

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
    xid: dict[str, int] = field(default_factory=dict)


class GpuSampler:
    """Samples every GPU each ``interval`` seconds on its own daemon thread.

    ``start()`` returns at once; NVML initialisation happens on the thread, retried every
    ``retry_seconds`` while NVML is unavailable (a driver loaded after the exporter started is
    picked up). :attr:`snapshot` is the latest :class:`GpuSnapshot`. ``require`` (the
    ``require_gpus`` setting) makes GPUs expected from the start.

    Per pass and GPU it makes about 20 NVML calls (the sampling cost is in
    ``trainmon_gpu_sample_duration_seconds`` and docs/performance.md). Every exception from
    one reading is confined to that reading: the reading is omitted (and counted unless the
    device or driver lacks it), the rest of the GPU and the other GPUs are sampled.
    """

    def __init__(
        self,
        backend: NvmlBackend,
        interval: float = 1.0,
        retry_seconds: float = 30.0,
        processes: bool = True,
        require: bool = False,
    ) -> None:
        self.backend = backend
        self.interval = interval
        self.retry_seconds = retry_seconds
        self.sample_processes = processes
        self.require = require
        self.snapshot: GpuSnapshot = GpuSnapshot(
            ok=False, expected=require, error=NOT_STARTED.error
        )
        self._gpus: list[_Gpu] = []
        self._events: Any = None
        self._driver = ""
        self._initialised = False
        self._worked = False  # NVML initialised at least once in this process
        self._live_at_failure = 0  # GPUs still sampled when NVML last failed under us
        self._lost_total = 0
        self._read_errors: dict[str, int] = {}  # kind -> count, kinds that happened
        self._noted: set[str] = set()  # (reading, condition) already logged once
        self._samples_total = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def expected(self) -> bool:
        """Whether GPUs are expected here: ``require``, or NVML worked in this process."""
        return self.require or self._worked

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
                self._live_at_failure = len(self._gpus)
                self._publish_failure(str(exc), exc.hint, exc.code)
                self._release()
                self._gpus = []
                continue
            except Exception:  # the thread must outlive any surprise
                self._note("pass", "GPU sampling pass failed", exc_info=True)
            self._stop.wait(self.interval)

    def open(self) -> bool:
        """Initialise NVML and enumerate GPUs; on failure publish why. Returns success.

        Never raises: whatever the backend raises becomes the published failure.
        """
        try:
            self.backend.init()
        except Exception as exc:
            err = translate(exc, "nvmlInit")
            self._publish_failure(str(err), getattr(err, "hint", ""), err.code)
            return False
        self._initialised = True
        try:
            self._driver = self._read("driver_version", self.backend.driver_version) or ""
            count = self.backend.device_count()
        except Exception as exc:
            err = translate(exc, "nvmlDeviceGetCount")
            self._publish_failure(str(err), getattr(err, "hint", ""), err.code)
            self._release()
            return False
        self._worked = True
        self._gpus = []
        for i in range(count):
            try:
                self._gpus.append(self._discover(i))
            except GpuLost as exc:
                self._lost(i, str(exc))
            except Exception as exc:  # no handle: nothing of this GPU can be read
                err = translate(exc, f"GPU {i}")
                log.error("GPU %d skipped: no NVML handle: %s", i, err)
                self._count_error(err)
        vanished = self._live_at_failure - count
        if vanished > 0:
            self._lost_total += vanished
            log.error(
                "%d GPU(s) sampled before NVML failed are gone after it was re-initialised",
                vanished,
            )
        self._live_at_failure = 0
        try:
            self._events = self.backend.xid_events([g.handle for g in self._gpus])
        except Exception as exc:
            self._note_unsupported("XID events", translate(exc, "XID events"))
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
            except Exception:
                pass

    def _discover(self, index: int) -> _Gpu:
        """A GPU's handle and identity.

        Only the handle is required: a failed identity read leaves that label empty (retried
        each pass); the GPU is never dropped for it.
        """
        b = self.backend
        try:
            h = b.handle(index)
        except Exception as exc:
            raise translate(exc, "nvmlDeviceGetHandleByIndex") from None
        static: dict[str, float] = {}
        for key, fn in (
            ("trainmon_gpu_sm_clock_max_hertz", lambda: b.max_clock(h, CLOCK_SM) * 1e6),
            ("trainmon_gpu_memory_clock_max_hertz", lambda: b.max_clock(h, CLOCK_MEM) * 1e6),
        ):
            v = self._read("max_clock", fn)
            if v is not None:
                static[key] = v
        gpm = bool(self._read("gpm_supported", lambda: b.gpm_supported(h)))
        g = _Gpu(index, h, "", "", "", 0, static, gpm)
        self._identify(g)
        return g

    def _identify(self, g: _Gpu) -> None:
        """Fill the identity fields still empty (UUID, name, PCI bus and device id)."""
        b, h = self.backend, g.handle
        if not g.uuid:
            g.uuid = self._read("uuid", lambda: b.uuid(h)) or ""
        if not g.name:
            g.name = self._read("name", lambda: b.name(h)) or ""
        if not g.pci_bus_id:
            pci = self._read("pci", lambda: b.pci(h))
            if pci is not None:
                g.pci_bus_id, g.pci_device_id = pci

    # ------------------------------------------------------------------ sampling

    def sample_once(self) -> GpuSnapshot:
        """Read every live GPU once and publish the new snapshot (also returns it).

        Raises :class:`NvmlUnavailable` only when the driver went away (every GPU at once);
        nothing else escapes.
        """
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
            except NvmlUnavailable as exc:
                if exc.code != pynvml.NVML_ERROR_NO_PERMISSION:
                    raise
                self._count_error(exc)
            except Exception as exc:  # one broken GPU never hides the others
                err = translate(exc, f"GPU {g.index}")
                self._count_error(err)
                self._note(f"gpu{g.index}", f"GPU {g.index} ({g.uuid}) not sampled: {err}")
        self._samples_total += 1
        snap = GpuSnapshot(
            ok=True,
            state=SAMPLING,
            expected=True,
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
        if not (g.uuid and g.name and g.pci_bus_id):
            self._identify(g)
        v: dict[str, float] = dict(g.static)

        def put(key: str, value: float | None) -> None:
            if value is not None:
                v[key] = value

        mem = r("memory", lambda: b.memory(h))
        if mem is not None:
            v["trainmon_gpu_memory_size_bytes"] = float(mem[0])
            v["trainmon_gpu_memory_free_bytes"] = float(mem[1])
            v["trainmon_gpu_memory_used_bytes"] = float(mem[2])
        util = r("utilization", lambda: b.utilization(h))
        if util is not None:
            v["trainmon_gpu_utilization_ratio"] = util[0] / 100.0
            v["trainmon_gpu_memory_utilization_ratio"] = util[1] / 100.0
        put("trainmon_gpu_power_usage_watts", _scaled(r("power", lambda: b.power_usage(h)), 1e-3))
        put(
            "trainmon_gpu_power_limit_watts",
            _scaled(r("power_limit", lambda: b.power_limit(h)), 1e-3),
        )
        put(
            "trainmon_gpu_energy_consumption_joules",
            _scaled(r("energy", lambda: b.energy(h)), 1e-3),
        )
        put(
            "trainmon_gpu_temperature_celsius",
            _scaled(r("temperature", lambda: b.temperature(h)), 1.0),
        )
        put("trainmon_gpu_sm_clock_hertz", _scaled(r("clock", lambda: b.clock(h, CLOCK_SM)), 1e6))
        put(
            "trainmon_gpu_memory_clock_hertz",
            _scaled(r("clock", lambda: b.clock(h, CLOCK_MEM)), 1e6),
        )

        fields = r(
            "field_values",
            lambda: b.field_values(
                h,
                (
                    FIELD_MEMORY_TEMP,
                    FIELD_PCIE_TX_BYTES,
                    FIELD_PCIE_RX_BYTES,
                    FIELD_NVLINK_TX_KIB,
                    FIELD_NVLINK_RX_KIB,
                ),
            ),
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
                strict=False,
            ):
                if isinstance(value, GpuLost):
                    raise value
                if isinstance(value, BaseException):
                    if not isinstance(value, (NotSupported, FunctionNotFound)):
                        self._count_error(translate(value, key))
                    continue
                try:
                    v[key] = float(value) * scale
                except (TypeError, ValueError) as exc:
                    self._count_error(translate(exc, key))

        reasons = r("clock_event_reasons", lambda: b.clock_event_reasons(h))
        clock_events = (
            {}
            if reasons is None
            else {name: 1.0 if reasons & bit else 0.0 for name, bit in CLOCK_EVENT_REASONS.items()}
        )
        ecc: dict[tuple[str, str], float] = {}
        for error_type, uncorrected in (("corrected", False), ("uncorrected", True)):
            for counter_type, aggregate in (("volatile", False), ("aggregate", True)):
                n = r("ecc_errors", functools.partial(b.ecc_errors, h, uncorrected, aggregate))
                if n is None:
                    break  # ECC off or unsupported: the other counters say the same
                ecc[(error_type, counter_type)] = float(n)
        remapped: dict[str, float] = {}
        rows = r("remapped_rows", lambda: b.remapped_rows(h))
        if rows is not None:
            remapped = {"correctable": float(rows[0]), "uncorrectable": float(rows[1])}
            v["trainmon_gpu_remapped_rows_pending"] = 1.0 if rows[2] else 0.0
            v["trainmon_gpu_remapped_rows_failed"] = 1.0 if rows[3] else 0.0

        procs: tuple[tuple[int, int | None], ...] = ()
        if self.sample_processes:
            listed = r("processes", lambda: b.processes(h))
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
        current = self._read("gpm_sample", lambda: b.gpm_sample(g.handle))
        if current is None:
            return
        prev, g.gpm_prev = g.gpm_prev, current
        if prev is None:
            return
        try:
            got = self._read(
                "gpm_metrics",
                lambda: b.gpm_metrics(
                    prev,
                    current,
                    (GPM_SM_ACTIVE, GPM_SM_OCCUPANCY, GPM_TENSOR_ACTIVE, GPM_DRAM_ACTIVE),
                ),
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
            except GpuLost:
                return  # the GPU is dropped by its own reads in this pass
            except Exception as exc:
                self._count_error(translate(exc, "nvmlEventSetWait"))
                return
            if got is None:
                return
            handle, xid = got
            g = by_handle.get(id(handle)) or by_address.get(_address(handle))
            if g is None:
                continue
            code = str(int(xid))
            if code not in g.xid and len(g.xid) >= MAX_XID_CODES:
                code = "other"
            g.xid[code] = g.xid.get(code, 0) + 1
            log.error("GPU %d (%s): XID %d", g.index, g.uuid, xid)

    def _read(self, reading: str, fn: Callable[[], T]) -> T | None:
        """One NVML read under the error policy: None when it failed, whatever it raised.

        ``GpuLost`` propagates (the GPU is dropped), and so does :class:`NvmlUnavailable`
        except "no permission" (the driver went away: the sampler starts over).
        """
        try:
            return fn()
        except Exception as exc:
            err = translate(exc, reading)
            if isinstance(err, GpuLost):
                raise err from None
            if isinstance(err, NvmlUnavailable):
                if err.code != pynvml.NVML_ERROR_NO_PERMISSION:
                    raise err from None
                self._note(f"{reading}:denied", f"{err}; that reading is omitted")
            elif isinstance(err, NotSupported):
                return None
            elif isinstance(err, FunctionNotFound):
                self._note(f"{reading}:missing", f"{err}; that reading is omitted", logging.INFO)
                return None
            elif not isinstance(exc, NvmlError):  # a bug in a backend or the bindings
                self._note(f"{reading}:exception", f"{reading} failed: {err}", exc_info=True)
            self._count_error(err)
            return None

    def _count_error(self, exc: NvmlError) -> None:
        kind = _error_kind(exc)
        self._read_errors[kind] = self._read_errors.get(kind, 0) + 1

    def _note(
        self, key: str, message: str, level: int = logging.WARNING, exc_info: bool = False
    ) -> None:
        """Log ``message`` once per ``key`` (at most 256 keys: a bounded set of readings)."""
        if key in self._noted or len(self._noted) >= 256:
            return
        self._noted.add(key)
        log.log(level, message, exc_info=exc_info)

    def _note_unsupported(self, what: str, exc: NvmlError) -> None:
        if isinstance(exc, (NotSupported, FunctionNotFound)):
            log.info("%s not available: %s", what, exc)
        else:
            self._count_error(exc)
            log.warning("%s failed: %s", what, exc)

    def _lost(self, index: int, message: str, uuid: str = "") -> None:
        self._lost_total += 1
        log.error("GPU %d %s is lost and no longer sampled: %s", index, uuid, message)

    def _publish_failure(self, error: str, hint: str, code: int = -1) -> None:
        """Publish "no GPU metrics", logged once per change.

        A state when no driver is here and none is expected (one INFO line), a failure
        otherwise (one WARNING line).
        """
        expected = self.expected or code not in ABSENT_CODES
        state = FAILED if expected else NO_DRIVER
        if (state, error) != (self.snapshot.state, self.snapshot.error):
            if state == NO_DRIVER:
                log.info(
                    "No NVIDIA driver on this node (%s): no GPU series, training metrics are "
                    "unaffected; retried every %.0f s%s",
                    error,
                    self.retry_seconds,
                    f". HINT (if this node has GPUs): {hint}" if hint else "",
                )
            else:
                log.warning(
                    "GPU metrics unavailable: %s%s", error, f". HINT: {hint}" if hint else ""
                )
        self.snapshot = GpuSnapshot(
            ok=False,
            state=state,
            expected=expected,
            error=error,
            hint=hint,
            lost_total=self._lost_total,
            read_errors=dict(self._read_errors),
            samples_total=self._samples_total,
            taken_at=time.time(),
        )


def _scaled(value: int | None, k: float) -> float | None:
    return None if value is None else value * k


def _address(handle: Any) -> int | None:
    """The C pointer value behind a ctypes device handle (events return new wrappers)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except Exception:
        return None


_KIND_BY_CODE: dict[int, str] = {
    pynvml.NVML_ERROR_UNINITIALIZED: "uninitialized",
    pynvml.NVML_ERROR_INVALID_ARGUMENT: "invalid_argument",
    pynvml.NVML_ERROR_NO_PERMISSION: "no_permission",
    pynvml.NVML_ERROR_NOT_FOUND: "not_found",
    pynvml.NVML_ERROR_INSUFFICIENT_SIZE: "insufficient_size",
    pynvml.NVML_ERROR_INSUFFICIENT_POWER: "insufficient_power",
    pynvml.NVML_ERROR_TIMEOUT: "timeout",
    pynvml.NVML_ERROR_IRQ_ISSUE: "irq_issue",
    pynvml.NVML_ERROR_CORRUPTED_INFOROM: "corrupted_inforom",
    pynvml.NVML_ERROR_RESET_REQUIRED: "reset_required",
    pynvml.NVML_ERROR_OPERATING_SYSTEM: "operating_system",
    pynvml.NVML_ERROR_MEMORY: "memory",
    pynvml.NVML_ERROR_NO_DATA: "no_data",
    pynvml.NVML_ERROR_UNKNOWN: "unknown",
}


def _error_kind(exc: NvmlError) -> str:
    """A bounded label (one of :data:`ERROR_KINDS`) for a failed read."""
    if exc.code == -1:
        return "exception"
    return _KIND_BY_CODE.get(exc.code, "other")
