"""Log lines are rate-limited per call site, so other processes cannot fill the disk."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import struct
from collections.abc import Callable

from trainmon_client import _protocol as P
from trainmon_exporter.logsetup import RepeatLimiter, suppressed_totals

from ..conftest import ExporterProcess, sample, wait_for


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _logger(limiter: RepeatLimiter) -> tuple[logging.Logger, list[str]]:
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Keep()
    handler.addFilter(limiter)
    log = logging.getLogger(f"test.limiter.{id(limiter)}")
    log.propagate = False
    log.addHandler(handler)
    return log, lines


def test_repeats_per_call_site_are_capped_and_then_summed_up() -> None:
    clock = FakeClock()
    limiter = RepeatLimiter(max_repeats=10, interval=60, clock=clock)
    log, lines = _logger(limiter)

    def refuse(run: str) -> None:
        log.warning("refused run %s", run)  # one call site, many values

    before = suppressed_totals()["warning"]
    for i in range(1000):
        refuse(f"r{i}")
    log.error("another call site")
    assert len(lines) == 11 and lines[9] == "refused run r9" and lines[10] == "another call site"
    assert suppressed_totals()["warning"] - before == 990
    assert limiter.pending() == 990
    clock.now += 59.9
    refuse("late")
    assert len(lines) == 11  # still inside the interval
    clock.now += 0.2
    refuse("next")
    assert lines[-1] == "refused run next [991 similar lines suppressed before this]"
    assert limiter.pending() == 0


def _flood(sock_path: str, n: int) -> None:
    """``n`` connections each sending an invalid HELLO: one log line each, unlimited."""
    bad = P.packet_header() + struct.pack("<BH", P.HELLO, 12) + b'{"run": "x"}'
    for _ in range(n):
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(sock_path)
            s.send(bad)


def test_a_flood_of_refusals_writes_a_bounded_log(
    exporter_process: Callable[..., ExporterProcess],
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TRAINMON_")}
    ex = exporter_process(
        "--ingest-poll-interval-seconds", "0", "--log-max-repeats", "5", env=env
    ).start()
    _flood(ex.socket, 2000)
    wait_for(
        lambda: (
            sample(ex.metrics(), "trainmon_ingest_messages_invalid_total", reason="bad_hello")
            == 2000
        ),
        timeout=60,
    )
    m = ex.metrics()
    assert sample(m, "trainmon_exporter_log_messages_suppressed_total", level="warning") == 1995
    assert sample(m, "trainmon_exporter_log_messages_suppressed_total", level="error") == 0
    out = ex.stop()
    assert out.count("refused HELLO") == 5, out[-2000:]
    assert "log lines were suppressed" in out  # the shutdown sums up the rest


LOG_LINE = re.compile(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ([\w.]+): .+"
)


def test_start_up_and_shutdown_lines_are_the_exporters_own(
    exporter_process: Callable[..., ExporterProcess],
) -> None:
    """No ``INFO uvicorn.error`` line: uvicorn's records are named ``uvicorn``, and its start
    and stop lines, which the banner and the exporter's own lines repeat, are DEBUG."""
    out = exporter_process().start().stop(signal.SIGTERM)
    lines = out.splitlines()
    assert lines[0].startswith("trainmon-exporter ") and "metrics on http://" in lines[0]
    logged = [LOG_LINE.fullmatch(line) for line in lines[1:]]
    assert all(logged), out  # every other line in the log format
    names = {m.group(2) for m in logged if m}
    assert "uvicorn.error" not in names and "uvicorn.error" not in out
    assert "Started server process" not in out and "Application startup" not in out
    assert any(line.endswith(" INFO uvicorn: Shutting down") for line in lines), out
    assert any("INFO trainmon_exporter.ingest: ingest listening on" in line for line in lines)

    debug = exporter_process("--log-level", "debug").start().stop(signal.SIGTERM)
    assert re.search(r" DEBUG uvicorn: Started server process \[\d+\]", debug), debug
    assert " DEBUG uvicorn: Application startup complete." in debug
