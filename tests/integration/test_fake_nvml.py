"""The real nvidia-ml-py code against a fake ``libnvidia-ml.so.1`` compiled here (gcc).

In this process through :class:`~trainmon_exporter.nvml.PynvmlBackend`, and end to end: a real
exporter process with 8 scripted GPUs, one of which is lost mid-run, real client ranks joined
to their GPUs by UUID, MFU, and ``promtool check metrics`` on the exposition.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.conftest import (
    ExporterProcess,
    child_env,
    parse_metrics,
    promtool_check_metrics,
    sample,
    wait_for,
)
from tests.fakes.libnvml import CONFIG_ENV, build, h100, load, write_config
from tests.helpers.checkout import tracked
from trainmon_client import init
from trainmon_exporter import nvml
from trainmon_exporter.nvml import PynvmlBackend
from trainmon_exporter.sampler import GpuSampler


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("fake-nvml"))


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_lib: Path) -> Iterator[Path]:
    load(fake_lib)
    path = tmp_path / "gpus.conf"
    monkeypatch.setenv(CONFIG_ENV, str(path))
    yield path


def test_every_reading_through_real_pynvml(config: Path) -> None:
    write_config(
        config,
        [
            h100(0, procs=f"{os.getpid()}:1234,42:5", xid="79,48", clock_reasons=0x40),
            h100(1, **{"error.nvmlDeviceGetTemperature": 3, "error.nvmlDeviceGetPowerUsage": 999}),
            h100(2, gpm=0, mem_temp=None, ecc_unc_agg=2, remap_unc=1, remap_pending=1),
        ],
        driver_version="560.35.03",
    )
    s = GpuSampler(PynvmlBackend())
    assert s.open()
    s.sample_once()
    snap = s.sample_once()
    assert snap.ok and snap.driver_version == "560.35.03" and len(snap.gpus) == 3
    g0, g1, g2 = snap.gpus
    assert g0.uuid == "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd"
    assert g0.pci_bus_id == "00000000:18:00.0" and g0.pci_device_id == 0x233010DE
    r = g0.readings
    assert r.memory_total_bytes == 85_520_809_984
    assert r.memory_used_bytes == 40_000_000_000
    assert r.utilization_ratio == pytest.approx(0.90)
    assert r.power_usage_watts == 650.0
    assert r.energy_joules == 1000.0
    assert r.memory_temperature_celsius == 70.0
    assert r.pcie_receive_bytes == 654_321
    assert r.nvlink_transmit_bytes == 1000 * 1024
    assert r.tensor_active_ratio == pytest.approx(0.45)
    assert r.sm_clock_max_hertz == 1980e6
    assert g0.clock_events["hw_thermal_slowdown"] == 1.0
    assert g0.xid == {"79": 1, "48": 1}
    assert g0.processes == ((os.getpid(), 1234), (42, 5))
    assert snap.process_memory()[os.getpid()] == 1234
    # NOT_SUPPORTED omits the reading; an unknown error omits it and is counted.
    assert g1.readings.temperature_celsius is None
    assert g1.readings.power_usage_watts is None
    assert snap.read_errors == {"unknown": 2}
    assert g2.readings.tensor_active_ratio is None  # no GPM on this one
    assert g2.readings.memory_temperature_celsius is None
    assert g2.ecc[("uncorrected", "aggregate")] == 2
    assert g2.readings.remapped_rows_pending is True
    # XIDs are delivered once: the next pass does not count them again.
    assert s.sample_once().gpus[0].xid == {"79": 1, "48": 1}
    s.stop()


def test_lost_gpu_through_real_pynvml(config: Path) -> None:
    write_config(config, [h100(i) for i in range(4)])
    s = GpuSampler(PynvmlBackend())
    assert s.open()
    assert len(s.sample_once().gpus) == 4
    write_config(config, [h100(i, lost=int(i == 2)) for i in range(4)])
    snap = s.sample_once()
    assert [g.index for g in snap.gpus] == [0, 1, 3] and snap.lost_total == 1
    s.stop()


@pytest.mark.parametrize(("code", "cls"), [(9, "driver"), (18, "version"), (12, "not found")])
def test_init_errors_through_real_pynvml(config: Path, code: int, cls: str) -> None:
    write_config(config, [], init_error=code)
    s = GpuSampler(PynvmlBackend())
    assert not s.open()
    assert not s.snapshot.ok and cls in s.snapshot.hint


def test_missing_functions_are_omitted_once(
    tmp_path: Path, fake_lib: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An older driver without GPM or field values: the rest still samples (subprocess)."""
    old = build(tmp_path / "old", "NO_GPM", "NO_FIELD_VALUES")
    cfg = tmp_path / "gpus.conf"
    write_config(cfg, [h100(0)])
    code = (
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "from trainmon_exporter.nvml import PynvmlBackend\n"
        "from trainmon_exporter.sampler import GpuSampler\n"
        "s = GpuSampler(PynvmlBackend()); assert s.open()\n"
        "for _ in range(3): snap = s.sample_once()\n"
        "r = snap.gpus[0].readings\n"
        "assert r.tensor_active_ratio is None, r\n"
        "assert r.pcie_transmit_bytes is None, r\n"
        "assert r.utilization_ratio == 0.9, r\n"
        "assert snap.read_errors == {}, snap.read_errors\n"
        "print('OK')\n"
    )
    env = child_env(LD_LIBRARY_PATH=str(old.parent), **{CONFIG_ENV: str(cfg)})
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "OK"
    # Logged once per function, not once per pass.
    assert out.stderr.count("nvmlGpmQueryDeviceSupport") == 1, out.stderr
    assert out.stderr.count("nvmlDeviceGetFieldValues") == 1, out.stderr


