"""Keras 3 (torch backend) with trainmon: under ``trainmon-run``, and with the callback.

examples/train_keras.py as a real process against a real exporter. Keras's optimizers are not
``torch.optim`` optimizers, so ``trainmon-run`` must add the Keras callback (the hooks alone
would count no step), and count each step once when the script gives its own.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ..conftest import ROOT, ExporterProcess, sample
from ..helpers.trainmon_run import finished_rank, run_script

pytestmark = [
    pytest.mark.slow,
    # Not imported here: without KERAS_BACKEND=torch, Keras would look for TensorFlow.
    pytest.mark.skipif(importlib.util.find_spec("keras") is None, reason="keras not installed"),
]

SCRIPT = ROOT / "examples" / "train_keras.py"


@pytest.mark.parametrize(
    ("launcher", "callback"),
    [(True, False), (False, True), (True, True)],
    ids=["trainmon-run", "callback", "both"],
)
def test_every_batch_is_a_step_with_its_own_loss(
    exporter_process: Callable[..., ExporterProcess], tmp_path: Path, launcher: bool, callback: bool
) -> None:
    ex = exporter_process().start()
    history = tmp_path / "history.json"
    # 192 training samples (a quarter held out) in batches of 32: 6 steps an epoch.
    command = [sys.executable, str(SCRIPT), "--epochs", "2", "--history", str(history)]
    if callback:
        command.append("--trainmon-callback")
    env = {"TRAINMON_SOCKET": ex.socket, "TRAINMON_RUN": "keras", "KERAS_BACKEND": "torch"}
    run_script(command, launcher=launcher, **env)
    rank = finished_rank(ex, "keras")
    m = ex.metrics()
    lbl = {"run": "keras", "rank": "0"}
    assert sample(m, "trainmon_train_steps_total", **lbl) == 12
    assert sample(m, "trainmon_train_samples_total", **lbl) == 12 * 32
    assert sample(m, "trainmon_ingest_connections_total") == 1
    assert sample(m, "trainmon_monitoring_operations_total", operation="evaluation", **lbl) == 2
    # Keras's epoch loss is the mean of its batches' losses: the per-step values sent add up.
    keras_history = json.loads(history.read_text())["history"]
    assert rank["trend"]["steps"] == list(range(1, 13))
    second_epoch = rank["trend"]["loss"][6:]
    assert sum(second_epoch) / 6 == pytest.approx(keras_history["loss"][-1], rel=1e-4)
    assert sample(m, "trainmon_eval_loss", **lbl) == pytest.approx(
        keras_history["val_loss"][-1], rel=1e-6
    )
