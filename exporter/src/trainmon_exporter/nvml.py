"""NVML: the only module that imports ``pynvml`` (distribution ``nvidia-ml-py``).

Why this module is one module of about 700 lines: it is the only importer of pynvml, so the
whole boundary with the library lives here: the typed error policy, the ``NvmlBackend``
Protocol (each method naming its NVML call and unit), and ``PynvmlBackend`` with the versioned
entry points older drivers lack. About half of it is the Protocol and its one-to-one adapter.

Two layers; the sampler that uses them is :mod:`trainmon_exporter.sampler`.

- The error policy: every exception a binding raises becomes one of the typed errors here
  (:func:`translate`). :class:`NvmlUnavailable` (no library, no driver, driver/library
  version mismatch, no permission to the device nodes) at initialisation stops GPU sampling
  with a one-line hint (:data:`HINTS`) while training metrics keep flowing;
  :class:`NotSupported` omits that one reading; :class:`FunctionNotFound` (an older or newer
  driver without that entry point) makes :class:`PynvmlBackend` try the next version of the
  call, and omits the reading when none exists; :class:`GpuLost` drops that GPU's series and
  is counted. Anything else, Python exceptions from the bindings included, omits that one
  reading and is counted under a bounded kind (:data:`ERROR_KINDS`).
- :class:`NvmlBackend`, the typed interface the sampler needs (device count, handles and the
  reads below, each in NVML's raw unit), with :class:`PynvmlBackend` as the real
  implementation. Tests substitute a fake backend, or drive ``PynvmlBackend`` against a fake
  ``libnvidia-ml.so.1``.

The NVML vocabulary the rest of the exporter names lives here too, e.g. the clock-event
reasons (:data:`CLOCK_EVENT_REASONS`).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Sequence
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


NO_PERMISSION: int = pynvml.NVML_ERROR_NO_PERMISSION
"""The ``nvmlReturn_t`` of "no permission": unusable NVML at initialisation, one omitted
reading after it."""

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


def error_kind(exc: NvmlError) -> str:
    """A bounded label (one of :data:`ERROR_KINDS`) for a failed read."""
    if exc.code == -1:
        return "exception"
    return _KIND_BY_CODE.get(exc.code, "other")


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
case). Those that mean a problem are :data:`SLOWDOWN_REASONS`."""

SLOWDOWN_REASONS: tuple[str, ...] = (
    "hw_slowdown",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
)
"""The clock-event reasons that mean a GPU is slowed by a problem: a hardware slowdown, heat,
or the external power brake (in :data:`CLOCK_EVENT_REASONS` order). ``sw_power_cap`` is not
one: a GPU training flat out sits at its power limit by design, so it is normal at full load.
The one list: the alert ``TrainmonGpuThrottled`` matches exactly these reasons, the JSON API's
``slowdown_reasons`` (and the status views built on it) shows only these, and the GPU
dashboard names them (tests check the copies in YAML and in the dashboard generator)."""


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
        """``nvmlDeviceGetTotalEnergyConsumption`` (mJ since the driver loaded).

        The costliest call of a pass: 2.3 to 2.8 ms on an H200 with driver 580, where other
        calls take 1 to 6 µs (docs/gpu-validation.md), so the sampler reads it on its slow
        cadence. Reading it as field ``NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION`` costs the same.
        """
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
        """``nvmlDeviceGetFieldValues`` (scope 0): one value or error per field id.

        Its cost is the sum of its fields': on an H200 the PCIe byte counters take 135 µs
        each, the others under 10 µs.
        """
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