# --------------------------------------------------------------------------- end to end


def test_exporter_with_eight_fake_gpus_one_lost_mid_run(
    tmp_path: Path, fake_lib: Path, exporter_process: Callable[..., ExporterProcess]
) -> None:
    cfg = tmp_path / "gpus.conf"
    gpus = [h100(i) for i in range(8)]
    gpus[7].update(name="NVIDIA Z9000", pci_device_id="0x999910DE")  # not in the peak table
    gpus[0]["procs"] = "1:1"  # replaced below with the trainer's PID
    write_config(cfg, gpus)
    env = child_env(LD_LIBRARY_PATH=str(fake_lib.parent), **{CONFIG_ENV: str(cfg)})
    ex = exporter_process("--nvml-interval-seconds", "0.2", env=env).start()

    def metrics() -> dict[object, float]:
        return ex.metrics()

    wait_for(lambda: sample(metrics(), "trainmon_gpu_devices") == 8, timeout=20)
    # Two ranks of one run: rank 0 on GPU 0 (H100 SXM), rank 1 on GPU 7 (unknown part).
    r0, r1 = (
        init(
            run="gpu-e2e",
            rank=rank,
            world_size=2,
            socket_path=ex.socket,
            num_params=124_000_000,
            gpu_uuid=str(gpus[gpu]["uuid"]),
        )
        for rank, gpu in ((0, 0), (1, 7))
    )
    gpus[0]["procs"] = f"{os.getpid()}:{3 * 2**30}"
    write_config(cfg, gpus)
    t_end = time.time() + 1.5
    step = 0
    while time.time() < t_end:
        r0.log(step, loss=2.0, tokens=4096)
        r1.log(step, loss=2.0, tokens=4096)
        step += 1
        time.sleep(0.01)
    # GPU 3 falls off the bus mid-run.
    gpus[3]["lost"] = 1
    write_config(cfg, gpus)
    wait_for(lambda: sample(metrics(), "trainmon_gpu_lost_total") == 1, timeout=10)
    r0.log(step, loss=2.0, tokens=4096)
    r1.log(step, loss=2.0, tokens=4096)
    text = httpx.get(ex.url + "/metrics", timeout=5).text
    r0.finish()
    r1.finish()
    promtool_check_metrics(text)
    m = parse_metrics(text)
    assert sample(m, "trainmon_gpu_devices") == 7
    assert sample(m, "trainmon_scrape_collector_success", collector="gpu") == 1
    live = {dict(k[1])["gpu"] for k in m if k[0] == "trainmon_gpu_utilization_ratio"}
    assert live == {"0", "1", "2", "4", "5", "6", "7"}
    for name in (
        "trainmon_gpu_memory_used_bytes",
        "trainmon_gpu_power_usage_watts",
        "trainmon_gpu_energy_consumption_joules_total",
        "trainmon_gpu_temperature_celsius",
        "trainmon_gpu_sm_clock_hertz",
        "trainmon_gpu_tensor_active_ratio",
        "trainmon_gpu_pcie_transmit_bytes_total",
        "trainmon_gpu_nvlink_receive_bytes_total",
    ):
        got = {dict(k[1])["gpu"] for k in m if k[0] == name}
        assert got == live, name
    assert not [k for k in m if dict(k[1]).get("gpu") == "3"]
    # MFU: rank 0 on an H100 SXM, by hand from its own tokens/s.
    api = {r["rank"]: r for r in ex.runs()["runs"][0]["ranks"]}
    assert api[0]["gpu"] == 0 and api[1]["gpu"] == 7
    mfu = sample(m, "trainmon_train_mfu_ratio", run="gpu-e2e", rank="0")
    achieved = sample(m, "trainmon_train_model_flops_per_second", run="gpu-e2e", rank="0")
    assert achieved is not None and mfu is not None
    tps = sample(m, "trainmon_train_tokens_per_second", run="gpu-e2e", rank="0")
    assert tps is not None and achieved == pytest.approx(tps * 6 * 124_000_000)
    assert mfu == pytest.approx(achieved / 989.5e12)
    assert sample(m, "trainmon_train_mfu_ratio", run="gpu-e2e", rank="1") is None
    assert (
        sample(
            m, "trainmon_train_mfu_unavailable", run="gpu-e2e", rank="1", reason="unknown_gpu_model"
        )
        == 1
    )
    # Rank 0's process memory by its socket peer PID (this test process).
    assert sample(m, "trainmon_rank_gpu_memory_used_bytes", run="gpu-e2e", rank="0") == 3 * 2**30
    log = ex.stop()
    assert "GPU 3" in log and "lost" in log


