"""A trainer the exporter refuses is told why: the exporter sends a REFUSED packet before it
closes the connection, and the client keeps the reason and warns once with the fix."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from trainmon_client import _protocol as P
from trainmon_client._transport import REFUSAL_FIX_OTHER, REFUSAL_FIXES, Transport

from ..conftest import ExporterProcess, child_env, short_tmpdir, wait_for
from ..helpers.client import make_run

OTHER_UID = 43011  # a uid with no account: the kernel needs none to run a process as it


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "refused this run" in r.getMessage()
    ]


def test_a_duplicate_rank_is_told_why_once(
    exporter_process: Callable[..., ExporterProcess], caplog: pytest.LogCaptureFixture
) -> None:
    ex = exporter_process().start()
    first = make_run(ex.socket, run="dup", flush_interval=0.05)
    first.log(0, loss=1.0)
    wait_for(lambda: (k := ex_rank(ex, "dup")) and k["status"] == "running", timeout=20)
    caplog.set_level(logging.WARNING, logger="trainmon_client")
    second = make_run(ex.socket, run="dup", flush_interval=0.05)  # the same run and rank
    second.log(0, loss=1.0)
    wait_for(lambda: second.refused_reason == "duplicate_rank", timeout=10)
    # It keeps trying (the first may end), is refused again, and says so only once.
    deadline = time.monotonic() + 2.5
    step = 1
    while time.monotonic() < deadline:
        second.log(step, loss=1.0)
        step += 1
        time.sleep(0.01)
    assert second._sender.transport.refusals >= 2
    (message,) = _warnings(caplog)
    assert "(duplicate_rank: rank 0 of run 'dup' is already connected)" in message
    assert "give each process its own rank" in message
    assert first.refused_reason is None and first.connected
    second.finish()
    first.finish()
    assert second.dropped["disconnected"] + second.dropped["in_flight"] >= 1
    assert first.dropped["in_flight"] == first.dropped["disconnected"] == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a trainer as another uid")
def test_another_users_run_id_is_told_not_owner(
    exporter_process: Callable[..., ExporterProcess],
) -> None:
    d = short_tmpdir()
    d.chmod(0o755)
    ex = exporter_process("--socket-mode", "0666", socket_dir=d).start()
    owner = make_run(ex.socket, run="taken", flush_interval=0.05)  # this process: root's run
    owner.log(0, loss=1.0)
    wait_for(lambda: ex_rank(ex, "taken") is not None, timeout=20)
    code = textwrap.dedent(
        f"""
        import os, sys, time
        import trainmon_client
        os.setgroups([]); os.setgid({OTHER_UID}); os.setuid({OTHER_UID})
        run = trainmon_client.init(run="taken", socket_path={ex.socket!r}, flush_interval=0.05)
        run.log(0, loss=1.0)
        deadline = time.monotonic() + 10
        while run.refused_reason is None and time.monotonic() < deadline:
            time.sleep(0.02)
        print(run.refused_reason)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        cwd=Path(__file__).resolve().parents[2],
    )
    owner.finish()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "not_owner", proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "refused this run" in line]
    assert lines == [
        f"trainmon: the exporter at {ex.socket} refused this run (not_owner: run id 'taken' "
        "belongs to another user); pick another run id with init(run=...) or TRAINMON_RUN"
    ], proc.stderr


def ex_rank(ex: ExporterProcess, run: str) -> dict[str, object] | None:
    for r in ex.runs()["runs"]:
        if r["run"] == run:
            return r["ranks"][0]  # type: ignore[no-any-return]
    return None


def test_the_refused_record_round_trip_and_an_unknown_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    packet = P.encode_refused("uid_quota", "at most 64 connections per uid\n\x1b[31m")
    assert P.decode_refused(packet) == P.Refusal("uid_quota", "at most 64 connections per uid[31m")
    assert P.decode_refused(P.encode_refused("x", "é" * 200)).detail == "é" * 128  # 256 bytes
    assert P.decode_refused(P.packet_header() + P.encode_finish(0, 1.0)) is None
    assert P.decode_refused(b"TM\x02\x00" + packet[4:]) is None  # another version: ignored
    assert P.decode_refused(packet[:-40] + b"\x00") is None  # cut short
    with pytest.raises(ValueError):
        P.encode_refused("Not A Token")
    assert P.REFUSED not in P.RECORD_NAMES  # never sent by a client
    caplog.set_level(logging.WARNING, logger="trainmon_client")
    t = Transport("/nonexistent.sock", run_id="r", rank=3)
    t._refused(P.Refusal("brand_new_reason", ""))
    t._refused(P.Refusal("brand_new_reason", ""))
    assert _warnings(caplog) == [
        f"trainmon: the exporter at /nonexistent.sock refused this run (brand_new_reason); "
        f"{REFUSAL_FIX_OTHER}"
    ]
    assert t.refusals == 2 and "duplicate_rank" in REFUSAL_FIXES
