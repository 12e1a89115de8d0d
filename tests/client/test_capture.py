"""A hung rank tells the exporter where it is: stacks and collective state, on request.

The exporter sends a CAPTURE_REQUEST on the rank's connection; the flusher thread answers with
a CAPTURE record, whatever the training thread is doing: waiting in a C call that released
the GIL, or spinning in Python. Real sockets, real threads; torch's Flight Recorder in a real
(one-rank) gloo process group.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from trainmon_client import _capture
from trainmon_client import _protocol as P

from ..conftest import child_env, free_port, wait_for
from ..helpers.client import Listener, make_run


def _blocked_in_c(ready: threading.Event, peer: socket.socket) -> None:
    """A data loader waiting for its next batch: a C call that released the GIL."""
    ready.set()
    peer.recv(1)


def _spinning(ready: threading.Event, stop: list[bool]) -> None:
    """A loop of pure Python that holds the GIL between switch intervals."""
    ready.set()
    n = 0
    while not stop[0]:
        n += 1


@pytest.fixture
def blocked() -> Iterator[threading.Thread]:
    a, b = socket.socketpair()
    ready = threading.Event()
    t = threading.Thread(target=_blocked_in_c, args=(ready, a), name="trainer", daemon=True)
    t.start()
    ready.wait(5)
    time.sleep(0.05)  # inside recv() by now
    yield t
    b.send(b"x")
    t.join(5)
    a.close()
    b.close()


def _thread(body: dict[str, Any], ident: int | None) -> dict[str, Any]:
    return next(t for t in body["threads"] if t["id"] == ident)


def test_the_stack_of_a_thread_blocked_in_a_c_call(blocked: threading.Thread) -> None:
    idle = threading.Event()
    other = threading.Thread(target=idle.wait, args=(10,), name="other", daemon=True)
    other.start()
    try:
        body = json.loads(_capture.capture(blocked.ident, 32768))
    finally:
        idle.set()
    first = body["threads"][0]
    assert first["id"] == blocked.ident and first["training"] and first["name"] == "trainer"
    *_, (file, line, function, user) = first["frames"]
    assert file == __file__ and function == "_blocked_in_c" and user is True
    assert line == _blocked_in_c.__code__.co_firstlineno + 3
    assert first["state"] == "S" and first["cpu"] is not None and first["cpu"] < 0.2
    # Every other thread is there too (this one, the caller, is not), none marked training.
    assert _thread(body, other.ident)["name"] == "other"
    assert not _thread(body, other.ident)["training"]
    assert threading.get_ident() not in [t["id"] for t in body["threads"]]
    assert body["collectives"] is None or "torch.distributed" in sys.modules
    assert 0 < body["seconds"] < 5 and body["notes"] == []


def test_the_stack_of_a_thread_that_spins_in_python_holding_the_gil() -> None:
    ready, stop, idle = threading.Event(), [False], threading.Event()
    t = threading.Thread(target=_spinning, args=(ready, stop), daemon=True)
    asleep = threading.Thread(target=idle.wait, args=(10,), daemon=True)
    t.start()
    asleep.start()
    ready.wait(5)
    try:
        body = json.loads(_capture.capture(t.ident, 32768))
    finally:
        stop[0] = True
        idle.set()
        t.join(5)
    first = body["threads"][0]
    assert first["training"] and first["frames"][-1][2] == "_spinning"
    # It ran while the capture slept (a share of a core the machine's load decides), the
    # sleeping thread did not.
    assert first["cpu"] is not None and first["cpu"] > 0
    assert _thread(body, asleep.ident)["cpu"] == 0


def test_library_frames_are_not_the_users() -> None:
    import json as stdlib_module

    import pytest as site_package

    assert _capture.is_user(__file__)
    assert _capture.is_user("train.py") and _capture.is_user("<string>")
    assert not _capture.is_user(stdlib_module.__file__)
    assert not _capture.is_user(site_package.__file__)
    assert not _capture.is_user(_capture.__file__)  # trainmon's own (an editable install too)
    assert not _capture.is_user("<frozen importlib._bootstrap>")
    assert not _capture.is_user("/opt/x/lib/python3.11/dist-packages/torch/nn/module.py")


def _deep(n: int, ready: threading.Event, done: threading.Event) -> None:
    if n:
        _deep(n - 1, ready, done)
    else:
        ready.set()
        done.wait(10)


def test_an_answer_is_cut_to_the_bytes_asked_for_and_says_so() -> None:
    ready, done = threading.Event(), threading.Event()
    deep = threading.Thread(target=_deep, args=(300, ready, done), daemon=True)
    others = [
        threading.Thread(target=_deep, args=(60, threading.Event(), done), daemon=True)
        for _ in range(20)
    ]
    for t in [deep, *others]:
        t.start()
    ready.wait(5)
    time.sleep(0.1)
    try:
        whole = json.loads(_capture.capture(deep.ident, P.MAX_CAPTURE_BYTES))
        raw = _capture.capture(deep.ident, 8000)
    finally:
        done.set()
    first = whole["threads"][0]
    assert len(first["frames"]) == _capture.MAX_FRAMES and first["omitted"] > 170
    assert len(raw) <= 8000
    cut = json.loads(raw)
    training = cut["threads"][0]
    assert training["training"] and [f[2] for f in training["frames"] if f[3]][-1] == "_deep"
    assert training["omitted"] + len(training["frames"]) == first["omitted"] + _capture.MAX_FRAMES
    assert cut["threads_omitted"] > 0 or all(not t["frames"] for t in cut["threads"][1:])
    assert any("cut to fit" in n for n in cut["notes"])
    tiny = json.loads(_capture.capture(deep.ident, 120))
    assert "did not fit" in tiny["notes"][0]


def _request(conn: socket.socket, request_id: int, max_bytes: int = 32768) -> float:
    conn.send(P.encode_capture_request(request_id, max_bytes))
    return time.monotonic()


def _captures(listener: Listener, timeout: float) -> list[P.Capture]:
    out = []
    for rtype, rec in listener.records(timeout):
        if rtype == P.CAPTURE:
            out.append(rec)
    return out


@pytest.mark.parametrize("interval", [0.5, 0.0, 30.0])
def test_a_request_is_answered_by_the_flusher_within_a_second_or_so(
    listener: Listener, blocked: threading.Thread, interval: float
) -> None:
    """With any flush interval: the flusher looks for requests at least every second."""
    run = make_run(str(listener.path), run="cap", flush_interval=interval)
    try:
        # The training thread is the one that logs (here: the test's), noted at its first step.
        run.log(0, loss=1.0)
        conn = listener.accept()
        listener.records(0.3)
        sent = _request(conn, 77)
        (answer,) = wait_for(lambda: _captures(listener, 0.2), timeout=5, interval=0)
        took = time.monotonic() - sent
        assert answer.request_id == 77
        assert answer.fields["threads"][0]["id"] == threading.get_ident()
        assert answer.fields["threads"][0]["training"]
        assert any(t["name"] == "trainer" for t in answer.fields["threads"])
        assert took < P_LIMIT, took
        assert run._captures_sent == 1 and run._internal_errors == 0
        # No TOTALS, no data record: the run's delivery counts do not move.
        assert run.sent == 1 and sum(run.dropped.values()) == 0
    finally:
        run.finish()


P_LIMIT = 3.0
"""Seconds an answer may take under load: the flusher's poll (1 s), the CPU sample (0.1 s)."""


