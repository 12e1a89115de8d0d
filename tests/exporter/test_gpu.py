"""GPU telemetry through a fake NVML backend: sampler, error policy, collector, join and MFU."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import (
    ROOT,
    InProcessExporter,
    connect,
    promtool_check_metrics,
    require_tool,
    sample,
    wait_for,
)
from tests.fakes.nvml_backend import FakeGpu, FakeNvmlBackend
from trainmon_client import init
from trainmon_exporter import nvml, peaks
from trainmon_exporter.sampler import FAILED, MAX_XID_CODES, NO_DRIVER, GpuSampler
from trainmon_exporter.views.api import gpu_snapshot


def uuid(i: int) -> str:
    return f"GPU-{i:08x}-1111-2222-3333-444444444444"


def eight_gpus() -> list[FakeGpu]:
    return [FakeGpu(uuid=uuid(i), bus_id=f"00000000:{0x18 + i:02X}:00.0") for i in range(8)]


def test_sampler_reads_every_field_in_base_units() -> None:
    g = FakeGpu(clock_reasons=nvml.CLOCK_EVENT_REASONS["hw_thermal_slowdown"], xids=[79])
    s = GpuSampler(FakeNvmlBackend([g]))
    assert s.open()
    s.sample_once()
    snap = s.sample_once()  # GPM needs two samples
    assert snap.ok and len(snap.gpus) == 1
    r = snap.gpus[0].readings
    assert r.utilization_ratio == pytest.approx(0.97)
    assert r.memory_used_bytes == 42_949_672_960
    assert r.power_usage_watts == pytest.approx(612.345)
    assert r.energy_joules == pytest.approx(123_456.789)
    assert r.sm_clock_hertz == 1980e6
    assert r.sm_clock_max_hertz == 1980e6
    assert r.memory_temperature_celsius == 70
    assert r.nvlink_transmit_bytes == 3 * 1024
    assert r.tensor_active_ratio == pytest.approx(0.55)
    assert r.remapped_rows_pending is False
    gs = snap.gpus[0]
    assert gs.clock_events["hw_thermal_slowdown"] == 1 and gs.clock_events["sw_power_cap"] == 0
    assert gs.ecc[("corrected", "aggregate")] == 5
    assert gs.remapped_rows == {"correctable": 0.0, "uncorrectable": 1.0}
    assert gs.xid == {"79": 1}


SLOW_FIELD_IDS = {nvml.FIELD_PCIE_TX_BYTES, nvml.FIELD_PCIE_RX_BYTES}


def test_slow_readings_are_read_every_n_passes_and_kept_with_their_time_between() -> None:
    """Energy and PCIe (an H200's costly calls) every slow_interval; power and GPM every pass."""
    g = FakeGpu()
    backend = FakeNvmlBackend([g])
    s = GpuSampler(backend, interval=1.0, slow_interval=3.0)
    assert s.slow_every == 3
    assert s.open()
    reads: list[tuple[float | None, ...]] = []
    for n in range(1, 10):
        g.power_mw = 100_000 * n
        g.energy_mj = 1_000_000 * n
        g.fields[nvml.FIELD_PCIE_TX_BYTES] = 10.0 * n
        before = time.time()
        r = s.sample_once().gpus[0].readings
        assert r.power_usage_watts == 100.0 * n  # every pass: the evidence of a busy GPU
        assert (r.sm_active_ratio is None) == (n == 1)  # GPM from the second pass on
        if n in (1, 4, 7):  # the first pass, then every third
            assert r.slow_sampled_at is not None and r.slow_sampled_at >= before
            assert r.energy_joules == 1000.0 * n and r.pcie_transmit_bytes == 10.0 * n
            assert set(backend.field_requests[-1]) >= SLOW_FIELD_IDS
        else:
            assert not set(backend.field_requests[-1]) & SLOW_FIELD_IDS
        reads.append((r.energy_joules, r.pcie_transmit_bytes, r.pcie_receive_bytes))
        if n % 3 != 1:  # between reads: the last values, with the time they were read
            assert reads[-1] == reads[-2]
            assert r.slow_sampled_at == s.snapshot.gpus[0].readings.slow_sampled_at
    assert backend.counts["energy"] == 3
    assert backend.counts["power_usage"] == backend.counts["gpm_sample"] == 9
    assert len(backend.field_requests) == 9  # one field-values call per pass, either way
    assert s.snapshot.read_errors == {}


@pytest.mark.parametrize(("interval", "slow", "every"), [(1.0, 0.5, 1), (0.1, 10.0, 100)])
def test_the_slow_cadence_is_whole_passes_and_never_faster_than_a_pass(
    interval: float, slow: float, every: int
) -> None:
    s = GpuSampler(FakeNvmlBackend([FakeGpu()]), interval=interval, slow_interval=slow)
    assert s.slow_every == every


def test_a_failed_slow_read_is_retried_on_the_next_pass_and_a_missing_one_is_not() -> None:
    """A slow reading that failed is omitted (and counted) only until the next pass."""
    failing = FakeGpu(uuid=uuid(0), errors={"energy": nvml.NvmlError("energy: Unknown", 999)})
    pcie = FakeGpu(uuid=uuid(1))
    pcie.fields[nvml.FIELD_PCIE_RX_BYTES] = nvml.NvmlError("field 198: Timeout", 10)
    unsupported = FakeGpu(uuid=uuid(2), errors={"energy": nvml.NotSupported("energy", 3)})
    none = FakeGpu(uuid=uuid(3), errors=unsupported.errors, fields={nvml.FIELD_MEMORY_TEMP: 70})
    backend = FakeNvmlBackend([failing, pcie, unsupported, none])
    s = GpuSampler(backend, interval=1.0, slow_interval=5.0)
    assert s.open()
    first = s.sample_once()
    assert first.read_errors == {"unknown": 1, "timeout": 1}
    r0, r1, r2, r3 = (g.readings for g in first.gpus)
    assert r0.energy_joules is None and r0.pcie_transmit_bytes == 1000  # omitted, not stale
    assert r1.energy_joules is not None and r1.pcie_receive_bytes is None
    assert r2.energy_joules is None and r2.slow_sampled_at is not None  # PCIe still read
    assert r3.slow_sampled_at is None  # no slow reading on this GPU: no time either
    failing.errors.clear()
    del pcie.fields[nvml.FIELD_PCIE_RX_BYTES]  # the field now answers "not supported"
    backend.counts.clear()
    second = s.sample_once()
    r0, r1, _, _ = (g.readings for g in second.gpus)
    assert r0.energy_joules == pytest.approx(123_456.789)  # read again at once
    assert r0.slow_sampled_at is not None and r0.slow_sampled_at >= first.taken_at
    assert r1.pcie_receive_bytes is None and r1.pcie_transmit_bytes == 1000
    assert backend.counts["energy"] == 2  # GPUs 0 and 1 again, never the one without it
    assert second.read_errors == first.read_errors  # nothing failed this time
    backend.counts.clear()
    for _ in range(3):
        s.sample_once()
    assert backend.counts["energy"] == 0  # back on the five-pass schedule


def test_slow_readings_are_there_as_soon_as_nvml_is_back() -> None:
    """After the driver went away and came back, the first pass reads them again."""
    g = FakeGpu()
    backend = FakeNvmlBackend([g])
    s = GpuSampler(backend, interval=0.05, retry_seconds=0.05, slow_interval=600.0)
    s.start()
    try:
        wait_for(lambda: s.snapshot.ok)
        assert s.snapshot.gpus[0].readings.energy_joules == pytest.approx(123_456.789)
        gone = nvml.NvmlUnavailable("nvmlDeviceGetMemoryInfo: Driver Not Loaded", 9, "")
        backend.broken = backend.init_error = gone
        wait_for(lambda: s.snapshot.state == FAILED)
        g.energy_mj = 999_000
        backend.broken = backend.init_error = None
        wait_for(lambda: s.snapshot.ok)
        r = s.snapshot.gpus[0].readings
        assert r.energy_joules == 999.0 and r.pcie_transmit_bytes == 1000
        assert r.slow_sampled_at is not None and r.slow_sampled_at > s.snapshot.taken_at - 5
    finally:
        s.stop()


def test_only_the_slowdown_reasons_count_as_a_slowdown() -> None:
    """At its power cap a GPU is at full load, not slowed: the API leaves sw_power_cap out."""
    bits = nvml.CLOCK_EVENT_REASONS
    g = FakeGpu(clock_reasons=bits["sw_power_cap"] | bits["hw_thermal_slowdown"])
    s = GpuSampler(FakeNvmlBackend([g, FakeGpu(clock_reasons=bits["sw_power_cap"])]))
    assert s.open()
    view = gpu_snapshot(s.sample_once())
    assert [v.slowdown_reasons for v in view.gpus] == [["hw_thermal_slowdown"], []]
    assert s.snapshot.gpus[1].clock_events["sw_power_cap"] == 1.0  # still exported


def test_not_supported_omits_only_that_reading() -> None:
    g = FakeGpu(
        errors={
            "temperature": nvml.NotSupported("t", 3),
            "ecc_errors": nvml.NotSupported("e", 3),
            "power_usage": nvml.FunctionNotFound("nvmlDeviceGetPowerUsage: x", 13),
        },
        fields={nvml.FIELD_PCIE_TX_BYTES: 5.0},
        gpm=None,
    )
    s = GpuSampler(FakeNvmlBackend([g]))
    s.open()
    snap = s.sample_once()
    r = snap.gpus[0].readings
    assert r.temperature_celsius is None
    assert r.power_usage_watts is None
    assert r.memory_temperature_celsius is None
    assert r.tensor_active_ratio is None
    assert r.pcie_transmit_bytes == 5.0
    assert r.utilization_ratio == pytest.approx(0.97)
    assert snap.gpus[0].ecc == {}
    assert snap.read_errors == {}  # not-supported and missing functions are not errors


def test_other_errors_are_counted_and_one_broken_gpu_hides_nothing() -> None:
    gpus = eight_gpus()
    gpus[2].errors["memory"] = nvml.NvmlError("memory: Unknown Error", 999)
    gpus[5].errors["utilization"] = nvml.NvmlError("utilization: Timeout", 10)
    s = GpuSampler(FakeNvmlBackend(gpus))
    s.open()
    snap = s.sample_once()
    assert len(snap.gpus) == 8
    assert snap.gpus[2].readings.memory_used_bytes is None
    assert snap.gpus[2].readings.utilization_ratio is not None
    assert snap.read_errors == {"unknown": 1, "timeout": 1}


def test_lost_gpu_is_dropped_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    gpus = eight_gpus()
    backend = FakeNvmlBackend(gpus)
    s = GpuSampler(backend)
    s.open()
    assert len(s.sample_once().gpus) == 8
    gpus[3].lost = True
    with caplog.at_level(logging.ERROR, "trainmon_exporter.nvml"):
        snap = s.sample_once()
    assert [g.index for g in snap.gpus] == [0, 1, 2, 4, 5, 6, 7]
    assert snap.lost_total == 1
    assert "GPU 3" in caplog.text and "lost" in caplog.text
    assert s.sample_once().lost_total == 1  # counted once, not per pass
    s.stop()
    assert backend.gpm_live == 0  # GPM samples are freed


def test_any_exception_from_one_reading_is_confined_to_it() -> None:
    """Python exceptions from the bindings (not NVMLError) omit one reading, never the pass."""
    import pynvml

    mismatch = pynvml.NVMLLibraryMismatchError("Unversioned function called ...")
    g = FakeGpu(
        processes=[(42, 1 << 30)],
        errors={
            "processes": mismatch,  # what nvidia-ml-py raises for _v3 on R470
            "temperature": UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
            "power_usage": RuntimeError("ctypes surprise"),
            "memory": nvml.NvmlUnavailable("memory: Insufficient Permissions", 4, ""),
        },
    )
    s = GpuSampler(FakeNvmlBackend([g, FakeGpu(uuid=uuid(1))]))
    assert s.open()
    snap = s.sample_once()
    assert len(snap.gpus) == 2
    r = snap.gpus[0].readings
    assert r.processes is None
    assert r.temperature_celsius is None
    assert r.power_usage_watts is None
    assert r.memory_used_bytes is None
    assert r.utilization_ratio == pytest.approx(0.97)
    assert snap.gpus[1].readings.processes is not None
    # The library mismatch is a missing function (not an error); the two Python exceptions
    # and the per-reading permission denial are counted under bounded kinds.
    assert snap.read_errors == {"exception": 2, "no_permission": 1}


def test_translate_handles_what_nvidia_ml_py_raises_besides_nvmlerror() -> None:
    import pynvml

    err = nvml.translate(
        pynvml.NVMLLibraryMismatchError("x"), "nvmlDeviceGetComputeRunningProcesses"
    )
    assert isinstance(err, nvml.FunctionNotFound)
    assert isinstance(
        nvml.translate(pynvml.NVMLError(26), "f"), nvml.FunctionNotFound
    )  # deprecated
    other = nvml.translate(ValueError("bad"), "f")
    assert type(other) is nvml.NvmlError and other.code == -1 and "ValueError" in str(other)


def test_identity_failures_leave_labels_empty_and_keep_the_gpu(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    gpus = eight_gpus()[:3]
    gpus[0].errors["pci"] = nvml.NotSupported("pci: Not Supported", 3)
    gpus[1].errors["uuid"] = nvml.NvmlError("uuid: Unknown Error", 999)
    gpus[1].errors["name"] = RuntimeError("undecodable")
    ex = make_exporter(nvml=FakeNvmlBackend(gpus), nvml_interval_seconds=0.1)
    wait_sampled(ex, 2)
    text = ex.metrics_text()
    promtool_check_metrics(text)
    m = ex.metrics()
    assert sample(m, "trainmon_gpu_devices") == 3
    info = {dict(k[1])["gpu"]: dict(k[1]) for k in m if k[0] == "trainmon_gpu_info"}
    assert info["0"]["pci_bus_id"] == "" and info["0"]["pci_device_id"] == ""
    assert info["0"]["uuid"] == uuid(0) and info["0"]["name"] == "NVIDIA H100 80GB HBM3"
    assert info["1"]["uuid"] == "" and info["1"]["name"] == ""
    assert info["1"]["pci_bus_id"] == "00000000:19:00.0"
    assert sample(m, "trainmon_gpu_utilization_ratio", gpu="1", uuid="") == 0.97
    # A transient failure clears: the label is filled in on a later pass.
    gpus[1].errors.clear()
    wait_for(
        lambda: (
            sample(ex.metrics(), "trainmon_gpu_utilization_ratio", gpu="1", uuid=uuid(1)) == 0.97
        )
    )


def test_read_error_kinds_are_bounded() -> None:
    g = FakeGpu(
        errors={
            "memory": nvml.NvmlError("memory: code 12345", 12345),
            "utilization": nvml.NvmlError("utilization: Timeout", 10),
        }
    )
    s = GpuSampler(FakeNvmlBackend([g]))
    s.open()
    snap = s.sample_once()
    assert snap.read_errors == {"other": 1, "timeout": 1}
    assert set(snap.read_errors) <= set(nvml.ERROR_KINDS)


def test_xid_codes_per_gpu_are_capped() -> None:
    g = FakeGpu(xids=[*range(1, 41), 1, 40])
    s = GpuSampler(FakeNvmlBackend([g]))
    s.open()
    xid = s.sample_once().gpus[0].xid
    assert len(xid) == MAX_XID_CODES + 1
    assert xid["1"] == 2 and xid["other"] == 40 - MAX_XID_CODES + 1
    assert sum(xid.values()) == 42  # none is lost


@pytest.mark.parametrize(
    ("code", "hint"),
    [
        (12, "libnvidia-ml.so.1 was not found"),
        (9, "kernel driver is not loaded"),
        (18, "differ in version"),
    ],
)
def test_unusable_nvml_fails_with_a_hint(code: int, hint: str) -> None:
    err = nvml.NvmlUnavailable("nvmlInit: x", code, nvml.HINTS[code])
    s = GpuSampler(FakeNvmlBackend([], init_error=err))
    assert not s.open()
    assert not s.snapshot.ok and hint in s.snapshot.hint


def test_real_pynvml_without_a_driver_translates_to_unavailable() -> None:
    import pynvml

    exc = nvml.translate(pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND), "nvmlInit")
    assert isinstance(exc, nvml.NvmlUnavailable) and "not found" in exc.hint
    assert isinstance(nvml.translate(pynvml.NVMLError(15)), nvml.GpuLost)
    assert isinstance(nvml.translate(pynvml.NVMLError(3)), nvml.NotSupported)
    assert isinstance(nvml.translate(pynvml.NVMLError(13)), nvml.FunctionNotFound)


# --------------------------------------------------------------------------- through the app


def wait_sampled(ex: InProcessExporter, n: int = 1) -> None:
    sampler = ex.app.state.exporter.gpus
    start = sampler.snapshot.samples_total
    wait_for(lambda: sampler.snapshot.samples_total >= start + n)


def test_exposition_with_eight_gpus_passes_promtool(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    gpus = eight_gpus()
    gpus[1].xids = [48, 48, 79]
    ex = make_exporter(nvml=FakeNvmlBackend(gpus), nvml_interval_seconds=0.1)
    wait_sampled(ex, 2)
    text = ex.metrics_text()
    promtool_check_metrics(text)
    m = ex.metrics()
    assert sample(m, "trainmon_scrape_collector_success", collector="gpu") == 1
    assert sample(m, "trainmon_gpu_devices") == 8
    for i in range(8):
        assert sample(m, "trainmon_gpu_utilization_ratio", gpu=str(i), uuid=uuid(i)) == 0.97
    assert sample(m, "trainmon_gpu_xid_errors_total", gpu="1", uuid=uuid(1), xid="48") == 2
    assert sample(m, "trainmon_gpu_xid_errors_total", gpu="1", uuid=uuid(1), xid="79") == 1
    info = [k for k in m if k[0] == "trainmon_gpu_info"]
    assert len(info) == 8
    labels = dict(info[0][1])
    assert labels["name"] == "NVIDIA H100 80GB HBM3" and labels["pci_device_id"] == "0x233010de"
    assert labels["driver_version"] == "550.54.15"
    assert (
        sample(
            m,
            "trainmon_gpu_ecc_errors_total",
            gpu="0",
            uuid=uuid(0),
            error_type="uncorrected",
            counter_type="aggregate",
        )
        == 1
    )


def test_slow_readings_are_exported_from_the_first_scrape_with_their_timestamp(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    gpus = eight_gpus()[:2]
    backend = FakeNvmlBackend(gpus)
    ex = make_exporter(nvml=backend, nvml_interval_seconds=0.1, nvml_slow_interval_seconds=60)
    sampler = ex.app.state.exporter.gpus
    assert sampler.slow_every == 600
    wait_sampled(ex, 3)
    text = ex.metrics_text()
    promtool_check_metrics(text)
    m = ex.metrics()
    snap = sampler.snapshot
    for i in range(2):
        labels = {"gpu": str(i), "uuid": uuid(i)}
        read_at = sample(m, "trainmon_gpu_slow_sample_timestamp_seconds", **labels)
        assert read_at == snap.gpus[i].readings.slow_sampled_at
        assert read_at is not None and read_at <= snap.taken_at
        assert sample(m, "trainmon_gpu_energy_consumption_joules_total", **labels) == 123_456.789
        assert sample(m, "trainmon_gpu_pcie_receive_bytes_total", **labels) == 2000
    assert backend.counts["energy"] == 2  # once per GPU, on the first pass
    assert "as of trainmon_gpu_slow_sample_timestamp_seconds" in text


def dashboard_average_power() -> str:
    """The GPU dashboard's "average" power query, its variables bound to a 1 m window."""
    dash = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "gpu.json").read_text())
    (expr,) = [
        t["expr"]
        for p in dash["panels"]
        for t in p.get("targets", [])
        if t.get("legendFormat", "").startswith("average ")
    ]
    return re.sub(r"\{[^}]*\}", "", expr).replace("$__rate_interval", "1m")


@pytest.mark.parametrize("exact", [True, False])
def test_the_read_time_makes_the_dashboards_average_power_exact(
    exact: bool, tmp_path: Path
) -> None:
    """Reads every 11 s, scrapes every 15 s, 500 W: the dashboard's query gives 500 W at
    every evaluation, where a plain rate() of the counter (the control) does not."""
    promtool = require_tool("promtool", "prometheus")
    energy, read_at = [], []
    for k in range(40):
        read = (15 * k // 11) * 11  # the last read before the k-th scrape
        energy.append(str(1_000_000 + 500 * read))
        read_at.append(str(1_700_000_000 + read))
    expr = (
        dashboard_average_power()
        if exact
        else "rate(trainmon_gpu_energy_consumption_joules_total[1m])"
    )
    assert "trainmon_gpu_slow_sample_timestamp_seconds" in dashboard_average_power()
    cases = [
        {"expr": expr, "eval_time": t, "exp_samples": [{"labels": "{gpu='0'}", "value": 500}]}
        for t in ("3m", "3m15s", "3m30s", "3m45s", "4m", "6m")
    ]
    spec = {
        "rule_files": [],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": [
                    {
                        "series": "trainmon_gpu_energy_consumption_joules_total{gpu='0'}",
                        "values": " ".join(energy),
                    },
                    {
                        "series": "trainmon_gpu_slow_sample_timestamp_seconds{gpu='0'}",
                        "values": " ".join(read_at),
                    },
                ],
                "promql_expr_test": cases,
            }
        ],
    }
    (tmp_path / "test.yml").write_text(json.dumps(spec))
    out = subprocess.run(
        [promtool, "test", "rules", str(tmp_path / "test.yml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (out.returncode == 0) is exact, out.stdout + out.stderr


def test_no_driver_is_a_state_not_a_failure(
    make_exporter: Callable[..., InProcessExporter], caplog: pytest.LogCaptureFixture
) -> None:
    """A node without an NVIDIA driver: GPU collector healthy, state reported, one log line."""
    err = nvml.NvmlUnavailable("nvmlInit: Driver Not Loaded", 9, nvml.HINTS[9])
    with caplog.at_level(logging.INFO, "trainmon_exporter"):
        ex = make_exporter(nvml=FakeNvmlBackend(init_error=err))
        wait_for(lambda: ex.app.state.exporter.gpus.snapshot.state == NO_DRIVER)
        run = init(run="nogpu", socket_path=ex.socket)
        run.log(0, loss=1.0, tokens=10)
        run.finish()
        wait_for(lambda: ex.rank("nogpu", 0) is not None)
        text = ex.metrics_text()
        ex.metrics_text()  # a second scrape logs nothing more
    promtool_check_metrics(text)
    m = ex.metrics()
    assert sample(m, "trainmon_scrape_collector_success", collector="gpu") == 1
    assert sample(m, "trainmon_scrape_collector_success", collector="training") == 1
    assert sample(m, "trainmon_gpu_nvml_available") == 0
    assert sample(m, "trainmon_gpu_expected") == 0
    assert sample(m, "trainmon_gpu_devices") == 0
    assert sample(m, "trainmon_gpu_lost_total") == 0
    for kind in nvml.ERROR_KINDS:  # every error counter exists at 0, GPUs or not
        assert sample(m, "trainmon_gpu_read_errors_total", error=kind) == 0
    assert sample(m, "trainmon_train_loss", run="nogpu", rank="0") == 1.0
    ready = ex.client.get("/readyz").json()
    assert ready["gpus"]["state"] == "no_driver"
    assert ready["gpus"]["ok"] is True and ready["gpus"]["expected"] is False
    assert "driver is not loaded" in ready["gpus"]["hint"]
    assert "gpu" not in ready["collector_errors"]
    page = ex.client.get("/").text
    assert "no NVIDIA driver on this node" in page and "class='crashed'>No GPU" not in page
    api = ex.client.get("/api/v1/gpus").json()
    assert api["ok"] is False and api["gpus"] == []
    lines = [r for r in caplog.records if "Driver Not Loaded" in r.getMessage()]
    assert [r.levelname for r in lines] == ["INFO"], [r.getMessage() for r in lines]


def test_nvml_that_worked_and_then_fails_is_a_failure_and_vanished_gpus_are_lost(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    """Once NVML has worked, losing it is a failure (expected, not available), and GPUs
    missing when it comes back are counted lost."""
    gpus = eight_gpus()[:3]
    backend = FakeNvmlBackend(gpus)
    ex = make_exporter(nvml=backend, nvml_interval_seconds=0.1)
    sampler = ex.app.state.exporter.gpus
    sampler.retry_seconds = 0.1
    wait_sampled(ex)
    m = ex.metrics()
    assert sample(m, "trainmon_gpu_nvml_available") == 1
    assert sample(m, "trainmon_gpu_expected") == 1
    gone = nvml.NvmlUnavailable("nvmlDeviceGetMemoryInfo: Driver Not Loaded", 9, nvml.HINTS[9])
    backend.init_error = gone
    backend.broken = gone
    wait_for(lambda: sampler.snapshot.state == FAILED)
    m = ex.metrics()
    assert sample(m, "trainmon_scrape_collector_success", collector="gpu") == 1
    assert sample(m, "trainmon_gpu_nvml_available") == 0
    assert sample(m, "trainmon_gpu_expected") == 1
    ready = ex.client.get("/readyz").json()["gpus"]
    assert ready["state"] == "failed" and ready["ok"] is False and ready["expected"] is True
    # The driver comes back with one GPU fewer: it is counted lost.
    backend.gpus = gpus[:2]
    backend.init_error = backend.broken = None
    wait_for(lambda: sampler.snapshot.ok and len(sampler.snapshot.gpus) == 2)
    m = ex.metrics()
    assert sample(m, "trainmon_gpu_lost_total") == 1
    assert sample(m, "trainmon_gpu_nvml_available") == 1


@pytest.mark.parametrize(
    ("require", "code", "state"),
    [
        (False, 12, NO_DRIVER),  # no libnvidia-ml.so.1: a node without GPUs
        (False, 9, NO_DRIVER),  # library without the kernel driver
        (True, 12, FAILED),  # --require-gpus: GPUs were expected
        (False, 18, FAILED),  # a driver is there but mismatched: GPUs are there
        (False, 4, FAILED),  # device nodes there, no permission: GPUs are there
    ],
)
def test_which_init_errors_are_a_state_and_which_a_failure(
    require: bool, code: int, state: str
) -> None:
    err = nvml.NvmlUnavailable("nvmlInit: x", code, nvml.HINTS[code])
    s = GpuSampler(FakeNvmlBackend([], init_error=err), require=require)
    assert not s.open()
    assert s.snapshot.state == state and s.snapshot.expected is (state == FAILED)


def test_an_exception_at_init_is_a_failure_not_a_dead_thread() -> None:
    backend = FakeNvmlBackend([FakeGpu()], init_error=OSError("dlopen exploded"))
    s = GpuSampler(backend, interval=0.05, retry_seconds=0.05)
    s.start()
    try:
        wait_for(lambda: s.snapshot.state == FAILED)
        assert "OSError: dlopen exploded" in s.snapshot.error
        backend.init_error = None
        wait_for(lambda: s.snapshot.ok)  # the thread survived and retried
    finally:
        s.stop()


def test_require_gpus_refuses_to_start(make_exporter: Callable[..., InProcessExporter]) -> None:
    from trainmon_exporter.app import GpusRequiredError

    err = nvml.NvmlUnavailable("nvmlInit: NVML Shared Library Not Found", 12, nvml.HINTS[12])
    with pytest.raises(GpusRequiredError, match=r"HINT: libnvidia-ml\.so\.1"):
        make_exporter(nvml=FakeNvmlBackend(init_error=err), require_gpus=True)
    with pytest.raises(GpusRequiredError, match="NVML sees no GPU"):
        make_exporter(nvml=FakeNvmlBackend([]), require_gpus=True)


def test_rank_gpu_join_and_mfu_against_a_hand_computation(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    import os

    gpus = eight_gpus()
    gpus[5].processes = [(os.getpid(), 7 * 2**30), (999_999, 2**30)]
    gpus[6].name, gpus[6].pci_device_id = "NVIDIA Z9000", 0x999910DE  # not in the table
    gpus[7].name, gpus[7].pci_device_id = "NVIDIA A100-SXM4-80GB", 0x20B210DE
    ex = make_exporter(nvml=FakeNvmlBackend(gpus), nvml_interval_seconds=0.1)
    wait_sampled(ex)
    # Rank 0 on GPU 5 (an H100 SXM); rank 1 on an unknown part; rank 2 without CUDA; rank 3
    # without a parameter count; rank 4 on an A100 in fp8 (Ampere has no FP8 tensor cores).
    runs = [
        init(
            run="mfu",
            rank=0,
            world_size=5,
            socket_path=ex.socket,
            num_params=124_000_000,
            gpu_uuid=uuid(5),
        ),
        init(
            run="mfu", rank=1, world_size=5, socket_path=ex.socket, num_params=1, gpu_uuid=uuid(6)
        ),
        init(run="mfu", rank=2, world_size=5, socket_path=ex.socket, num_params=1),
        init(run="mfu", rank=3, world_size=5, socket_path=ex.socket, gpu_uuid=uuid(5)),
        init(
            run="mfu",
            rank=4,
            world_size=5,
            socket_path=ex.socket,
            num_params=1,
            gpu_uuid=uuid(7),
            dtype="fp8",
        ),
    ]
    for r in runs:
        r.flush_interval = 0.0
    # 1,000,000 tokens per step, one step per client-second: 1e6 tokens/s exactly, because
    # tokens/s comes from the client's clock stamps (set here by hand: the wall time of a step
    # is its perf_counter mapped to the wall clock, so both clocks are faked).
    import trainmon_client._run as client_run
    import trainmon_client._sender as client_sender

    t = [time.time() - 5.0]
    clocked = (client_run, client_sender)  # the run stamps steps, the sender maps the stamps
    real = [(mod._wall, mod._perf) for mod in clocked]
    for mod in clocked:
        mod._wall = mod._perf = lambda: t[0]
    try:
        for step in range(5):
            for r in runs:
                r.log(step, loss=1.0, tokens=1_000_000)
            t[0] += 1.0
        # Every step encoded while the clocks are still faked; the ranks keep running (a
        # finished rank has no current throughput, so no MFU).
        wait_for(lambda: all((ex.rank("mfu", i) or {}).get("steps_total") == 5 for i in range(5)))
    finally:
        for mod, (wall, perf) in zip(clocked, real, strict=True):
            mod._wall, mod._perf = wall, perf
    m = ex.metrics()
    promtool_check_metrics(ex.metrics_text())
    flops = 1e6 * 6 * 124_000_000  # tokens/s x 6 x params = 7.44e14 FLOP/s
    assert sample(m, "trainmon_train_model_flops_per_second", run="mfu", rank="0") == pytest.approx(
        flops
    )
    assert sample(m, "trainmon_train_peak_flops_per_second", run="mfu", rank="0") == 989.5e12
    assert sample(m, "trainmon_train_mfu_ratio", run="mfu", rank="0") == pytest.approx(
        7.44e14 / 989.5e12
    )
    for rank, reason in (
        ("1", "unknown_gpu_model"),
        ("2", "no_gpu_uuid"),
        ("3", "no_flops_per_token"),
        ("4", "unknown_dtype"),
    ):
        assert sample(m, "trainmon_train_mfu_ratio", run="mfu", rank=rank) is None
        assert sample(m, "trainmon_train_mfu_unavailable", run="mfu", rank=rank, reason=reason) == 1
    # The rank's process memory, found by the socket peer's PID.
    assert sample(m, "trainmon_rank_gpu_memory_used_bytes", run="mfu", rank="0") == 7 * 2**30
    api = ex.rank("mfu", 0)
    assert (
        api is not None
        and api["gpu"] == 5
        and api["mfu_ratio"] == pytest.approx(7.44e14 / 989.5e12)
    )
    assert ex.rank("mfu", 1)["mfu_unavailable_reason"] == "unknown_gpu_model"  # type: ignore[index]
    info = [dict(k[1]) for k in m if k[0] == "trainmon_rank_info"]
    assert {i["uuid"] for i in info} >= {uuid(5), uuid(6), ""}
    page = ex.client.get("/").text
    assert "75.2 %" in page and "– (GPU peak unknown)" in page
    for r in runs:
        r.finish()


def test_peak_override_gives_mfu_without_nvml(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    err = nvml.NvmlUnavailable("nvmlInit: x", 12, nvml.HINTS[12])
    ex = make_exporter(nvml=FakeNvmlBackend(init_error=err), peak_flops=1e12)
    run = connect(ex, "cpu", flops_per_token=1e6)
    for step in range(3):
        run.log(step, loss=1.0, tokens=1000)
        time.sleep(0.3)  # rates need the window to span 0.5 s
    wait_for(lambda: (ex.rank("cpu", 0) or {}).get("steps_total") == 3)
    m = ex.metrics()
    tps = ex.rank("cpu", 0)["tokens_per_second"]  # type: ignore[index]
    run.finish()
    assert sample(m, "trainmon_train_peak_flops_per_second", run="cpu", rank="0") == 1e12
    assert sample(m, "trainmon_train_mfu_ratio", run="cpu", rank="0") == pytest.approx(
        tps * 1e6 / 1e12, rel=1e-9
    )


def test_mfu_above_peak_is_exported_and_flagged(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    """An MFU over 1 is kept as computed (an alert says why) and named on the status page."""
    err = nvml.NvmlUnavailable("nvmlInit: x", 12, nvml.HINTS[12])
    ex = make_exporter(nvml=FakeNvmlBackend(init_error=err), peak_flops=1e6)  # far too low
    runs = {
        name: connect(ex, name, flops_per_token=fpt) for name, fpt in (("hi", 1e6), ("ok", 1.0))
    }
    for step in range(3):
        for run in runs.values():
            run.log(step, loss=1.0, tokens=1000)
        time.sleep(0.3)  # rates need the window to span 0.5 s
    wait_for(lambda: all((ex.rank(n, 0) or {}).get("steps_total") == 3 for n in runs))
    m = ex.metrics()
    views = {n: ex.rank(n, 0) or {} for n in runs}
    for run in runs.values():
        run.finish()
    hi = sample(m, "trainmon_train_mfu_ratio", run="hi", rank="0")
    assert hi is not None and hi > 1000  # ~3,000 tokens/s x 1e6 FLOPs / 1e6 FLOP/s
    assert [h for h in views["hi"]["health"] if h.startswith("MFU above 100 %")]
    ok = sample(m, "trainmon_train_mfu_ratio", run="ok", rank="0")
    assert ok is not None and ok < 1
    assert not [h for h in views["ok"]["health"] if h.startswith("MFU")]


# --------------------------------------------------------------------------- peak table


@pytest.mark.parametrize(
    ("name", "pci", "dtype", "expected"),
    [
        ("NVIDIA A100-SXM4-80GB", 0x20B210DE, "bf16", 312e12),
        ("NVIDIA H100 80GB HBM3", 0x233010DE, "bf16", 989.5e12),
        ("NVIDIA H100 PCIe", 0x233110DE, "bf16", 756.5e12),
        ("NVIDIA H100 NVL", 0x232110DE, "fp8", 1670.5e12),
        ("NVIDIA H200", 0x233510DE, "bf16", 989.5e12),
        ("NVIDIA H200 NVL", 0, "bf16", 835.5e12),
        ("NVIDIA H20", 0, "bf16", 148e12),
        ("NVIDIA B200", 0, "bf16", 2250e12),
        ("NVIDIA GB200", 0, "fp8", 5000e12),
        ("NVIDIA L40S", 0, "bf16", 362.05e12),
        ("NVIDIA L4", 0x27B810DE, "bf16", 121e12),
        ("NVIDIA A10G", 0x223710DE, "bf16", 125e12),
        ("NVIDIA GeForce RTX 4090", 0x268410DE, "bf16", 165.2e12),
        # The PCI id wins over a name that would say otherwise.
        ("Some Renamed Board", 0x233010DE, "tf32", 494.5e12),
    ],
)
def test_peak_table(name: str, pci: int, dtype: str, expected: float) -> None:
    assert peaks.peak_flops(name, pci, dtype).flops == expected


def test_peak_table_never_guesses() -> None:
    assert peaks.peak_flops("NVIDIA L40", 0, "bf16").flops == 181.05e12  # not the L4's
    assert peaks.peak_flops("NVIDIA L4", 0, "bf16").flops == 121e12  # not the L40's
    unknown = peaks.peak_flops("NVIDIA Tesla V100-SXM2-16GB", 0x1DB110DE, "bf16")
    assert unknown.flops is None and unknown.reason == "unknown_gpu_model"
    no_fp8 = peaks.peak_flops("NVIDIA A100-SXM4-40GB", 0x20B010DE, "fp8")
    assert no_fp8.flops is None and no_fp8.reason == "unknown_dtype"
    for m in peaks.MODELS:
        assert m.source and all(v > 1e13 for v in m.dense.values())
        assert all(m.sparse[k] == 2 * m.dense[k] for k in m.dense)