def test_exporter_without_a_driver_serves_training_metrics(
    tmp_path: Path, fake_lib: Path, exporter_process: Callable[..., ExporterProcess]
) -> None:
    cfg = tmp_path / "gpus.conf"
    write_config(cfg, [], init_error=9)
    env = child_env(LD_LIBRARY_PATH=str(fake_lib.parent), **{CONFIG_ENV: str(cfg)})
    ex = exporter_process(env=env).start()
    run = init(run="nodriver", socket_path=ex.socket)
    run.log(0, loss=1.0)
    run.finish()
    wait_for(lambda: sample(ex.metrics(), "trainmon_train_loss", run="nodriver", rank="0") == 1.0)
    m = ex.metrics()
    assert sample(m, "trainmon_scrape_collector_success", collector="gpu") == 1
    assert sample(m, "trainmon_gpu_nvml_available") == 0
    assert sample(m, "trainmon_gpu_expected") == 0
    ready = httpx.get(ex.url + "/readyz", timeout=5)
    gpus = ready.json()["gpus"]
    assert ready.status_code == 200 and "kernel driver is not loaded" in gpus["hint"]
    assert gpus["state"] == "no_driver" and gpus["ok"] is True
    log = ex.stop()
    # One line with the hint at start, not a line per retry or per scrape.
    assert log.count("HINT (if this node has GPUs): the NVIDIA kernel driver is not") == 1, log
    assert "No NVIDIA driver on this node" in log
    assert "Traceback" not in log

    # And with require_gpus the exporter refuses to start, saying why.
    refused = exporter_process("--require-gpus", env=env).start(wait=False)
    assert refused.proc is not None
    refused.proc.wait(timeout=30)
    out = refused.stop()
    assert refused.proc.returncode != 0 and "require_gpus is set" in out, out


def test_cpu_only_node_started_as_the_readme_says_raises_nothing(
    exporter_process: Callable[..., ExporterProcess],
) -> None:
    """No libnvidia-ml.so.1 at all (this VM): the gpu collector is healthy and reports the
    state, so TrainmonCollectorFailing and TrainmonGpuMetricsUnavailable have nothing to fire
    on (their promtool tests hold the rest)."""
    env = child_env()
    env.pop(CONFIG_ENV, None)
    env.pop("LD_LIBRARY_PATH", None)
    ex = exporter_process(env=env).start()

    def gpus() -> dict[str, object]:
        body: dict[str, object] = httpx.get(ex.url + "/readyz", timeout=5).json()["gpus"]
        return body

    wait_for(lambda: gpus()["state"] != "starting", timeout=20)
    if gpus()["state"] == "sampling":
        ex.stop()
        pytest.skip("this host has an NVIDIA driver")
    assert gpus()["state"] == "no_driver" and gpus()["ok"] is True
    m = ex.metrics()
    assert sample(m, "trainmon_scrape_collector_success", collector="gpu") == 1
    assert sample(m, "trainmon_scrape_collector_success", collector="rank_gpu") == 1
    assert sample(m, "trainmon_gpu_nvml_available") == 0
    assert sample(m, "trainmon_gpu_expected") == 0
    assert sample(m, "trainmon_gpu_read_errors_total", error="unknown") == 0
    log = ex.stop()
    assert log.count("No NVIDIA driver on this node") == 1, log
    assert "libnvidia-ml.so.1 was not found" in log
    assert "WARNING" not in log and "Traceback" not in log, log


def test_nvml_module_is_the_only_pynvml_importer() -> None:
    src = Path(nvml.__file__).parent
    users = [p.name for p in tracked("**/*.py", under=src) if "import pynvml" in p.read_text()]
    assert users == ["nvml.py"]
