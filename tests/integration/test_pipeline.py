"""End to end with real processes: the example trainer, torchrun, kill -9, 8 ranks at once."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ..conftest import ExporterProcess, child_env, run_trainer, sample, wait_for
from ..helpers.training import finished_output, ranks_of, torchrun, trainer

pytestmark = pytest.mark.slow


def test_real_training_run_reaches_metrics(
    exporter_process: Callable[..., ExporterProcess],
) -> None:
    ex = exporter_process().start()
    p = trainer(ex.socket, "--steps", "60", "--run", "e2e", "--inject-nan-at", "30")
    out, _ = p.communicate(timeout=180)
    assert p.returncode == 0, out
    m = ex.metrics()
    lbl = {"run": "e2e", "rank": "0"}
    assert sample(m, "trainmon_train_steps_total", **lbl) == 60
    assert sample(m, "trainmon_train_tokens_total", **lbl) == 60 * 8 * 32
    assert sample(m, "trainmon_train_nonfinite_values_total", field="loss", **lbl) == 1
    loss = sample(m, "trainmon_train_loss", **lbl)
    assert loss is not None and 0 < loss < 5.6  # it learned something from ln(256) = 5.55
    assert sample(m, "trainmon_run_up", **lbl) == 0
    assert ranks_of(ex, "e2e")[0]["status"] == "finished"
    assert sample(m, "trainmon_client_dropped_messages_total", reason="disconnected", **lbl) == 0


def test_torchrun_two_ranks_are_separate_series(
    exporter_process: Callable[..., ExporterProcess],
) -> None:
    ex = exporter_process().start()
    # As the README launches it: --standalone makes up a UUID for the rendezvous id.
    p = torchrun(ex.socket, ["--standalone", "--nproc-per-node=2"], "--steps", "30")
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0, out
    runs = ex.runs()["runs"]
    assert len(runs) == 1, runs  # both ranks agreed on the run id
    assert re.fullmatch(r"train_char_transformer-[0-9a-f]{8}", runs[0]["run"]), runs[0]["run"]
    ranks = runs[0]["ranks"]
    assert [(r["rank"], r["world_size"], r["status"]) for r in ranks] == [
        (0, 2, "finished"),
        (1, 2, "finished"),
    ]
    assert all(r["steps_total"] == 30 for r in ranks)
    m = ex.metrics()
    run = runs[0]["run"]
    assert sample(m, "trainmon_train_steps_total", run=run, rank="1") == 30


def test_exporter_killed_and_restarted_mid_run(
    exporter_process: Callable[..., ExporterProcess],
) -> None:
    ex = exporter_process().start()
    p = trainer(ex.socket, "--steps", "0", "--run", "survivor")
    try:
        wait_for(lambda: ranks_of(ex, "survivor"), timeout=60)
        ex.stop(signal.SIGKILL)  # no cleanup: the socket file stays behind
        assert Path(ex.socket).exists()
        time.sleep(1.5)  # the trainer keeps training, dropping and counting
        assert p.poll() is None
        ex.start()
        r = wait_for(
            lambda: (k := ranks_of(ex, "survivor")) and k[0]["steps_total"] > 5 and k[0], timeout=30
        )
        assert r["up"] and r["status"] == "running"
        # Totals are cumulative on the wire: nothing from before the restart is lost.
        assert r["steps_total"] >= r["step"] > 0
        assert r["dropped"]["disconnected"] > 0
    finally:
        p.send_signal(signal.SIGINT)  # the example finishes cleanly on Ctrl-C
        out = finished_output(p, timeout=60)
    assert p.returncode == 0, out
    assert "Traceback" not in out
    wait_for(lambda: ranks_of(ex, "survivor")[0]["status"] == "finished")


def test_trainer_killed_is_a_crash(exporter_process: Callable[..., ExporterProcess]) -> None:
    ex = exporter_process().start()
    p = trainer(ex.socket, "--steps", "0", "--run", "victim")
    wait_for(lambda: (k := ranks_of(ex, "victim")) and k[0]["steps_total"] > 2, timeout=60)
    p.kill()
    p.communicate(timeout=30)
    r = wait_for(lambda: (k := ranks_of(ex, "victim")) and k[0]["status"] == "crashed" and k[0])
    assert r["up"] is False and r["crashes"] == 1
    assert sample(ex.metrics(), "trainmon_run_crashes_total", run="victim", rank="0") == 1


def test_uncaught_exception_is_a_failure(
    exporter_process: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    ex = exporter_process().start()
    out = run_trainer(
        tmp_path / "boom.py",
        "import trainmon_client\n"
        "run = trainmon_client.init(run='boom')\n"
        "run.log(0, loss=1.0)\n"
        "raise SystemError('diverged')\n",
        ex.socket,
    )
    assert out.returncode == 1
    r = wait_for(lambda: (k := ranks_of(ex, "boom")) and k[0]["status"] != "running" and k[0])
    assert r["status"] == "failed" and r["step"] == 0


def test_eight_ranks_at_once(
    exporter_process: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    ex = exporter_process().start()
    script = tmp_path / "rank.py"
    script.write_text(
        "import time, trainmon_client\n"
        "run = trainmon_client.init(run='eight')\n"
        "for i in range(2000):\n"
        "    run.log(i, loss=1.0 / (i + 1), lr=1e-3, grad_norm=0.5, tokens=1024, samples=8)\n"
        "    time.sleep(0.0005)\n"
        "run.finish()\n"
        "print(run.dropped)\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            text=True,
            stdout=subprocess.PIPE,
            env=child_env(
                TRAINMON_SOCKET=ex.socket, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="8"
            ),
        )
        for r in range(8)
    ]
    for p in procs:
        p.communicate(timeout=120)
        assert p.returncode == 0
    ranks = wait_for(
        lambda: (
            (k := ranks_of(ex, "eight"))
            and len(k) == 8
            and all(r["status"] == "finished" for r in k)
            and k
        )
    )
    assert [r["rank"] for r in ranks] == list(range(8))
    for r in ranks:
        assert r["steps_total"] == 2000 and r["tokens_total"] == 2000 * 1024
        assert r["dropped"] == {
            "disconnected": 0,
            "backpressure": 0,
            "encode_error": 0,
            "in_flight": 0,
        }
    m = ex.metrics()
    assert sample(m, "trainmon_ingest_messages_total", type="step") == 16000


def test_a_refused_trainer_says_so_in_its_closing_line(
    exporter_process: Callable[..., ExporterProcess],
) -> None:
    """A second trainer of a rank already connected is refused (``duplicate_rank``): its
    closing line says the exporter refused the run and why. It used to say how many records
    it "sent" and dropped, the drops counted as ``disconnected``, and pointed at the status
    page, where the run it reported to was someone else's."""
    ex = exporter_process().start()
    first = trainer(ex.socket, "--steps", "0", "--run", "twice")
    try:
        wait_for(lambda: ranks_of(ex, "twice"), timeout=120)
        second = trainer(ex.socket, "--steps", "5", "--run", "twice")
        out = finished_output(second, 180)
        assert second.returncode == 0, out
        closing = [line for line in out.splitlines() if line.startswith("trainmon: run ")]
        assert closing and closing[-1].endswith(
            "(the exporter refused this run: duplicate_rank; see the warning above)"
        ), out
    finally:
        first.send_signal(signal.SIGINT)
        finished_output(first, 60)
