"""A scripted :class:`~trainmon_exporter.nvml.NvmlBackend` for unit tests.

Each :class:`FakeGpu` holds plain readings; ``errors`` maps a backend method name to the
exception that method raises for that GPU (``NotSupported``, ``GpuLost``, or any exception, as
a buggy binding would); a field of ``fields`` set to an ``NvmlError`` is that field's error.
``lost = True`` makes every call on the GPU raise ``GpuLost``, as a GPU that fell off the bus
does; the backend's ``broken`` makes every device call raise it (a driver that went away).

The backend counts its calls by method name (``counts``) and keeps the field ids of each
``field_values`` call (``field_requests``), so tests can tell what a pass read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from trainmon_exporter import nvml


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    bus_id: str = "00000000:18:00.0"
    pci_device_id: int = 0x233010DE
    memory: tuple[int, int, int] = (85_899_345_920, 42_949_672_960, 42_949_672_960)
    utilization: tuple[int, int] = (97, 41)
    power_mw: int = 612_345
    power_limit_mw: int = 700_000
    energy_mj: int = 123_456_789
    temperature: int = 61
    clocks: dict[int, int] = field(
        default_factory=lambda: {nvml.CLOCK_SM: 1980, nvml.CLOCK_MEM: 2619}
    )
    max_clocks: dict[int, int] = field(
        default_factory=lambda: {nvml.CLOCK_SM: 1980, nvml.CLOCK_MEM: 2619}
    )
    clock_reasons: int = 0
    ecc: dict[tuple[bool, bool], int] = field(
        default_factory=lambda: {
            (False, False): 2,
            (False, True): 5,
            (True, False): 0,
            (True, True): 1,
        }
    )
    remapped: tuple[int, int, int, int] = (0, 1, 0, 0)
    fields: dict[int, float | nvml.NvmlError] = field(
        default_factory=lambda: {
            nvml.FIELD_MEMORY_TEMP: 70,
            nvml.FIELD_PCIE_TX_BYTES: 1000,
            nvml.FIELD_PCIE_RX_BYTES: 2000,
            nvml.FIELD_NVLINK_TX_KIB: 3,
            nvml.FIELD_NVLINK_RX_KIB: 4,
        }
    )
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    gpm: dict[int, float] | None = field(
        default_factory=lambda: {
            nvml.GPM_SM_ACTIVE: 88.0,
            nvml.GPM_SM_OCCUPANCY: 40.0,
            nvml.GPM_TENSOR_ACTIVE: 55.0,
            nvml.GPM_DRAM_ACTIVE: 30.0,
        }
    )
    xids: list[int] = field(default_factory=list)
    errors: dict[str, Exception] = field(default_factory=dict)
    lost: bool = False


class FakeNvmlBackend:
    """Implements :class:`trainmon_exporter.nvml.NvmlBackend` over :class:`FakeGpu` objects."""

    def __init__(self, gpus: Sequence[FakeGpu] = (), init_error: Exception | None = None):
        self.gpus = list(gpus)
        self.init_error = init_error
        self.broken: Exception | None = None
        self.driver = "550.54.15"
        self.calls = 0
        self.counts: Counter[str] = Counter()  # calls by method name
        self.field_requests: list[tuple[int, ...]] = []
        self.initialised = False
        self.gpm_live = 0  # GPM samples allocated and not freed

    def _gpu(self, h: Any, what: str) -> FakeGpu:
        self.calls += 1
        self.counts[what] += 1
        g: FakeGpu = h
        if self.broken is not None:
            raise self.broken
        if g.lost:
            raise nvml.GpuLost(f"{what}: GPU is lost", 15)
        if what in g.errors:
            raise g.errors[what]
        return g

    def init(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.initialised = True

    def shutdown(self) -> None:
        self.initialised = False

    def driver_version(self) -> str:
        return self.driver

    def device_count(self) -> int:
        return len(self.gpus)

    def handle(self, index: int) -> Any:
        return self._gpu(self.gpus[index], "handle")

    def name(self, h: Any) -> str:
        return self._gpu(h, "name").name

    def uuid(self, h: Any) -> str:
        return self._gpu(h, "uuid").uuid

    def pci(self, h: Any) -> tuple[str, int]:
        g = self._gpu(h, "pci")
        return g.bus_id, g.pci_device_id

    def memory(self, h: Any) -> tuple[int, int, int]:
        return self._gpu(h, "memory").memory

    def utilization(self, h: Any) -> tuple[int, int]:
        return self._gpu(h, "utilization").utilization

    def power_usage(self, h: Any) -> int:
        return self._gpu(h, "power_usage").power_mw

    def power_limit(self, h: Any) -> int:
        return self._gpu(h, "power_limit").power_limit_mw

    def energy(self, h: Any) -> int:
        return self._gpu(h, "energy").energy_mj

    def temperature(self, h: Any) -> int:
        return self._gpu(h, "temperature").temperature

    def clock(self, h: Any, which: int) -> int:
        return self._gpu(h, "clock").clocks[which]

    def max_clock(self, h: Any, which: int) -> int:
        return self._gpu(h, "max_clock").max_clocks[which]

    def clock_event_reasons(self, h: Any) -> int:
        return self._gpu(h, "clock_event_reasons").clock_reasons

    def ecc_errors(self, h: Any, uncorrected: bool, aggregate: bool) -> int:
        return self._gpu(h, "ecc_errors").ecc[(uncorrected, aggregate)]

    def remapped_rows(self, h: Any) -> tuple[int, int, int, int]:
        return self._gpu(h, "remapped_rows").remapped

    def field_values(self, h: Any, ids: Sequence[int]) -> list[float | nvml.NvmlError]:
        g = self._gpu(h, "field_values")
        self.field_requests.append(tuple(ids))
        return [g.fields[i] if i in g.fields else nvml.NotSupported(f"field {i}", 3) for i in ids]

    def processes(self, h: Any) -> list[tuple[int, int | None]]:
        return list(self._gpu(h, "processes").processes)

    def gpm_supported(self, h: Any) -> bool:
        return self._gpu(h, "gpm_supported").gpm is not None

    def gpm_sample(self, h: Any) -> Any:
        g = self._gpu(h, "gpm_sample")
        self.gpm_live += 1
        return ("gpm", g)

    def gpm_metrics(self, first: Any, second: Any, ids: Sequence[int]) -> dict[int, float]:
        g = second[1]
        assert g.gpm is not None
        return {i: g.gpm[i] for i in ids if i in g.gpm}

    def gpm_free(self, sample: Any) -> None:
        self.gpm_live -= 1

    def xid_events(self, handles: Sequence[Any]) -> Any:
        return list(handles)

    def poll_xid(self, events: Any) -> tuple[Any, int] | None:
        for g in events:
            if g.xids and not g.lost:
                return g, g.xids.pop(0)
        return None
