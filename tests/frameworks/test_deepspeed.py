"""DeepSpeed under ``trainmon-run``: no plug-in API upstream, so the hooks and the engine's own.

examples/train_deepspeed.py (one CPU process, ZeRO stage 0, gradient accumulation and
clipping) as a real process under ``trainmon-run`` against a real exporter: every optimizer
step, with the mean loss the script computed, the engine's gradient norm and lr, and one
checkpoint for ``save_checkpoint``'s files. Needs ``requirements-frameworks.txt`` (DeepSpeed
builds its CPU communication op on first use, about a minute); skips without it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ..conftest import ROOT, ExporterProcess, free_port, sample
from ..helpers.trainmon_run import finished_rank, run_script

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow

SCRIPT = ROOT / "examples" / "train_deepspeed.py"


def test_deepspeed_steps_loss_grad_norm_and_checkpoint(
    exporter_process: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    ex = exporter_process().start()
    losses = tmp_path / "losses.jsonl"
    command = [sys.executable, str(SCRIPT), "--steps", "8", "--accum", "2",
               "--losses", str(losses), "--save-dir", str(tmp_path / "ckpt")]  # fmt: skip
    env = {"TRAINMON_SOCKET": ex.socket, "TRAINMON_RUN": "ds", "DS_ACCELERATOR": "cpu"}
    run_script(command, launcher=True, timeout=300, MASTER_PORT=str(free_port()), **env)
    rank = finished_rank(ex, "ds")
    computed = [json.loads(line) for line in losses.read_text().splitlines()]
    assert rank["trend"]["steps"] == [c["step"] for c in computed] == list(range(1, 9))
    assert rank["trend"]["loss"] == pytest.approx([c["loss"] for c in computed], rel=1e-5)
    m = ex.metrics()
    lbl = {"run": "ds", "rank": "0"}
    assert sample(m, "trainmon_train_steps_total", **lbl) == 8
    assert sample(m, "trainmon_checkpoints_total", **lbl) == 1  # several files, one checkpoint
    norm = sample(m, "trainmon_train_grad_norm", **lbl)
    assert norm is not None and norm > 0
    assert sample(m, "trainmon_train_learning_rate", **lbl) == 0.01
