"""Build and script the fake ``libnvidia-ml.so.1`` (``fake_nvml.c``; its header says how).

The library is compiled with gcc into a directory of the caller's choice. Two ways to use it:

- in this process: :func:`load` opens it by absolute path; its SONAME is
  ``libnvidia-ml.so.1``, so pynvml's later ``CDLL("libnvidia-ml.so.1")`` gets the same
  library without any search path;
- in a subprocess: put its directory first in ``LD_LIBRARY_PATH``.

Either way ``FAKE_NVML_CONFIG`` names the script written by :func:`write_config`.

Calls cost what the fake's C code costs (a few µs through ctypes) unless the script gives
them a per-call cost (``costs_us``; :data:`H200_COSTS_US` are a real driver's slowest calls).

:func:`build` with ``branch`` gives the library shaped like one NVIDIA driver branch: only the
symbols that branch's ``libnvidia-ml.so.1`` exports, among those trainmon calls
(:data:`BRANCH_SYMBOLS`; sources in ``fake_nvml.c``'s header).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

SOURCE = Path(__file__).with_name("fake_nvml.c")
CONFIG_ENV = "FAKE_NVML_CONFIG"


COMMON_SYMBOLS = frozenset(
    {
        "nvmlInitWithFlags",
        "nvmlShutdown",
        "nvmlErrorString",
        "nvmlSystemGetDriverVersion",
        "nvmlDeviceGetCount_v2",
        "nvmlDeviceGetHandleByIndex_v2",
        "nvmlDeviceGetName",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetPciInfo",
        "nvmlDeviceGetPciInfo_v2",
        "nvmlDeviceGetPciInfo_v3",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceGetTotalEnergyConsumption",
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetClockInfo",
        "nvmlDeviceGetMaxClockInfo",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetFieldValues",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlEventSetCreate",
        "nvmlEventSetFree",
        "nvmlDeviceRegisterEvents",
        "nvmlEventSetWait",
        "nvmlEventSetWait_v2",
    }
)
"""What trainmon (through nvidia-ml-py) may call that every supported branch (R470 on) has:
each is declared in nvml.h of CUDA 11.4, 12.2, 12.4 and 12.8 (go-nvml's copies)."""

R535_ADDS = frozenset(
    {
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlGpmQueryDeviceSupport",
        "nvmlGpmSampleAlloc",
        "nvmlGpmSampleGet",
        "nvmlGpmSampleFree",
        "nvmlGpmMetricsGet",
    }
)

BRANCH_SYMBOLS: dict[int, frozenset[str]] = {
    470: COMMON_SYMBOLS,
    535: COMMON_SYMBOLS | R535_ADDS,
    550: COMMON_SYMBOLS | R535_ADDS,
    570: COMMON_SYMBOLS | R535_ADDS | {"nvmlDeviceGetTemperatureV"},
}
"""Driver branch → the NVML symbols trainmon may call that its library exports (R470: CUDA
11.4's nvml.h, R535: 12.2, R550: 12.4, R570: 12.8). R550 differs from R535 only in field ids
(``NVML_FI_MAX`` 200), not in symbols trainmon calls."""


def build(out_dir: Path, *defines: str, branch: int | None = None) -> Path:
    """Compile the fake into ``out_dir/libnvidia-ml.so.1``.

    ``defines``: e.g. ``NO_GPM``; ``branch``: 470, 535, 550 or 570 (the default when None),
    the driver branch whose symbol set the library exports.
    """
    if branch is not None:
        if branch not in BRANCH_SYMBOLS:
            raise ValueError(f"unknown driver branch {branch}; known: {sorted(BRANCH_SYMBOLS)}")
        defines = (*defines, f"NVML_BRANCH={branch}")
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        if os.environ.get("CI_REQUIRE_TOOLS"):
            pytest.fail("gcc is required in CI to build the fake libnvidia-ml.so.1")
        pytest.skip("no C compiler for the fake libnvidia-ml.so.1")
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / "libnvidia-ml.so.1"
    cmd = [
        gcc,
        "-shared",
        "-fPIC",
        "-O2",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-std=c11",
        "-D_POSIX_C_SOURCE=200809L",
        "-Wl,-soname,libnvidia-ml.so.1",
        *(f"-D{d}" for d in defines),
        "-o",
        str(lib),
        str(SOURCE),
    ]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"building the fake NVML failed: {' '.join(cmd)}\n{out.stderr}")
    return lib


