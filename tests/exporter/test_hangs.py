"""A rank judged hung is asked for its evidence, and the exporter exports where it is.

The real app (lifespan, detector clock, ingest socket) with real clients and hand-made
packets: the request goes out on the hung rank's own connection when the hang episode
starts, the answer is checked and bounded, and ``trainmon_hang_frame_info`` and
``trainmon_hang_collective_sequence`` exist only while the rank is hung.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from trainmon_client import _protocol as P
from trainmon_exporter.native import find_py_spy, py_spy_dump
from trainmon_exporter.settings import AnalyticsSettings
from trainmon_exporter.state.evidence import NO_ANSWER_FRAME

from ..conftest import InProcessExporter, child_env, connect, raw_connect, sample, wait_for
from ..helpers.exporter import hello, pkt, step, store_of

FAST = AnalyticsSettings(hang_grace_seconds=1.0, min_history_steps=5)
"""Hung 1 s after twice the usual step time, judged after 5 steps (a loaded machine can
stall a trainer or the exporter for half a second: no hang episode for that)."""


def _series(ex: InProcessExporter, name: str) -> list[dict[str, str]]:
    return [dict(labels) for (n, labels), _ in ex.metrics().items() if n == name]


def _count(ex: InProcessExporter, name: str, **labels: str) -> float:
    return sample(ex.metrics(), name, **labels) or 0.0


def load_batch(release: threading.Event) -> None:
    """The data loader of the test's trainer: it waits for a batch that does not come."""
    release.wait(30)


def _trainer(ex: InProcessExporter, release: threading.Event, run: str) -> threading.Thread:
    def train() -> None:
        r = connect(ex, run, flush_interval=0.05)
        for i in range(10):
            r.log(i, loss=1.0)
            time.sleep(0.02)
        load_batch(release)
        r.log(10, loss=1.0)  # it recovers
        time.sleep(0.3)
        r.finish()

    t = threading.Thread(target=train, name="trainer", daemon=True)
    t.start()
    return t