def test_a_slow_capture_never_holds_the_runs_lock(
    listener: Listener, blocked: threading.Thread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a capture samples, the run's calls that take its lock return at once."""
    monkeypatch.setattr(_capture, "CPU_SAMPLE_S", 1.5)
    run = make_run(str(listener.path), run="slow", flush_interval=0.05)
    try:
        run.log(0, loss=1.0)
        conn = listener.accept()
        listener.records(0.2)
        _request(conn, 1)
        time.sleep(0.5)  # the flusher is inside the capture's sample now
        t0 = time.perf_counter()
        run.eval(0, val_loss=1.0)
        run.checkpoint(0, seconds=1.0)
        assert time.perf_counter() - t0 < 0.5
        (answer,) = wait_for(lambda: _captures(listener, 0.2), timeout=10, interval=0)
        assert answer.request_id == 1
    finally:
        run.finish()


def test_requests_are_read_only_while_the_connection_lives_and_bounded(
    listener: Listener,
) -> None:
    run = make_run(str(listener.path), run="many", flush_interval=0.05)
    try:
        run.log(0, loss=1.0)
        conn = listener.accept()
        listener.records(0.2)
        for i in range(10):  # a flood: one capture a second at most, for the newest
            _request(conn, i, 2000)
        t0 = time.monotonic()
        answers: list[P.Capture] = []
        while time.monotonic() - t0 < 3.0:
            answers += _captures(listener, 0.2)
        ids = [a.request_id for a in answers]
        assert 1 <= len(ids) <= 4 and ids[-1] == 9 and ids == sorted(set(ids)), ids
        assert all(a.size <= 2000 for a in answers)
        assert run._captures_sent == len(ids) and run._captures_dropped == 10 - len(ids)
    finally:
        run.finish()


FR_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    from trainmon_client import _capture
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    t = torch.ones(3, 5)
    for _ in range(3):
        dist.all_reduce(t)
    print(_capture.capture(None, 32768).decode())
    dist.destroy_process_group()
    """
)


@pytest.mark.parametrize("buffer", [None, "0"])
def test_the_flight_recorder_of_a_gloo_group(buffer: str | None) -> None:
    """torch.distributed in use: the recorder's sequence ids, or why there are none."""
    pytest.importorskip("torch.distributed")
    env = child_env()
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    if buffer is not None:
        env["TORCH_FR_BUFFER_SIZE"] = buffer
    out = subprocess.run(
        [sys.executable, "-c", FR_SCRIPT, str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    body = json.loads(out.stdout.strip().splitlines()[-1])
    c = body["collectives"]
    if buffer == "0":
        assert c["state"] == "recorder_off" and "TORCH_FR_BUFFER_SIZE" in c["detail"]
        assert c["groups"] == [] and any("Flight Recorder is off" in n for n in body["notes"])
        return
    assert c["state"] == "ok", c
    (group,) = c["groups"]
    assert group["id"] == "0" and group["name"] == "default_pg"
    assert group["enqueued"] == group["completed"] == 3 and group["started"] == -1
    assert group["pending"] is None
