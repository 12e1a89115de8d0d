"""On a real NVIDIA GPU and driver: the sampler through the real libnvidia-ml, and the join.

Skipped when NVML cannot be initialised (no driver, as on the CI VM). On a GPU node it checks
what the fake library (tests/fakes/libnvml) can only assume: that every reading the sampler
takes is there and plausible on real hardware, that the GPU's model is in the peak FLOP/s
table, and that a CUDA process of this test is found by PID in NVML's process list (the
rank -> GPU memory join). Results go into docs/gpu-validation.md.
"""

from __future__ import annotations

import os

import pytest

from trainmon_exporter.nvml import PynvmlBackend
from trainmon_exporter.peaks import peak_flops
from trainmon_exporter.sampler import GpuSampler

pytestmark = pytest.mark.gpu


@pytest.fixture
def sampler() -> GpuSampler:
    backend = PynvmlBackend()
    try:
        backend.init()
    except Exception as exc:  # no driver or no library
        pytest.skip(f"NVML unavailable: {exc}")
    backend.shutdown()
    s = GpuSampler(backend, interval=1.0)
    assert s.open()
    return s


def test_every_core_reading_is_present_and_plausible(sampler: GpuSampler) -> None:
    sampler.sample_once()
    snap = sampler.snapshot
    assert snap.ok and snap.gpus, snap.error
    for gpu in snap.gpus:
        r = gpu.readings
        print(gpu.name, hex(gpu.pci_device_id), r)
        assert gpu.uuid.startswith(("GPU-", "MIG-"))
        total = r.memory_total_bytes
        assert total is not None and r.memory_used_bytes is not None
        assert total > 1 << 30 and 0 <= r.memory_used_bytes <= total
        assert r.utilization_ratio is not None and 0 <= r.utilization_ratio <= 1
        assert r.power_usage_watts is not None and 10 < r.power_usage_watts < 2000
        assert r.temperature_celsius is not None and 0 < r.temperature_celsius < 120
        assert r.sm_clock_hertz is not None and r.sm_clock_hertz > 1e8
        assert peak_flops(gpu.name, gpu.pci_device_id, "bf16").flops, gpu.name


def test_a_cuda_process_is_found_by_pid(sampler: GpuSampler) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    x = torch.ones(256 << 20, dtype=torch.uint8, device="cuda")  # 256 MiB held
    torch.cuda.synchronize()
    sampler.sample_once()
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    by_pid = {
        pid: used
        for gpu in sampler.snapshot.gpus
        if gpu.uuid.endswith(uuid.removeprefix("GPU-"))
        for pid, used in gpu.processes
    }
    assert os.getpid() in by_pid, by_pid
    used = by_pid[os.getpid()]
    assert used is None or used >= 256 << 20
    del x
