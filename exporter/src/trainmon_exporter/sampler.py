"""The GPU sampler: a daemon thread that reads every GPU through an NVML backend.

Why this module is one module of about 700 lines: :class:`GpuSampler` is one loop over every
GPU and reading, whose error policy (one failing reading never costs another) is applied in one
place per reading; the typed readings and the snapshot it publishes are its output types.

:class:`GpuSampler` reads every GPU each ``interval`` seconds into an immutable
:class:`GpuSnapshot`. Scrapes and the JSON API read the latest snapshot and never call NVML,
so a slow or hung driver call delays only the next sample, never ingest or ``/metrics``.

Each GPU's readings are a typed :class:`GpuReadings`: one field per reading, already in its
base unit (bytes, watts, joules, Celsius, hertz, 0-1 ratios), each conversion next to the
NVML call that produced the raw value. The sampler knows NVML, not the exposition: which
family carries a reading is :mod:`trainmon_exporter.collectors.gpu`'s business.

Two cadences. Most readings cost 1 to 6 µs a call and are taken every pass; the *slow
readings* (:data:`SLOW_READINGS`: the energy counter, 2.3 to 2.8 ms a call on an H200, and the
two PCIe byte counters, 135 µs each) are taken every ``slow_interval`` seconds, rounded to a
whole number of passes. Between their reads the snapshot carries their last values with the
time they were taken (``GpuReadings.slow_sampled_at``); they are cumulative counters, so a
slower cadence loses resolution, never a joule or a byte. Power (``nvmlDeviceGetPowerUsage``)
and the GPM activity ratios stay on the fast cadence: they are the evidence of whether a GPU
is busy or idle right now.

NVML itself (the backend, the typed errors, the driver-branch fallbacks) is
:mod:`trainmon_exporter.nvml`, the only module that imports ``pynvml``. No NVIDIA library or
driver (``NVML_ERROR_LIBRARY_NOT_FOUND``, ``NVML_ERROR_DRIVER_NOT_LOADED``) is a state of the
node, :data:`NO_DRIVER`, not a failure: the sampler reports it and keeps retrying quietly. It
is :data:`FAILED` only when GPUs are expected: ``require_gpus`` is set, NVML worked earlier in
this process, or NVML is installed but cannot be used (version mismatch, no permission, any
other initialisation error).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from trainmon_exporter.nvml import (
    ABSENT_CODES,
    CLOCK_EVENT_REASONS,
    CLOCK_MEM,
    CLOCK_SM,
    FIELD_MEMORY_TEMP,
    FIELD_NVLINK_RX_KIB,
    FIELD_NVLINK_TX_KIB,
    FIELD_PCIE_RX_BYTES,
    FIELD_PCIE_TX_BYTES,
    GPM_DRAM_ACTIVE,
    GPM_SM_ACTIVE,
    GPM_SM_OCCUPANCY,
    GPM_TENSOR_ACTIVE,
    NO_PERMISSION,
    FunctionNotFound,
    GpuLost,
    NotSupported,
    NvmlBackend,
    NvmlError,
    NvmlUnavailable,
    error_kind,
    translate,
)

log = logging.getLogger("trainmon_exporter.nvml")

T = TypeVar("T")

STARTING = "starting"
SAMPLING = "sampling"
NO_DRIVER = "no_driver"
FAILED = "failed"
STATES = (STARTING, SAMPLING, NO_DRIVER, FAILED)
"""The sampler's state (``GpuSnapshot.state``, ``/readyz`` ``gpus.state``): not opened yet;
sampling; no NVIDIA library or driver on this node and none expected (a state, not an
error); GPUs expected but NVML unusable (the failure ``TrainmonGpuMetricsUnavailable``
alerts on)."""

MAX_XID_CODES = 32
"""Distinct XID codes counted per GPU; later new codes are counted under ``xid="other"``
(NVIDIA's XID catalogue has about 150 codes; one GPU reporting more than 32 is broken)."""


SLOW_INTERVAL_SECONDS = 15.0
"""Default of ``slow_interval`` (the ``nvml_slow_interval_seconds`` setting)."""

SLOW_READINGS: tuple[str, ...] = ("energy", "pcie_transmit", "pcie_receive")
"""The readings taken every ``slow_interval`` rather than every pass: the costly calls of an
H200's pass (docs/gpu-validation.md), all cumulative counters."""

_FieldSpec = tuple[str, int, float]
"""One ``nvmlDeviceGetFieldValues`` field: (what, field id, scale to base unit)."""

_FAST_FIELDS: tuple[_FieldSpec, ...] = (
    ("memory_temperature", FIELD_MEMORY_TEMP, 1.0),  # °C
    ("nvlink_transmit", FIELD_NVLINK_TX_KIB, 1024.0),  # KiB -> bytes
    ("nvlink_receive", FIELD_NVLINK_RX_KIB, 1024.0),
)
_SLOW_FIELDS: tuple[_FieldSpec, ...] = (
    ("pcie_transmit", FIELD_PCIE_TX_BYTES, 1.0),  # bytes; 135 µs each on an H200
    ("pcie_receive", FIELD_PCIE_RX_BYTES, 1.0),
)
_ALL_FIELDS = _FAST_FIELDS + _SLOW_FIELDS
"""A pass asks for :data:`_FAST_FIELDS` in one ``nvmlDeviceGetFieldValues`` call, and for all
of them in that one call when the slow readings are due."""

_GPM_METRICS = (GPM_SM_ACTIVE, GPM_SM_OCCUPANCY, GPM_TENSOR_ACTIVE, GPM_DRAM_ACTIVE)
"""The GPM metrics read between two passes, in percent."""


@dataclass(frozen=True, slots=True)
class GpuReadings:
    """One GPU's readings at one pass, each in its base unit; None where not read.

    A reading is None when the device or driver does not support it, or its NVML call failed
    (counted in the snapshot's ``read_errors``). Never NaN, never a sentinel.
    """

    utilization_ratio: float | None = None
    """Share of the driver's sample period in which a kernel ran (``utilization.gpu`` / 100)."""
    memory_utilization_ratio: float | None = None
    """Share of it in which device memory was read or written (``utilization.memory`` / 100)."""
    memory_used_bytes: float | None = None
    """``nvmlDeviceGetMemoryInfo().used``: all processes and the driver."""
    memory_free_bytes: float | None = None
    """``nvmlDeviceGetMemoryInfo().free``."""
    memory_total_bytes: float | None = None
    """``nvmlDeviceGetMemoryInfo().total``."""
    power_usage_watts: float | None = None
    """``nvmlDeviceGetPowerUsage``, mW / 1000."""
    power_limit_watts: float | None = None
    """``nvmlDeviceGetEnforcedPowerLimit``, mW / 1000."""
    energy_joules: float | None = None
    """``nvmlDeviceGetTotalEnergyConsumption`` since the driver loaded, mJ / 1000. A slow
    reading: as of ``slow_sampled_at``."""
    temperature_celsius: float | None = None
    """GPU die temperature (``NVML_TEMPERATURE_GPU``)."""
    memory_temperature_celsius: float | None = None
    """HBM temperature (field ``NVML_FI_DEV_MEMORY_TEMP``)."""
    sm_clock_hertz: float | None = None
    """``nvmlDeviceGetClockInfo(NVML_CLOCK_SM)``, MHz x 1e6."""
    memory_clock_hertz: float | None = None
    """``nvmlDeviceGetClockInfo(NVML_CLOCK_MEM)``, MHz x 1e6."""
    sm_clock_max_hertz: float | None = None
    """``nvmlDeviceGetMaxClockInfo(NVML_CLOCK_SM)``, MHz x 1e6 (read once per GPU)."""
    memory_clock_max_hertz: float | None = None
    """``nvmlDeviceGetMaxClockInfo(NVML_CLOCK_MEM)``, MHz x 1e6 (read once per GPU)."""
    pcie_transmit_bytes: float | None = None
    """Bytes sent over PCIe, cumulative (field ``NVML_FI_DEV_PCIE_COUNT_TX_BYTES``). A slow
    reading: as of ``slow_sampled_at``."""
    pcie_receive_bytes: float | None = None
    """Bytes received over PCIe, cumulative (``NVML_FI_DEV_PCIE_COUNT_RX_BYTES``). A slow
    reading: as of ``slow_sampled_at``."""
    nvlink_transmit_bytes: float | None = None
    """Data bytes sent over NVLink, all links, cumulative (``..._DATA_TX``, KiB x 1024)."""
    nvlink_receive_bytes: float | None = None
    """Data bytes received over NVLink, all links, cumulative (``..._DATA_RX``, KiB x 1024)."""
    remapped_rows_pending: bool | None = None
    """A row remapping waits for a GPU reset (``nvmlDeviceGetRemappedRows`` isPending)."""
    remapped_rows_failed: bool | None = None
    """A row remapping failed (``nvmlDeviceGetRemappedRows`` failureOccurred)."""
    processes: int | None = None
    """Compute processes on the GPU (None when process sampling is off)."""
    sm_active_ratio: float | None = None
    """GPM: share of SMs busy between two passes (``NVML_GPM_METRIC_SM_UTIL`` / 100)."""
    sm_occupancy_ratio: float | None = None
    """GPM: resident warps over the maximum (``NVML_GPM_METRIC_SM_OCCUPANCY`` / 100)."""
    tensor_active_ratio: float | None = None
    """GPM: share of time the tensor pipes were busy (``..._ANY_TENSOR_UTIL`` / 100)."""
    dram_active_ratio: float | None = None
    """GPM: DRAM bandwidth used over its peak (``NVML_GPM_METRIC_DRAM_BW_UTIL`` / 100)."""
    slow_sampled_at: float | None = None
    """Unix time (``time.time()``, s) the slow readings above were taken; None while none of
    them has a value (not supported, or their last read failed)."""


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU at one sampling pass.

    ``readings`` are the scalar readings; the labelled ones have their own fields:
    ``clock_events`` (reason -> 1.0 or 0.0, every reason of
    :data:`~trainmon_exporter.nvml.CLOCK_EVENT_REASONS`), ``ecc`` ((error type, counter type)
    -> count), ``remapped_rows`` (cause -> rows), ``xid`` (code -> events since the exporter
    started), ``xid_at`` (code -> when its last event was drained, Unix s) and ``processes``
    ((host PID, used GPU memory in bytes or None)). Identity fields NVML could not read are
    empty (``""``; ``pci_device_id`` 0): the GPU is still sampled.
    """

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    pci_device_id: int
    readings: GpuReadings
    clock_events: dict[str, float]
    ecc: dict[tuple[str, str], float]
    remapped_rows: dict[str, float]
    xid: dict[str, int]
    processes: tuple[tuple[int, int | None], ...]
    xid_at: dict[str, float] = field(default_factory=dict)


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
    lost_at: float | None = None
    """When a GPU this exporter had sampled was last found lost (Unix s); None: never. GPUs
    already lost when the exporter first enumerates them are in ``lost_total`` only."""
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


@dataclass(frozen=True, slots=True)
class _Slow:
    """One GPU's slow readings (:data:`SLOW_READINGS`) from their last read."""

    energy_joules: float | None = None
    pcie_transmit_bytes: float | None = None
    pcie_receive_bytes: float | None = None
    taken_at: float | None = None


@dataclass(slots=True)
class _Gpu:
    index: int
    handle: Any
    uuid: str
    name: str
    pci_bus_id: str
    pci_device_id: int
    sm_clock_max_hertz: float | None
    memory_clock_max_hertz: float | None
    gpm: bool
    gpm_prev: Any = None
    xid: dict[str, int] = field(default_factory=dict)
    xid_at: dict[str, float] = field(default_factory=dict)
    slow: _Slow = field(default_factory=_Slow)
    slow_due: int = 0  # the pass number at which the slow readings are next read


class GpuSampler:
    """Samples every GPU each ``interval`` seconds on its own daemon thread.

    ``start()`` returns at once; NVML initialisation happens on the thread, retried every
    ``retry_seconds`` while NVML is unavailable (a driver loaded after the exporter started is
    picked up). :attr:`snapshot` is the latest :class:`GpuSnapshot`. ``require`` (the
    ``require_gpus`` setting) makes GPUs expected from the start.

    Per pass and GPU it makes about 20 NVML calls (the sampling cost is in
    ``trainmon_gpu_sample_duration_seconds`` and docs/performance.md). The slow readings
    (:data:`SLOW_READINGS`) are read every ``slow_interval`` seconds instead: every
    :attr:`slow_every` passes (at least every pass), and on the first pass over a GPU, so none
    is missing from the start or after NVML is initialised again. Every exception from one
    reading is confined to that reading: the reading is omitted (and counted unless the
    device or driver lacks it), the rest of the GPU and the other GPUs are sampled. A slow
    reading that failed that way is omitted until it is read again, on the next pass.
    """

    def __init__(
        self,
        backend: NvmlBackend,
        interval: float = 1.0,
        retry_seconds: float = 30.0,
        processes: bool = True,
        require: bool = False,
        slow_interval: float = SLOW_INTERVAL_SECONDS,
    ) -> None:
        self.backend = backend
        self.interval = interval
        self.slow_every = max(1, round(slow_interval / interval))
        """Passes between two reads of the slow readings (``slow_interval / interval``)."""
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
        self._lost_at: float | None = None  # a GPU seen before fell off (GpuSnapshot.lost_at)
        self._read_errors: dict[str, int] = {}  # kind -> count, kinds that happened
        self._noted: set[str] = set()  # (reading, condition) already logged once
        self._samples_total = 0
        self._pass = 0  # passes since the sampler was made (schedules the slow readings)
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
        seen_before, self._worked = self._worked, True
        self._gpus = []
        for i in range(count):
            try:
                self._gpus.append(self._discover(i))
            except GpuLost as exc:
                self._lost(i, str(exc), seen=seen_before)
            except Exception as exc:  # no handle: nothing of this GPU can be read
                err = translate(exc, f"GPU {i}")
                log.error("GPU %d skipped: no NVML handle: %s", i, err)
                self._count_error(err)
        vanished = self._live_at_failure - count
        if vanished > 0:
            self._lost_total += vanished
            self._lost_at = time.time()
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
            "NVML driver %s: sampling %d GPU(s) every %.3g s, energy and PCIe counters every "
            "%d pass(es)",
            self._driver or "?",
            len(self._gpus),
            self.interval,
            self.slow_every,
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
        sm_max = self._read("max_clock", lambda: b.max_clock(h, CLOCK_SM) * 1e6)
        memory_max = self._read("max_clock", lambda: b.max_clock(h, CLOCK_MEM) * 1e6)
        gpm = bool(self._read("gpm_supported", lambda: b.gpm_supported(h)))
        g = _Gpu(index, h, "", "", "", 0, sm_max, memory_max, gpm)
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
        self._pass += 1
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
                self._lost(g.index, str(exc), g.uuid, seen=True)
            except NvmlUnavailable as exc:
                if exc.code != NO_PERMISSION:
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
            lost_at=self._lost_at,
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
        mem = r("memory", lambda: b.memory(h))
        util = r("utilization", lambda: b.utilization(h))
        power = _scaled(r("power", lambda: b.power_usage(h)), 1e-3)
        power_limit = _scaled(r("power_limit", lambda: b.power_limit(h)), 1e-3)
        temperature = _scaled(r("temperature", lambda: b.temperature(h)), 1.0)
        sm_clock = _scaled(r("clock", lambda: b.clock(h, CLOCK_SM)), 1e6)
        memory_clock = _scaled(r("clock", lambda: b.clock(h, CLOCK_MEM)), 1e6)
        slow_due = self._pass >= g.slow_due
        fields, failed = self._field_values(h, _ALL_FIELDS if slow_due else _FAST_FIELDS)
        if slow_due:
            self._read_slow(g, fields, failed)
        slow = g.slow

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

        procs: tuple[tuple[int, int | None], ...] = ()
        n_procs: int | None = None
        if self.sample_processes:
            listed = r("processes", lambda: b.processes(h))
            if listed is not None:
                procs = tuple(listed)
                n_procs = len(procs)

        sm_active, sm_occupancy, tensor_active, dram_active = (
            self._sample_gpm(g) if g.gpm else (None, None, None, None)
        )
        readings = GpuReadings(
            utilization_ratio=None if util is None else util[0] / 100.0,
            memory_utilization_ratio=None if util is None else util[1] / 100.0,
            memory_used_bytes=None if mem is None else float(mem[2]),
            memory_free_bytes=None if mem is None else float(mem[1]),
            memory_total_bytes=None if mem is None else float(mem[0]),
            power_usage_watts=power,
            power_limit_watts=power_limit,
            energy_joules=slow.energy_joules,
            temperature_celsius=temperature,
            memory_temperature_celsius=fields.get("memory_temperature"),
            sm_clock_hertz=sm_clock,
            memory_clock_hertz=memory_clock,
            sm_clock_max_hertz=g.sm_clock_max_hertz,
            memory_clock_max_hertz=g.memory_clock_max_hertz,
            pcie_transmit_bytes=slow.pcie_transmit_bytes,
            pcie_receive_bytes=slow.pcie_receive_bytes,
            nvlink_transmit_bytes=fields.get("nvlink_transmit"),
            nvlink_receive_bytes=fields.get("nvlink_receive"),
            remapped_rows_pending=None if rows is None else bool(rows[2]),
            remapped_rows_failed=None if rows is None else bool(rows[3]),
            processes=n_procs,
            sm_active_ratio=sm_active,
            sm_occupancy_ratio=sm_occupancy,
            tensor_active_ratio=tensor_active,
            dram_active_ratio=dram_active,
            slow_sampled_at=slow.taken_at,
        )
        return GpuSample(
            index=g.index,
            uuid=g.uuid,
            name=g.name,
            pci_bus_id=g.pci_bus_id,
            pci_device_id=g.pci_device_id,
            readings=readings,
            clock_events=clock_events,
            ecc=ecc,
            remapped_rows=remapped,
            xid=dict(g.xid),
            processes=procs,
            xid_at=dict(g.xid_at),
        )

    def _field_values(
        self, h: Any, fields: tuple[_FieldSpec, ...]
    ) -> tuple[dict[str, float], set[str]]:
        """``fields`` of one GPU, scaled: (what -> value, the whats whose read failed).

        One ``nvmlDeviceGetFieldValues`` call; each field fails or succeeds on its own. A
        field the device or driver lacks is in neither; a failed one (counted) is in the set.
        """
        ids = [fid for _, fid, _ in fields]
        got, answered = self._attempt("field_values", lambda: self.backend.field_values(h, ids))
        if got is None:
            return {}, (set() if answered else {what for what, _, _ in fields})
        out: dict[str, float] = {}
        failed: set[str] = set()
        for (what, _, scale), value in zip(fields, got, strict=False):
            if isinstance(value, GpuLost):
                raise value
            if isinstance(value, BaseException):
                if not isinstance(value, (NotSupported, FunctionNotFound)):
                    self._count_error(translate(value, what))
                    failed.add(what)
                continue
            try:
                out[what] = float(value) * scale
            except (TypeError, ValueError) as exc:
                self._count_error(translate(exc, what))
                failed.add(what)
        return out, failed

    def _read_slow(self, g: _Gpu, fields: dict[str, float], failed: set[str]) -> None:
        """Read the energy counter and keep it with the PCIe fields as ``g.slow``.

        Schedules the next read: in :attr:`slow_every` passes, or on the next pass when any
        slow reading failed (a reading the device lacks is not a failure).
        """
        mj, answered = self._attempt("energy", lambda: self.backend.energy(g.handle))
        energy = _scaled(mj, 1e-3)
        tx, rx = fields.get("pcie_transmit"), fields.get("pcie_receive")
        read = energy is not None or tx is not None or rx is not None
        g.slow = _Slow(energy, tx, rx, time.time() if read else None)
        retry = not answered or not failed.isdisjoint(SLOW_READINGS)
        g.slow_due = self._pass + (1 if retry else self.slow_every)

    def _sample_gpm(self, g: _Gpu) -> tuple[float | None, ...]:
        """The :data:`_GPM_METRICS` ratios of one GPU, in that order (None: not read).

        GPM metrics are rates between two samples: the previous pass's and this one's.
        """
        out: list[float | None] = [None] * len(_GPM_METRICS)
        b = self.backend
        current = self._read("gpm_sample", lambda: b.gpm_sample(g.handle))
        if current is None:
            return tuple(out)
        prev, g.gpm_prev = g.gpm_prev, current
        if prev is None:
            return tuple(out)
        try:
            got = self._read("gpm_metrics", lambda: b.gpm_metrics(prev, current, _GPM_METRICS))
        finally:
            b.gpm_free(prev)
        if got:
            for i, metric in enumerate(_GPM_METRICS):
                if metric in got:
                    out[i] = got[metric] / 100.0
        return tuple(out)

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
            g.xid_at[code] = time.time()
            log.error("GPU %d (%s): XID %d", g.index, g.uuid, xid)

    def _read(self, reading: str, fn: Callable[[], T]) -> T | None:
        """One NVML read under the error policy: None when it failed, whatever it raised.

        ``GpuLost`` propagates (the GPU is dropped), and so does :class:`NvmlUnavailable`
        except "no permission" (the driver went away: the sampler starts over).
        """
        return self._attempt(reading, fn)[0]

    def _attempt(self, reading: str, fn: Callable[[], T]) -> tuple[T | None, bool]:
        """:meth:`_read`, and whether NVML answered: False only for a failure it counted.

        "Not supported" and a missing function are answers (the reading does not exist here).
        """
        try:
            return fn(), True
        except Exception as exc:
            err = translate(exc, reading)
            if isinstance(err, GpuLost):
                raise err from None
            if isinstance(err, NvmlUnavailable):
                if err.code != NO_PERMISSION:
                    raise err from None
                self._note(f"{reading}:denied", f"{err}; that reading is omitted")
            elif isinstance(err, NotSupported):
                return None, True
            elif isinstance(err, FunctionNotFound):
                self._note(f"{reading}:missing", f"{err}; that reading is omitted", logging.INFO)
                return None, True
            elif not isinstance(exc, NvmlError):  # a bug in a backend or the bindings
                self._note(f"{reading}:exception", f"{reading} failed: {err}", exc_info=True)
            self._count_error(err)
            return None, False

    def _count_error(self, exc: NvmlError) -> None:
        kind = error_kind(exc)
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

    def _lost(self, index: int, message: str, uuid: str = "", *, seen: bool = False) -> None:
        """Count a lost GPU; ``seen``: one this exporter sampled before (its time is kept)."""
        self._lost_total += 1
        if seen:
            self._lost_at = time.time()
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
            lost_at=self._lost_at,
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