def test_a_hung_rank_is_asked_once_and_its_frame_exported_only_while_hung(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    ex = make_exporter(analytics=FAST)
    release = threading.Event()
    t = _trainer(ex, release, "stuck")
    try:
        (frame,) = wait_for(lambda: _series(ex, "trainmon_hang_frame_info"), timeout=20)
        line = load_batch.__code__.co_firstlineno + 2
        assert frame == {
            "run": "stuck",
            "rank": "0",
            "frame": f"load_batch (test_hangs.py:{line})",
            "collective": "",
        }
        assert _count(ex, "trainmon_hang_capture_requests_total") == 1
        assert _count(ex, "trainmon_hang_captures_total", result="captured") == 1
        assert 0 < _count(ex, "trainmon_hang_evidence_bytes") <= 32768
        assert _series(ex, "trainmon_hang_collective_sequence") == []  # no torch.distributed
        time.sleep(1.0)  # still hung: not asked again
        assert _count(ex, "trainmon_hang_capture_requests_total") == 1
    finally:
        release.set()
        t.join(10)
    wait_for(lambda: not _series(ex, "trainmon_hang_frame_info"), timeout=10)
    # The evidence outlives the episode (the views keep showing it); only the series went.
    assert _count(ex, "trainmon_hang_evidence_bytes") > 0


def test_a_long_checkpoint_save_is_no_hang_and_asks_for_nothing(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    ex = make_exporter(analytics=AnalyticsSettings(hang_grace_seconds=1.5, min_history_steps=5))
    r = connect(ex, "saving", flush_interval=0.05)
    for i in range(10):
        r.log(i, loss=1.0)
        time.sleep(0.02)
    with r.track("checkpoint"):
        time.sleep(5.0)  # three times the hang limit, inside a tracked operation
    r.log(10, loss=1.0)
    time.sleep(0.3)
    assert _count(ex, "trainmon_hang_capture_requests_total") == 0
    assert sample(ex.metrics(), "trainmon_train_hangs_total", run="saving", rank="0") == 0
    r.finish()


def _raw_rank(ex: InProcessExporter, rank: int) -> socket.socket:
    s = raw_connect(ex.socket)
    s.send(pkt(hello(run="raw", rank=rank, world_size=2, local_rank=rank)))
    for n in range(8):
        s.send(pkt(step(n)))
        time.sleep(0.01)
    return s


def _request(s: socket.socket, timeout: float = 15) -> P.CaptureRequest:
    s.settimeout(timeout)
    (request,) = P.decode_capture_requests(s.recv(P.MAX_PACKET_BYTES))
    return request


def _answer(request_id: int, body: dict[str, Any] | bytes) -> bytes:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return pkt(P.encode_capture(request_id, raw))


BODY = {
    "threads": [
        {
            "name": "MainThread",
            "id": 1,
            "training": True,
            "frames": [["/job/train.py", 40, "main", True], ["/job/train.py", 12, "step", True]],
        }
    ],
    "collectives": {
        "state": "ok",
        "groups": [
            {
                "id": "0",
                "name": "default_pg",
                "enqueued": 8,
                "started": -1,
                "completed": 7,
                "pending": {"seq": 8, "op": "gloo:all_reduce", "sizes": [[1000]]},
            }
        ],
    },
}


def test_a_rank_answers_only_its_own_request_and_only_within_bounds(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    ex = make_exporter(analytics=FAST, hang_capture_max_bytes=2048)
    a, b = _raw_rank(ex, 0), _raw_rank(ex, 1)
    ra, rb = _request(a), _request(b)
    assert ra.max_bytes == rb.max_bytes == 2048 and ra.request_id != rb.request_id
    b.send(_answer(ra.request_id, BODY))  # rank 1 answers rank 0's request: not its own
    b.send(_answer(rb.request_id, {"threads": [{"frames": [["x", "not a line", "f", True]]}]}))
    b.send(_answer(rb.request_id, b'{"notes": ["' + b"x" * 3000 + b'"]}'))
    a.send(_answer(ra.request_id, BODY))
    wait_for(lambda: _count(ex, "trainmon_hang_captures_total", result="captured") == 1)
    assert _count(ex, "trainmon_hang_evidence_dropped_total", reason="unsolicited") == 1
    assert _count(ex, "trainmon_hang_evidence_dropped_total", reason="invalid") == 1
    assert _count(ex, "trainmon_hang_evidence_dropped_total", reason="too_large") == 1
    (frame,) = _series(ex, "trainmon_hang_frame_info")
    assert frame == {
        "run": "raw",
        "rank": "0",
        "frame": "step (train.py:12)",
        "collective": "gloo:all_reduce",
    }
    sequences = {
        (s["rank"], s["group"], s["state"])
        for s in _series(ex, "trainmon_hang_collective_sequence")
    }
    assert sequences == {("0", "0", "enqueued"), ("0", "0", "completed")}  # no started: -1
    b.send(_answer(rb.request_id, BODY))
    wait_for(lambda: _count(ex, "trainmon_hang_captures_total", result="captured") == 2)
    b.send(_answer(rb.request_id, BODY))  # once only
    wait_for(lambda: _count(ex, "trainmon_hang_evidence_dropped_total", reason="unsolicited") == 2)
    assert _count(ex, "trainmon_ingest_messages_total", type="capture") == 2
    a.close()
    b.close()


def test_a_rank_that_never_answers_is_named_so_and_a_late_answer_still_counts(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    ex = make_exporter(analytics=FAST, hang_capture_timeout_seconds=1)
    a = _raw_rank(ex, 0)
    request = _request(a)
    (frame,) = wait_for(lambda: _series(ex, "trainmon_hang_frame_info"), timeout=10)
    assert frame["frame"] == NO_ANSWER_FRAME and frame["collective"] == ""
    assert _count(ex, "trainmon_hang_captures_total", result="no_answer") == 1
    a.send(_answer(request.request_id, BODY))
    wait_for(lambda: _count(ex, "trainmon_hang_captures_total", result="captured") == 1)
    assert _count(ex, "trainmon_hang_captures_total", result="no_answer") == 0
    (frame,) = _series(ex, "trainmon_hang_frame_info")
    assert frame["frame"] == "step (train.py:12)"
    a.close()


def test_capture_off_asks_nothing(make_exporter: Callable[..., InProcessExporter]) -> None:
    ex = make_exporter(analytics=FAST, hang_capture=False)
    a = _raw_rank(ex, 0)
    wait_for(lambda: sample(ex.metrics(), "trainmon_train_hung", run="raw", rank="0") == 1)
    a.settimeout(0.5)
    with pytest.raises(TimeoutError):
        a.recv(P.MAX_PACKET_BYTES)
    assert _count(ex, "trainmon_hang_capture_requests_total") == 0
    a.close()


def _captured(store: Any, state: Any, size: int) -> bool:
    request_id = store.begin_capture(state)
    half = (size - 19) // 2  # two notes of at most 1,024 characters each
    body = {"notes": ["x" * half, "y" * (size - 19 - half)]}
    raw = json.dumps(body).encode()
    assert len(raw) == size
    with store.lock:
        return bool(store.observe_capture(state, P.Capture(request_id, body, len(raw))))


def test_the_evidence_of_the_whole_exporter_is_bounded_hung_ranks_first() -> None:
    store = store_of(evidence_max_bytes=3000, capture_max_bytes=2000)
    states = []
    for rank in range(3):
        s = store.attach({**json.loads(hello(rank=rank, world_size=3)[3:]), "pid": 10 + rank})
        assert not isinstance(s, str)
        states.append(s)
    for s in states:
        s.analytics.hung = True
    assert _captured(store, states[0], 1400) and _captured(store, states[1], 1400)
    assert store.hangs.bytes == 2800
    assert not _captured(store, states[2], 1400)  # every byte is held by a hung rank
    assert store.hangs.dropped["budget"] == 1
    assert states[2].hang is not None and "hang_evidence_max_bytes" in states[2].hang.note
    states[0].analytics.hung = False  # rank 0 recovered: its evidence may go, oldest first
    assert _captured(store, states[2], 1400)
    assert store.hangs.dropped["evicted"] == 1 and states[0].hang is None
    assert store.hangs.bytes == 2800
    store._remove(states[1])  # an expired rank takes its evidence's bytes with it
    assert store.hangs.bytes == 1400


NATIVE = """
import ctypes, ctypes.util, sys, time
import trainmon_client
run = trainmon_client.init(run="native", socket_path=sys.argv[1], flush_interval=0.05)
for i in range(10):
    run.log(i, loss=1.0)
    time.sleep(0.02)
def decode_in_c():
    ctypes.PyDLL(ctypes.util.find_library("c")).sleep(4)  # holds the GIL for 4 s
def after_the_call():
    time.sleep(3)  # still no step: the rank is still hung
decode_in_c()
after_the_call()
run.log(10, loss=1.0)
time.sleep(0.5)
run.finish()
"""


def test_native_code_holding_the_gil_is_said_and_the_late_answer_taken_while_hung(
    make_exporter: Callable[..., InProcessExporter], tmp_path: Any
) -> None:
    """The flusher cannot run while a C call holds the GIL: no answer, said so; once the call
    returns, with the rank still hung, its answer comes late and is taken."""
    slow_grace = AnalyticsSettings(hang_grace_seconds=1.0, min_history_steps=5)
    ex = make_exporter(analytics=slow_grace, hang_capture_timeout_seconds=1)
    script = tmp_path / "native.py"
    script.write_text(NATIVE)
    p = subprocess.Popen([sys.executable, str(script), ex.socket], env=child_env())

    def frames(start: str) -> list[dict[str, str]]:
        return [f for f in _series(ex, "trainmon_hang_frame_info") if f["frame"].startswith(start)]

    try:
        wait_for(lambda: frames(NO_ANSWER_FRAME), timeout=20)
        hang = (ex.rank("native", 0) or {})["hang"]
        assert hang["status"] == "no_answer" and "may hold the GIL" in hang["notes"][0]
        wait_for(lambda: frames("after_the_call (native.py:"), timeout=20)
        hang = (ex.rank("native", 0) or {})["hang"]
        assert hang["status"] == "captured" and hang["threads"][0]["training"]
        assert _count(ex, "trainmon_hang_captures_total", result="captured") >= 1
    finally:
        assert p.wait(30) == 0


def test_a_late_answer_after_the_rank_stepped_again_is_not_kept() -> None:
    store = store_of()
    s = store.attach({**json.loads(hello()[3:])})
    assert not isinstance(s, str)
    request_id = store.begin_capture(s, now_mono=0.0)
    assert store.expire_captures(1.0, now_mono=2.0) == [s]
    body = {"notes": []}
    record = P.Capture(request_id, body, 12)
    with store.lock:  # it stepped again (not hung) before the answer came
        assert not store.observe_capture(s, record)
    assert store.hangs.dropped["late"] == 1 and s.hang is not None
    assert s.hang.status == "no_answer" and "not kept" in s.hang.note
    request_id = store.begin_capture(s, now_mono=10.0)
    store.expire_captures(1.0, now_mono=12.0)
    s.analytics.hung = True  # still hung when it comes: taken
    with store.lock:
        assert store.observe_capture(s, P.Capture(request_id, body, 12))
    assert s.hang.status == "captured" and store.hangs.results["no_answer"] == 1


SLEEPER = """
import sys, time
import trainmon_client
run = trainmon_client.init(run="spied", socket_path=sys.argv[1], flush_interval=0.05)
for i in range(10):
    run.log(i, loss=1.0)
    time.sleep(0.02)
def load_batch():
    time.sleep(30)
load_batch()
"""


def test_native_stacks_come_from_py_spy_where_the_exporter_may_ptrace(
    make_exporter: Callable[..., InProcessExporter], tmp_path: Any
) -> None:
    """``hang_native_stacks``: py-spy reads the hung rank's process from outside, C frames too."""
    if find_py_spy() is None:
        pytest.skip("py-spy is not installed")
    ex = make_exporter(analytics=FAST, hang_native_stacks=True)
    script = tmp_path / "spied.py"
    script.write_text(SLEEPER)
    p = subprocess.Popen([sys.executable, str(script), ex.socket], env=child_env())
    try:

        def native() -> str | None:
            hang = (ex.rank("spied", 0) or {}).get("hang") or {}
            return hang.get("native") or next(
                (n for n in hang.get("notes", []) if n.startswith("native stacks")), None
            )

        text = wait_for(native, timeout=30)
    finally:
        p.kill()
        p.wait(10)
    if text.startswith("native stacks: py-spy failed"):
        pytest.skip(f"no ptrace here: {text}")
    assert f"Process {p.pid}" in text and "load_batch (" in text and "clock_nanosleep" in text
    assert _count(ex, "trainmon_hang_evidence_bytes") >= len(text.encode())  # in the bound


def test_py_spy_reads_only_a_process_of_the_runs_owner() -> None:
    text, note = py_spy_dump(os.getpid(), os.getuid() + 1, 1000)
    assert text is None and "not the run's uid" in note
    assert py_spy_dump(None, 0, 1000)[1].endswith("(SO_PEERCRED)")
    assert "not visible" in py_spy_dump(2**22 + 12345, None, 1000)[1]
