"""Golden captures: what a fixed session makes the exporter show, byte for byte.

A scripted session on a fake clock goes through the real ingest path
(``IngestServer.handle_packet``) of an exporter built with ``build_exporter`` and a fake
NVML with two GPUs: two ranks of one run with standard and custom fields, an evaluation, a
tracked operation, a checkpoint, watched layers, a NaN, a loss spike, a finish, a refused
HELLO and an invalid record; then rank 1 hangs, is asked for its stacks (the request read
from its socket as a client would) and answers with a capture of a rank waiting in an NCCL
all-reduce. Captured:

- ``session.exposition.txt``: the ``/metrics`` text (the app's own formatter and sample
  budget);
- ``session.runs.json``: the ``/api/v1/runs`` response;
- ``session.gpus.json``: the ``/api/v1/gpus`` response;
- ``session.packets.hex``: the packets fed in, one per line.

Values that describe this machine or build rather than the session are left out: the
``process_*`` samples, ``trainmon_build_info``, the collectors' and the NVML pass's durations
(``time.perf_counter``). Any other difference fails the test: a change that alters what a user
sees must update the files on purpose (``TRAINMON_UPDATE_GOLDEN=1 pytest
tests/exporter/test_golden.py``) and say why.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from trainmon_client import _protocol as P
from trainmon_exporter import Settings
from trainmon_exporter.app import build_exporter
from trainmon_exporter.exposition import TextExposition
from trainmon_exporter.ingest import Connection
from trainmon_exporter.shed import SampleBudget
from trainmon_exporter.timers import ask_hung
from trainmon_exporter.views.api import gpu_snapshot, snapshot

from ..fakes.nvml_backend import FakeGpu, FakeNvmlBackend

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
UPDATE = os.environ.get("TRAINMON_UPDATE_GOLDEN") == "1"
T0 = 1_800_000_000.0  # fake wall clock at the start (Unix seconds)

# Samples that depend on this machine or this build, not on the session.
MASKED = re.compile(
    r"^(trainmon_build_info|process_[a-z_]+|trainmon_scrape_collector_duration_seconds"
    r"|trainmon_gpu_sample_duration_seconds)[{ ]"
)


class FakeClock:
    """``time.time`` and ``time.monotonic`` that move only when told."""

    def __init__(self) -> None:
        self.wall = T0
        self.mono = 1_000.0

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


def hello(run: str, rank: int, **kw: Any) -> bytes:
    fields = {
        "run": run,
        "rank": rank,
        "local_rank": rank,
        "world_size": 2,
        "hostname": "node1",
        "pid": 4000 + rank,
        "client_version": "golden",
        "gpu_uuid": f"GPU-0000000{rank}-0000-0000-0000-000000000000",
        "started_at": T0,
        "flops_per_token": 6 * 124e6,
        "dtype": "bf16",
    }
    return P.encode_hello(fields | kw)


def step(n: int, when: float, step_time: float, fields: dict[int, float]) -> bytes:
    ids = list(fields)
    head = P.STEP_HEADER.pack(n, n, when, step_time, 4096.0 * n, 8.0 * n, 0.001 * n, 0, 0, 0)
    return P.encode_fields(P.STEP, head, ids, [fields[i] for i in ids])


def pkt(*records: bytes) -> bytes:
    return P.packet_header() + b"".join(records)


def session(clock: FakeClock) -> list[tuple[int, bytes]]:
    """(connection index, packet) in the order they arrive; the clock advances between."""
    out: list[tuple[int, bytes]] = []
    tokens_id, phase_id, layer_a, layer_b, op_id = 64, 65, 66, 67, 68
    for rank in (0, 1):
        out.append(
            (
                rank,
                pkt(
                    hello("golden-run", rank),
                    P.encode_name(tokens_id, "data/tokens_per_sample"),
                    P.encode_name(phase_id, "phase"),
                    P.encode_name(layer_a, "blocks.0.attn"),
                    P.encode_name(layer_b, "blocks.0.mlp"),
                    P.encode_name(op_id, "validation"),
                ),
            )
        )
    for n in range(1, 61):
        loss = 3.0 - 0.01 * n + (0.002 if n % 2 else -0.002)
        if n == 45:
            loss = 9.0  # a spike
        for rank in (0, 1):
            when = T0 + 0.25 * n
            fields = {
                P.STANDARD_FIELDS["loss"]: loss + 0.001 * rank,
                P.STANDARD_FIELDS["lr"]: 3e-4,
                P.STANDARD_FIELDS["grad_norm"]: 1.0 + 0.01 * (n % 5),
                P.STANDARD_FIELDS["mem_allocated"]: 20e9 + 1e6 * rank,
                tokens_id: 512.0,
                phase_id: 1.0,
            }
            if n == 50 and rank == 1:
                fields[P.STANDARD_FIELDS["grad_norm"]] = math.nan
            records = [step(n, when, 0.25 + 0.05 * rank, fields)]
            if n % 20 == 0:
                records.append(
                    P.encode_layers(
                        n,
                        when,
                        n // 20,
                        0.002 * n // 20,
                        [layer_a, layer_b],
                        [P.LAYER_STATS["grad_norm"], P.LAYER_STATS["update_ratio"]],
                        [0.5, 1e-3, 0.25, 2e-3],
                    )
                )
            if n == 30:
                records.append(
                    P.encode_fields(
                        P.EVAL,
                        P.EVAL_HEADER.pack(n, when),
                        [P.STANDARD_FIELDS["val_loss"]],
                        [2.9 + 0.01 * rank],
                    )
                )
                records.append(P.encode_track(op_id, False, 1.5, 1))
            if n == 40 and rank == 0:
                records.append(P.encode_checkpoint(n, when, 2.5))
            out.append((rank, pkt(*records)))
        clock.advance(0.25)
    out.append((0, pkt(P.encode_finish(P.FINISH_OK, T0 + 16.0))))
    out.append((2, pkt(hello("golden-run", 1))))  # rank 1 again, still connected: refused
    out.append((1, P.packet_header() + b"\xff\x00\x00"))  # an unknown record type
    return out


HUNG_CAPTURE = {
    "time": T0 + 50.0,
    "seconds": 0.104,
    "threads": [
        {
            "name": "MainThread",
            "id": 140000000000001,
            "training": True,
            "state": "S",
            "cpu": 0.0,
            "frames": [
                ["/job/train.py", 88, "<module>", True],
                ["/job/train.py", 61, "train_step", True],
                ["/venv/site-packages/torch/distributed/c10d_logger.py", 83, "wrapper", False],
                [
                    "/venv/site-packages/torch/distributed/distributed_c10d.py",
                    3252,
                    "all_reduce",
                    False,
                ],
            ],
            "omitted": 0,
        },
        {
            "name": "trainmon-flush-1",
            "id": 140000000000002,
            "training": False,
            "state": "R",
            "cpu": 0.01,
            "frames": [],
            "omitted": 0,
        },
    ],
    "threads_omitted": 0,
    "collectives": {
        "state": "ok",
        "detail": "",
        "groups": [
            {
                "id": "0",
                "name": "default_pg",
                "enqueued": 61,
                "started": 61,
                "completed": 60,
                "pending": {
                    "seq": 61,
                    "op": "nccl:all_reduce",
                    "p2p": False,
                    "sizes": [[4096, 1024]],
                    "out_sizes": [[4096, 1024]],
                    "dtypes": ["BFloat16"],
                    "state": "started",
                    "seconds": 31.5,
                },
            }
        ],
        "groups_omitted": 0,
    },
    "notes": [],
}
"""What rank 1 answers when it is asked: its training thread waits in an all-reduce."""


def capture(clock: FakeClock, tmp: Path) -> dict[str, str]:
    settings = Settings(socket=tmp / "t.sock")
    gpus = [
        FakeGpu(uuid=f"GPU-0000000{i}-0000-0000-0000-000000000000", bus_id=f"00000000:1{i}:00.0")
        for i in range(2)
    ]
    ex = build_exporter(settings, nvml=FakeNvmlBackend(gpus))
    assert ex.gpus is not None and ex.gpus.open()
    ex.gpus.sample_once()
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(3)]
    conns = []
    for i, (a, _) in enumerate(pairs):
        c = Connection(a)
        c.peer_pid, c.peer_uid, c.peer_gid = 4000 + i, 1000, 1000
        conns.append(c)
    packets = []
    try:
        for index, data in session(clock):
            ex.ingest.handle_packet(conns[index], data)
            packets.append(data.hex())
            ex.store.check_conditions()
        clock.advance(1.0)
        ex.store.check_conditions()
        # Rank 1 hangs: 2 x its 0.3 s step + the 30 s grace pass; it is asked, it answers.
        clock.advance(31.0)
        for conn in conns[:2]:
            ex.ingest._conns[conn.fd] = conn  # the socket server's, as if it had accepted them
        ((hung, request_id),) = ask_hung(ex, ex.store.check_conditions())
        assert (hung.rank, hung.hang is not None) == (1, True)
        (request,) = P.decode_capture_requests(pairs[1][1].recv(P.MAX_PACKET_BYTES))
        assert request == P.CaptureRequest(request_id, settings.hang_capture_max_bytes)
        body = json.dumps(HUNG_CAPTURE, separators=(",", ":")).encode()
        answer = pkt(P.encode_capture(request_id, body))
        ex.ingest.handle_packet(conns[1], answer)
        packets.append(answer.hex())
        clock.advance(1.0)
        ex.store.check_conditions()
        budget = SampleBudget(ex.registry, settings.scrape_sample_limit)
        text = TextExposition().render(budget).decode()
        runs = snapshot(ex.store, ex.gpus.snapshot, settings.peak_flops)
        gpu_view = gpu_snapshot(ex.gpus.snapshot)
    finally:
        ex.gpus.stop()
        for a, b in pairs:
            a.close()
            b.close()
    lines = [ln for ln in text.splitlines() if not MASKED.match(ln)]
    gpus_json = gpu_view.model_dump(mode="json")
    gpus_json["sample_seconds"] = None  # this machine's time.perf_counter
    return {
        "session.exposition.txt": "\n".join(lines) + "\n",
        "session.runs.json": json.dumps(runs.model_dump(mode="json"), indent=1) + "\n",
        "session.gpus.json": json.dumps(gpus_json, indent=1) + "\n",
        "session.packets.hex": "\n".join(packets) + "\n",
    }


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr(time, "time", c.time)
    monkeypatch.setattr(time, "monotonic", c.monotonic)
    return c


def test_a_fixed_session_shows_exactly_the_golden_files(clock: FakeClock, tmp_path: Path) -> None:
    got = capture(clock, tmp_path)
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        for name, body in got.items():
            (GOLDEN / name).write_text(body)
    for name, body in got.items():
        want = (GOLDEN / name).read_text()
        assert body == want, f"{name} differs from tests/golden/{name}"
