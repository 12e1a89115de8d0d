"""Accelerate with trainmon: the unmodified script under ``trainmon-run``, and the tracker.

examples/train_accelerate.py, as real processes against a real exporter: under
``trainmon-run`` the hooks see ``accelerator.backward``, the prepared optimizer's real steps
(one per ``gradient_accumulation_steps`` micro-batches), the data loader and ``save_state``;
with ``log_with=TrainmonTracker()`` the tracker reports what the loop logs. Both must report
every optimizer step with the loss the script computed; under ``trainmon-run`` with the
tracker too, once.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ..conftest import ROOT, ExporterProcess, sample
from ..helpers.trainmon_run import finished_rank, run_script

pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow

SCRIPT = ROOT / "examples" / "train_accelerate.py"


@pytest.mark.parametrize(
    ("launcher", "tracker"),
    [(True, False), (False, True), (True, True)],
    ids=["trainmon-run", "tracker", "both"],
)
def test_every_step_is_reported_once_with_the_scripts_loss(
    exporter_process: Callable[..., ExporterProcess], tmp_path: Path, launcher: bool, tracker: bool
) -> None:
    ex = exporter_process().start()
    losses = tmp_path / "losses.jsonl"
    command = [sys.executable, str(SCRIPT), "--steps", "12", "--accum", "2", "--losses",
               str(losses), "--data-delay", "0.002", "--save-every", "6",
               "--output-dir", str(tmp_path / "out")]  # fmt: skip
    if tracker:
        command.append("--trainmon-tracker")
    run_script(command, launcher=launcher, TRAINMON_SOCKET=ex.socket, TRAINMON_RUN="acc")
    rank = finished_rank(ex, "acc")
    computed = [json.loads(line) for line in losses.read_text().splitlines()]
    assert rank["trend"]["steps"] == [c["step"] for c in computed] == list(range(1, 13))
    assert rank["trend"]["loss"] == pytest.approx([c["loss"] for c in computed], rel=1e-5)
    m = ex.metrics()
    lbl = {"run": "acc", "rank": "0"}
    assert sample(m, "trainmon_train_steps_total", **lbl) == 12
    assert sample(m, "trainmon_ingest_connections_total") == 1
    if launcher:  # what only the hooks see: two save_state calls, the loader's waits
        assert sample(m, "trainmon_checkpoints_total", **lbl) == 2
        data = sample(m, "trainmon_train_badput_seconds_total", kind="data_loading", **lbl)
        assert data is not None and data >= 0.9 * 12 * 2 * 8 * 0.002
