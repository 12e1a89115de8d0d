"""On a real CUDA GPU: a hung NCCL rank's Flight Recorder state is read and exported.

One rank of an NCCL process group (world size 1) steps 30 times (an all-reduce, a
synchronisation, ``Run.log()``), then queues an all-reduce behind a kernel that spins the GPU
for minutes (``torch.cuda._sleep``) and waits for it in ``torch.cuda.synchronize()``: a C++
call that released the GIL, as a rank waiting on a collective does. The exporter judges it
hung and asks; the rank must answer with its stacks and the NCCL recorder's state, and the
exporter must export ``trainmon_hang_frame_info{collective="nccl:all_reduce"}`` and the
sequence ids: 31 enqueued, 30 completed (and, with ``TORCH_NCCL_ENABLE_TIMING=1``, 30
started). Skipped without CUDA or NCCL; run on a machine with one (docs/gpu-validation.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from trainmon_exporter.local import LocalExporter, free_port  # noqa: E402

from ..conftest import child_env, parse_metrics, wait_for  # noqa: E402

JOB = textwrap.dedent(
    """
    import os, sys, time
    import torch, torch.distributed as dist
    import trainmon_client

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    run = trainmon_client.init(run="nccl-hang", socket_path=sys.argv[1], flush_interval=0.2)
    t = torch.ones(1 << 20, device="cuda")
    for step in range(30):
        dist.all_reduce(t)
        torch.cuda.synchronize()
        run.log(step, loss=1.0)
        time.sleep(0.05)
    def wait_for_gradients():
        torch.cuda._sleep(1 << 40)  # the stream is busy for minutes
        dist.all_reduce(t)  # queued behind it: enqueued, never started
        torch.cuda.synchronize()  # waits in C++, the GIL released
    wait_for_gradients()
    """
)


def _series(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (dict(labels), value) for (n, labels), value in parse_metrics(text).items() if n == name
    ]


@pytest.mark.parametrize("timing", ["0", "1"])
def test_a_hung_nccl_rank_reports_its_flight_recorder(timing: str) -> None:
    if not torch.distributed.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    with LocalExporter("--analytics.hang-grace-seconds", "2") as ex:
        env = child_env(TORCH_FR_BUFFER_SIZE="2000", TORCH_NCCL_ENABLE_TIMING=timing)
        job = subprocess.Popen(
            [sys.executable, "-c", JOB, ex.socket, str(free_port())],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            t0 = time.monotonic()

            def exported() -> list[tuple[dict[str, str], float]]:
                text = ex.get("/metrics").decode()
                return _series(text, "trainmon_hang_collective_sequence")

            sequences = wait_for(exported, timeout=180, interval=0.5)
            took = time.monotonic() - t0
            text = ex.get("/metrics").decode()
            (frame,) = _series(text, "trainmon_hang_frame_info")
            runs: Any = json.loads(ex.get("/api/v1/runs"))
        finally:
            job.kill()
            out = job.communicate(timeout=60)[0]
    print(f"\nTORCH_NCCL_ENABLE_TIMING={timing}: evidence exported {took:.1f} s after start")
    print(json.dumps(runs["runs"][0]["ranks"][0]["hang"], indent=1)[:3000])
    print(out[-2000:])
    assert frame[0]["collective"] == "nccl:all_reduce", frame
    assert frame[0]["frame"].startswith("wait_for_gradients ("), frame
    by_state = {labels["state"]: value for labels, value in sequences if labels["group"] == "0"}
    assert by_state["enqueued"] == 31 and by_state["completed"] == 30, by_state
    if timing == "1":
        assert by_state.get("started") == 30, by_state
    hang = runs["runs"][0]["ranks"][0]["hang"]
    assert hang["distributed"] == "ok" and hang["status"] == "captured"
    pending = hang["groups"][0]["pending"]
    assert pending["op"] == "nccl:all_reduce" and pending["seq"] == 31, pending
    assert pending["sizes"] == [[1 << 20]] and pending["dtypes"] == ["Float"], pending
