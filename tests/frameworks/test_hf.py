"""The Hugging Face callback with a real ``transformers.Trainer`` and the real exporter.

A tiny Llama from a config learns the standard library's bytes (examples/train_hf_trainer.py).
The NaN-filter case: the model returns a NaN loss at one step with finite gradients. The
Trainer's ``logging_nan_inf_filter`` keeps its own logs finite; trainmon must count the NaN.
"""

from __future__ import annotations

import importlib.util
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from trainmon_client import _protocol as P

from ..conftest import ROOT, InProcessExporter, sample, short_tmpdir, wait_for
from ..helpers.client import Listener

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def example() -> Any:
    spec = importlib.util.spec_from_file_location(
        "train_hf_trainer", ROOT / "examples" / "train_hf_trainer.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def train(
    make_exporter: Callable[..., InProcessExporter],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> Callable[..., tuple[InProcessExporter, Any]]:
    """``train(run, *flags)``: the example on a small model against a fresh exporter.

    Returns the exporter and the finished ``Trainer`` once the exporter shows the rank finished.
    """

    def run(run_id: str, *args: str) -> tuple[InProcessExporter, Any]:
        ex = make_exporter(**{"collectors": {"gpu": False, "rank_gpu": False}})
        monkeypatch.setenv("TRAINMON_SOCKET", ex.socket)
        small = ["--dim", "32", "--layers", "1", "--heads", "2", "--seq-len", "32"]
        small += ["--corpus-bytes", "60000", "--output-dir", str(tmp_path)]
        trainer = example().main([*small, "--run", run_id, *args])
        wait_for(lambda: (r := ex.rank(run_id, 0)) is not None and r["status"] == "finished")
        return ex, trainer

    return run


def test_trainer_reports_steps_eval_checkpoints_and_the_nan_the_filter_hides(
    train: Callable[..., tuple[InProcessExporter, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    ex, trainer = train(
        "hf-test",
        *("--steps", "12", "--logging-steps", "1", "--eval-steps", "6", "--save-steps", "6"),
        *("--inject-nan-at", "5"),
    )
    # The example's closing line: what it sent, where, and where to look.
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("trainmon: run 'hf-test' rank 0: ") and ex.socket in last, last
    assert ", 0 dropped; see the exporter's status page" in last, last
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logged] == list(range(1, 13))
    # The Trainer's own view: the NaN at step 5 was replaced by a running average.
    assert all(math.isfinite(h["loss"]) for h in logged)
    lbl = {"run": "hf-test", "rank": "0"}
    m = ex.metrics()
    # trainmon's view: the raw loss of step 5 was NaN, and it was counted.
    assert sample(m, "trainmon_train_nonfinite_values_total", field="loss", **lbl) == 1
    assert sample(m, "trainmon_train_steps_total", **lbl) == 12
    assert sample(m, "trainmon_train_tokens_total", **lbl) == 12 * 8 * 32
    assert sample(m, "trainmon_train_samples_total", **lbl) == 12 * 8
    last = logged[-1]
    assert sample(m, "trainmon_train_loss", **lbl) == pytest.approx(last["loss"], rel=1e-5)
    assert sample(m, "trainmon_train_grad_norm", **lbl) == pytest.approx(last["grad_norm"])
    assert sample(m, "trainmon_train_learning_rate", **lbl) == pytest.approx(last["learning_rate"])
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert len(evals) == 2
    assert sample(m, "trainmon_eval_evaluations_total", **lbl) == 2
    assert sample(m, "trainmon_eval_loss", **lbl) == pytest.approx(evals[-1]["eval_loss"])
    assert sample(m, "trainmon_eval_step", **lbl) == 12
    assert sample(m, "trainmon_monitoring_operations_total", operation="evaluation", **lbl) == 2
    assert sample(m, "trainmon_checkpoints_total", **lbl) == 2
    assert sample(m, "trainmon_checkpoint_last_step", **lbl) == 12
    duration = sample(m, "trainmon_checkpoint_last_duration_seconds", **lbl)
    assert duration is not None and 0 < duration < 60
    # Where the time went: the batch fetches, the saves and the evaluations, each in its kind.
    for kind in ("data_loading", "checkpoint_save", "evaluation", "startup"):
        seconds = sample(m, "trainmon_train_badput_seconds_total", kind=kind, **lbl)
        assert seconds is not None and seconds > 0, kind
    assert (sample(m, "trainmon_train_productive_seconds_total", **lbl) or 0) > 0
    assert sample(m, "trainmon_train_uncheckpointed_seconds", **lbl) == 0  # finished cleanly
    rank = ex.rank("hf-test", 0)
    assert rank is not None and rank["world_size"] == 1
    assert rank["dtype"] == "fp32"  # use_cpu, no bf16: judged against the fp32 peak
    assert sample(m, "trainmon_client_dropped_messages_total", reason="disconnected", **lbl) == 0


def test_gradient_accumulation_loss_matches_the_trainers(
    train: Callable[..., tuple[InProcessExporter, Any]],
) -> None:
    ex, trainer = train(
        "hf-ga", *("--steps", "4", "--logging-steps", "1", "--grad-accum", "3", "--eval-steps", "0")
    )
    logged = [h for h in trainer.state.log_history if "loss" in h]
    m = ex.metrics()
    lbl = {"run": "hf-ga", "rank": "0"}
    assert sample(m, "trainmon_train_steps_total", **lbl) == 4
    assert sample(m, "trainmon_train_samples_total", **lbl) == 4 * 3 * 8
    assert sample(m, "trainmon_train_loss", **lbl) == pytest.approx(logged[-1]["loss"], rel=1e-5)


def test_a_resumed_trainer_reports_the_checkpoint_as_a_restore(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from trainmon_client.hf import TrainmonCallback

    ex = example()
    sockdir = short_tmpdir()
    small = ["--dim", "32", "--layers", "1", "--heads", "2", "--seq-len", "32"]
    small += ["--corpus-bytes", "60000", "--output-dir", str(tmp_path), "--eval-steps", "0"]
    listener = Listener(sockdir / "t.sock")
    monkeypatch.setenv("TRAINMON_SOCKET", str(listener.path))
    try:
        first = ex.parse([*small, "--run", "hf-resume", "--steps", "6", "--save-steps", "6"])
        ex.build(first, [TrainmonCallback("hf-resume")]).train()
        listener.accept()
        records = listener.records()
        assert not [r for t, r in records if t == P.CHECKPOINT and r.restore]
        assert listener.conn is not None
        listener.conn.close()  # the first process's connection; the resumed one is next
        again = ex.parse([*small, "--run", "hf-resume", "--steps", "9", "--save-steps", "6"])
        ex.build(again, [TrainmonCallback("hf-resume")]).train(
            resume_from_checkpoint=str(tmp_path / "checkpoint-6")
        )
        listener.accept()
        records = listener.records()
    finally:
        listener.close()
        shutil.rmtree(sockdir, ignore_errors=True)
    restores = [r for t, r in records if t == P.CHECKPOINT and r.restore]
    assert [r.step for r in restores] == [6]
    steps = [r for t, r in records if t == P.STEP]
    first_step = steps[0].header.step
    assert first_step == 7  # the resumed run goes on after the checkpoint
    assert all(
        dict(zip(s.ids, s.values, strict=True)).get(P.FIELD_DATA_TIME, -1.0) >= 0 for s in steps
    )