_loaded: Path | None = None


def load(lib: Path) -> None:
    """Make ``lib`` the ``libnvidia-ml.so.1`` of this process (once per process)."""
    global _loaded
    if _loaded is None:
        ctypes.CDLL(str(lib.resolve()))
        _loaded = lib
    elif _loaded != lib:
        raise RuntimeError(f"another fake NVML is already loaded: {_loaded}")


H200_COSTS_US: dict[str, int] = {
    "nvmlDeviceGetTotalEnergyConsumption": 2313,
    "field.197": 135,  # NVML_FI_DEV_PCIE_COUNT_TX_BYTES
    "field.198": 135,  # NVML_FI_DEV_PCIE_COUNT_RX_BYTES
}
"""The per-call costs (µs) of the NVML calls that dominated a sampling pass on an H200 with
driver 580.159.04 (docs/gpu-validation.md): the energy counter (median of 60 calls; 2,828 µs
on a second machine of the same kind) and the two PCIe byte-counter fields of
``nvmlDeviceGetFieldValues``. Every other call the sampler makes cost 1 to 6 µs there, about
what the fake costs through ctypes, so it gets no extra cost."""


def write_config(
    path: Path,
    gpus: list[Mapping[str, object]],
    costs_us: Mapping[str, int] | None = None,
    **top: object,
) -> None:
    """Write the script atomically (the library re-reads it when its mtime changes).

    ``costs_us``: per-call costs in µs, by exact NVML symbol (every call of it) or
    ``field.ID`` (added to ``nvmlDeviceGetFieldValues`` per requested field), e.g.
    :data:`H200_COSTS_US`.
    """
    lines = [f"count={len(gpus)}", *(f"{k}={v}" for k, v in top.items())]
    lines += [f"cost_us.{k}={int(v)}" for k, v in (costs_us or {}).items()]
    for i, g in enumerate(gpus):
        lines += [f"gpu.{i}.{k}={v}" for k, v in g.items()]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)


def h100(i: int, **extra: object) -> dict[str, object]:
    """A scripted H100 SXM with every reading set (values as NVML returns them)."""
    g: dict[str, object] = {
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": f"GPU-{i:08x}-aaaa-bbbb-cccc-dddddddddddd",
        "bus_id": f"00000000:{0x18 + i:02X}:00.0",
        "pci_device_id": "0x233010DE",
        "mem_total": 85_520_809_984,
        "mem_used": 40_000_000_000 + i,
        "util_gpu": 90 + i % 10,
        "util_mem": 40,
        "power_mw": 650_000,
        "power_limit_mw": 700_000,
        "energy_mj": 1_000_000 * (i + 1),
        "temp": 60 + i,
        "mem_temp": 70,
        "sm_clock": 1980,
        "mem_clock": 2619,
        "sm_clock_max": 1980,
        "mem_clock_max": 2619,
        "clock_reasons": 0,
        "ecc_corr_vol": 1,
        "ecc_corr_agg": 3,
        "ecc_unc_vol": 0,
        "ecc_unc_agg": 0,
        "remap_corr": 0,
        "remap_unc": 0,
        "pcie_tx": 123_456,
        "pcie_rx": 654_321,
        "nvlink_tx_kib": 1000,
        "nvlink_rx_kib": 2000,
        "gpm": 1,
        "sm_active": 80,
        "sm_occupancy": 35,
        "tensor_active": 45,
        "dram_active": 25,
    }
    for k, v in extra.items():  # None removes a reading (the device does not report it)
        if v is None:
            g.pop(k, None)
        else:
            g[k] = v
    return g
