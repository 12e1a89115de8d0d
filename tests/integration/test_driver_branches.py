"""The real nvidia-ml-py code and sampler against fake libraries shaped like each driver branch.

Each branch's ``libnvidia-ml.so.1`` is compiled from ``tests/fakes/libnvml/fake_nvml.c`` with
``-DNVML_BRANCH=…`` so it exports exactly the NVML symbols that branch has among those
trainmon calls (sources of the symbol sets: ``fake_nvml.c``'s header and
``tests.fakes.libnvml.BRANCH_SYMBOLS``). A process holds one libnvidia-ml.so.1, so each branch
runs in a subprocess (``python -m tests.fakes.libnvml.probe``): the real ``PynvmlBackend``,
sampler and GPU collectors, three passes, and the ``/metrics`` exposition back as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, child_env, parse_metrics, promtool_check_metrics, sample
from tests.fakes.libnvml import BRANCH_SYMBOLS, CONFIG_ENV, build, h100, write_config

BRANCHES = sorted(BRANCH_SYMBOLS)

EVERY_BRANCH = {
    "trainmon_gpu_info",
    "trainmon_gpu_utilization_ratio",
    "trainmon_gpu_memory_utilization_ratio",
    "trainmon_gpu_memory_used_bytes",
    "trainmon_gpu_memory_free_bytes",
    "trainmon_gpu_memory_size_bytes",
    "trainmon_gpu_power_usage_watts",
    "trainmon_gpu_power_limit_watts",
    "trainmon_gpu_energy_consumption_joules_total",
    "trainmon_gpu_slow_sample_timestamp_seconds",  # when the energy counter was read
    "trainmon_gpu_temperature_celsius",
    "trainmon_gpu_memory_temperature_celsius",
    "trainmon_gpu_sm_clock_hertz",
    "trainmon_gpu_memory_clock_hertz",
    "trainmon_gpu_sm_clock_max_hertz",
    "trainmon_gpu_memory_clock_max_hertz",
    "trainmon_gpu_clock_event_reason_active",  # ThrottleReasons on R470
    "trainmon_gpu_ecc_errors_total",
    "trainmon_gpu_remapped_rows_total",
    "trainmon_gpu_remapped_rows_pending",
    "trainmon_gpu_remapped_rows_failed",
    "trainmon_gpu_xid_errors_total",
    "trainmon_gpu_xid_errors_last_timestamp_seconds",  # the fake's XID, seen while sampling
    "trainmon_gpu_nvlink_transmit_bytes_total",
    "trainmon_gpu_nvlink_receive_bytes_total",
    "trainmon_gpu_processes",  # _v2 on R470
}
GPM = {
    "trainmon_gpu_sm_active_ratio",
    "trainmon_gpu_sm_occupancy_ratio",
    "trainmon_gpu_tensor_active_ratio",
    "trainmon_gpu_dram_active_ratio",
}
XID = {"trainmon_gpu_xid_errors_total", "trainmon_gpu_xid_errors_last_timestamp_seconds"}
PCIE = {"trainmon_gpu_pcie_transmit_bytes_total", "trainmon_gpu_pcie_receive_bytes_total"}
PER_GPU_BY_BRANCH = {
    470: EVERY_BRANCH,
    535: EVERY_BRANCH | GPM,
    550: EVERY_BRANCH | GPM,
    570: EVERY_BRANCH | GPM | PCIE,  # PCIe byte counter fields from R555 on
}


@pytest.fixture(scope="module")
def libraries(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("branches")
    return {b: build(root / str(b), branch=b) for b in BRANCHES}


def probe(lib: Path, cfg: Path, **env: str) -> dict[str, Any]:
    """Run tests/fakes/libnvml/probe.py against ``lib``; fail with its output if it fails."""
    out = subprocess.run(
        [sys.executable, "-m", "tests.fakes.libnvml.probe"],
        cwd=ROOT,
        env=child_env(LD_LIBRARY_PATH=str(lib.parent), **{CONFIG_ENV: str(cfg)}, **env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    got: dict[str, Any] = json.loads(out.stdout)
    got["log"] = out.stderr
    return got


def per_gpu_families(m: Mapping[Any, float], gpu: str) -> set[str]:
    return {k[0] for k in m if dict(k[1]).get("gpu") == gpu}


def assert_gpu0_read_the_same(m: Mapping[Any, float]) -> dict[str, str]:
    """GPU 0 (scripted with two processes and clock reason 0x40) has the same values
    whichever entry point answered; returns its ``trainmon_gpu_info`` labels."""
    u0 = str(h100(0)["uuid"])
    assert sample(m, "trainmon_gpu_processes", gpu="0", uuid=u0) == 2
    assert sample(m, "trainmon_gpu_memory_used_bytes", gpu="0", uuid=u0) == 40_000_000_000
    assert sample(m, "trainmon_gpu_temperature_celsius", gpu="0", uuid=u0) == 60
    reason = {"gpu": "0", "uuid": u0, "reason": "hw_thermal_slowdown"}
    assert sample(m, "trainmon_gpu_clock_event_reason_active", **reason) == 1
    info = next(dict(k[1]) for k in m if k[0] == "trainmon_gpu_info" and dict(k[1])["gpu"] == "0")
    assert info["pci_bus_id"] == "00000000:18:00.0" and info["pci_device_id"] == "0x233010de"
    return info


@pytest.mark.parametrize("branch", BRANCHES)
def test_each_branch_exports_the_symbols_of_its_nvml_h(
    branch: int, libraries: dict[int, Path], tmp_path: Path
) -> None:
    cfg = tmp_path / "gpus.conf"
    write_config(cfg, [h100(0)])
    got = probe(libraries[branch], cfg)
    assert set(got["exported"]) == BRANCH_SYMBOLS[branch]


@pytest.mark.parametrize("branch", BRANCHES)
def test_every_branch_is_sampled_with_the_series_its_driver_has(
    branch: int, libraries: dict[int, Path], tmp_path: Path
) -> None:
    """R470 lacks _v3 processes, clock *event* reasons and GPM; no pass may fail for it."""
    cfg = tmp_path / "gpus.conf"
    pid = os.getpid()
    write_config(
        cfg,
        [
            h100(0, procs=f"{pid}:{3 << 30},42:5", xid="79", clock_reasons=0x40),
            h100(1, mem_temp=None, **{"error.nvmlDeviceGetPowerUsage": 3}),
            h100(2, gpm=0),
        ],
        driver_version=f"{branch}.99.01",
    )
    got = probe(libraries[branch], cfg)
    assert got["opened"] and got["state"] == "sampling" and got["gpus"] == 3
    assert got["read_errors"] == {}, got["read_errors"]  # nothing missing counts as an error
    assert "GPU sampling pass failed" not in got["log"]
    text = got["exposition"]
    promtool_check_metrics(text)
    m = parse_metrics(text)
    assert sample(m, "trainmon_scrape_collector_success", collector="gpu") == 1
    assert sample(m, "trainmon_gpu_nvml_available") == 1
    assert sample(m, "trainmon_gpu_devices") == 3
    expected = PER_GPU_BY_BRANCH[branch]
    assert per_gpu_families(m, "0") == expected
    assert per_gpu_families(m, "1") == expected - {
        "trainmon_gpu_power_usage_watts",
        "trainmon_gpu_memory_temperature_celsius",
        *XID,
    }
    assert per_gpu_families(m, "2") == expected - GPM - XID
    info = assert_gpu0_read_the_same(m)
    assert info["driver_version"] == f"{branch}.99.01"


def test_older_entry_points_are_used_when_newer_ones_are_missing(tmp_path: Path) -> None:
    """On R570, the newest version of each versioned call answering "function not found":
    the sampler falls back (v1 processes, _v2 PCI info, throttle reasons, TemperatureV,
    memory _v2) and the values are the same."""
    lib = build(tmp_path / "lib")
    cfg = tmp_path / "gpus.conf"
    missing = {
        f"error.{fn}": 13
        for fn in (
            "nvmlDeviceGetComputeRunningProcesses_v3",
            "nvmlDeviceGetComputeRunningProcesses_v2",
            "nvmlDeviceGetPciInfo_v3",
            "nvmlDeviceGetCurrentClocksEventReasons",
            "nvmlDeviceGetTemperature",
            "nvmlDeviceGetMemoryInfo",
        )
    }
    write_config(cfg, [h100(0, procs=f"{os.getpid()}:1234,42:5", clock_reasons=0x40, **missing)])
    got = probe(lib, cfg)
    assert got["read_errors"] == {}, got["read_errors"]
    assert_gpu0_read_the_same(parse_metrics(got["exposition"]))
    for used in (
        "using nvmlDeviceGetComputeRunningProcesses\n",
        "using nvmlDeviceGetPciInfo_v2",
        "using nvmlDeviceGetCurrentClocksThrottleReasons",
        "using nvmlDeviceGetTemperatureV",
        "using nvmlDeviceGetMemoryInfo_v2",
    ):
        assert used in got["log"], got["log"]


def test_a_gpu_without_pci_info_is_sampled_with_empty_pci_labels(tmp_path: Path) -> None:
    """No version of nvmlDeviceGetPciInfo in the library, and one GPU whose every version
    fails: every GPU is still sampled; only the PCI labels are empty."""
    cfg = tmp_path / "gpus.conf"
    failing = {f"error.nvmlDeviceGetPciInfo{v}": 3 for v in ("", "_v2", "_v3")}
    write_config(cfg, [h100(0, **failing), h100(1)])
    for lib, empty in (
        (build(tmp_path / "nopci", "NO_PCI_INFO"), {"0", "1"}),
        (build(tmp_path / "r470", branch=470), {"0"}),
    ):
        got = probe(lib, cfg)
        assert got["gpus"] == 2 and got["read_errors"] == {}, got
        m = parse_metrics(got["exposition"])
        info = {dict(k[1])["gpu"]: dict(k[1]) for k in m if k[0] == "trainmon_gpu_info"}
        assert set(info) == {"0", "1"}
        assert {g for g, i in info.items() if i["pci_bus_id"] == ""} == empty
        assert all(i["uuid"] and i["name"] for i in info.values())
        assert len({dict(k[1])["gpu"] for k in m if k[0] == "trainmon_gpu_utilization_ratio"}) == 2
        promtool_check_metrics(got["exposition"])
