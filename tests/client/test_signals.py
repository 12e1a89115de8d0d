"""Every entry point of the client is safe in a signal handler: a handler that logs or finishes
while the training thread is inside the run never deadlocks it; at worst its call is dropped
and counted (``dropped["reentrant"]``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from trainmon_client import _protocol as P

from ..conftest import InProcessExporter, wait_for
from ..helpers.client import Listener, make_run, steps_of

ROOT = Path(__file__).resolve().parents[2]

# A trainer whose 2 kHz timer logs from its signal handler and finishes the run after 4000
# ticks, while the main loop logs as fast as it can (flush_interval 0: every log() wakes the
# flusher), evaluates and tracks operations (which hold the run's lock).
TRAINER = textwrap.dedent(
    """
    import json, signal, sys
    import trainmon_client

    run = trainmon_client.init(run="sig", socket_path=sys.argv[1], rank=0, world_size=1,
                               local_rank=0, flush_interval=0.0)
    ticks = handler_logs = 0

    def on_tick(signum, frame):
        global ticks, handler_logs
        ticks += 1
        if run.closed:
            return
        handler_logs += 1
        run.log(10**9 + ticks, tick=float(ticks), flag=True)  # a bool: the locked path
        if ticks == 4000:
            run.finish()

    signal.signal(signal.SIGALRM, on_tick)
    signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)
    logs = evals = tracks = i = 0
    while not run.closed:
        logs += 1
        run.log(i, loss=1.0 / (i + 1), tokens=16)
        if i % 50 == 0:
            evals += 1
            run.eval(i, val_loss=1.0)
        if i % 97 == 0:
            tracks += 1
            with run.track("sampling"):
                pass
        i += 1
    signal.setitimer(signal.ITIMER_REAL, 0.0)
    print(json.dumps({"expected": logs + evals + 2 * tracks + handler_logs,
                      "handler_logs": handler_logs, "sent": run.sent, "dropped": run.dropped,
                      "internal_errors": run.internal_errors}))
    """
)


def test_a_2khz_timer_that_logs_and_finishes_never_deadlocks(exporter: InProcessExporter) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'client/src'}"}
    proc = subprocess.run(
        [sys.executable, "-c", TRAINER, exporter.socket],
        capture_output=True,
        text=True,
        timeout=90,  # a deadlock hangs here: the timer keeps firing into a stuck process
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    dropped = out["dropped"]
    accounted = out["sent"] + sum(v for k, v in dropped.items() if k != "in_flight")
    # Every call made while the run was open is sent or counted; the one the loop made as
    # the handler finished the run (at most a track's two records) is neither.
    assert accounted <= out["expected"] <= accounted + 2, out
    assert dropped["reentrant"] > 0, out  # handler calls that met the loop's eval() or track()
    assert dropped["disconnected"] == 0, out  # backpressure: the loop outruns any reader
    assert out["handler_logs"] >= 4000 and out["internal_errors"] == 0, out
    wait_for(lambda: (k := exporter.rank("sig", 0)) and k["status"] == "finished")


class _Interrupting:
    """A value whose conversion raises a signal: its handler runs inside the run's lock."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def __float__(self) -> float:
        signal.raise_signal(self.signum)
        return 2.0


@pytest.fixture
def on_sigusr1() -> Any:
    previous = signal.getsignal(signal.SIGUSR1)
    calls: list[Any] = []

    def install(handler: Any) -> list[Any]:
        def wrapped(signum: int, frame: Any) -> None:
            calls.append(handler())

        signal.signal(signal.SIGUSR1, wrapped)
        return calls

    yield install
    signal.signal(signal.SIGUSR1, previous)


def test_a_handler_inside_the_lock_drops_its_calls_and_defers_finish(
    listener: Listener, on_sigusr1: Any
) -> None:
    run = make_run(listener.path, flush_interval=60.0)

    def handler() -> None:
        run.log(100, flag=True)  # needs the lock this thread holds: dropped, counted
        run.eval(100, val_loss=1.0)
        run.checkpoint(100, seconds=1.0)
        run.track("sampling").start()
        run.log(101, loss=0.5)  # plain numbers take no lock: queued as usual
        run.finish()  # deferred until the interrupted call leaves the run

    calls = on_sigusr1(handler)
    run.log(0, loss=1.0)
    wait_for(lambda: run.connected)
    listener.accept()
    run.log(1, value=_Interrupting(signal.SIGUSR1))  # the handler runs inside snapshot()
    assert calls == [None]
    assert run.closed  # the deferred finish ran before log() returned
    assert run.dropped["reentrant"] == 4
    recs = listener.records(1.0)
    assert [h.step for h, _, _ in steps_of(recs)] == [0, 101, 1]
    assert recs[-1][0] == P.FINISH and recs[-1][1][0] == P.FINISH_OK
    run.log(2, loss=1.0)  # closed: nothing queued, nothing counted
    assert run.dropped["reentrant"] == 4
