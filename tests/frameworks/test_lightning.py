"""The Lightning callback with a real ``lightning.Trainer`` and the real exporter.

examples/train_lightning.py: the byte-level transformer on the standard library's bytes. One
process in-process (steps, validation, checkpoints, an injected NaN), and two DDP ranks over
gloo as real processes, which must agree on one run id without a launcher's help.
"""

from __future__ import annotations

import importlib.util
import math
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

from trainmon_client import _protocol as P

from ..conftest import ROOT, InProcessExporter, child_env, sample, short_tmpdir, wait_for
from ..helpers.client import Listener

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
EXAMPLE = ROOT / "examples" / "train_lightning.py"
SMALL = ["--dim", "32", "--layers", "1", "--heads", "2", "--seq-len", "32"]
SMALL += ["--corpus-bytes", "60000"]


def example() -> Any:
    spec = importlib.util.spec_from_file_location("train_lightning", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def no_gpu(make_exporter: Callable[..., InProcessExporter]) -> InProcessExporter:
    return make_exporter(**{"collectors": {"gpu": False, "rank_gpu": False}})


def test_fit_reports_steps_validation_checkpoints_and_a_nan(
    make_exporter: Callable[..., InProcessExporter],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ex = no_gpu(make_exporter)
    monkeypatch.setenv("TRAINMON_SOCKET", ex.socket)
    trainer = example().main(
        [
            *SMALL,
            *("--steps", "12", "--run", "pl-test", "--eval-every", "6"),
            *("--checkpoint-every", "6", "--inject-nan-at", "5", "--output-dir", str(tmp_path)),
        ]
    )
    assert trainer.global_step == 12
    # The example's closing line: what it sent, where, and where to look.
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("trainmon: run 'pl-test' rank 0: ") and ex.socket in last, last
    assert ", 0 dropped; see the exporter's status page" in last, last
    wait_for(lambda: ex.rank("pl-test", 0) and ex.rank("pl-test", 0)["status"] == "finished")
    m = ex.metrics()
    lbl = {"run": "pl-test", "rank": "0"}
    assert sample(m, "trainmon_train_nonfinite_values_total", field="loss", **lbl) == 1
    assert sample(m, "trainmon_train_steps_total", **lbl) == 12
    assert sample(m, "trainmon_train_samples_total", **lbl) == 12 * 8
    assert sample(m, "trainmon_train_tokens_total", **lbl) == 12 * 8 * 32
    loss = sample(m, "trainmon_train_loss", **lbl)
    assert loss is not None and 0 < loss < 6
    grad_norm = sample(m, "trainmon_train_grad_norm", **lbl)
    assert grad_norm is not None and math.isfinite(grad_norm) and grad_norm > 0
    assert sample(m, "trainmon_train_learning_rate", **lbl) == pytest.approx(3e-3)
    assert sample(m, "trainmon_eval_evaluations_total", **lbl) == 2
    assert sample(m, "trainmon_eval_loss", **lbl) == pytest.approx(
        float(trainer.callback_metrics["val_loss"])
    )
    assert sample(m, "trainmon_monitoring_operations_total", operation="validation", **lbl) == 2
    assert sample(m, "trainmon_checkpoints_total", **lbl) == 2
    assert sample(m, "trainmon_checkpoint_last_step", **lbl) == 12
    assert len(list(tmp_path.glob("*.ckpt"))) == 2
    for kind in ("data_loading", "checkpoint_save", "evaluation", "startup"):
        seconds = sample(m, "trainmon_train_badput_seconds_total", kind=kind, **lbl)
        assert seconds is not None and seconds > 0, kind
    assert (sample(m, "trainmon_train_productive_seconds_total", **lbl) or 0) > 0
    assert sample(m, "trainmon_client_dropped_messages_total", reason="disconnected", **lbl) == 0


def test_grad_norm_is_taken_before_clipping(
    make_exporter: Callable[..., InProcessExporter], monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightning
    import torch

    from trainmon_client.lightning import TrainmonCallback

    class Big(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return (self.w * batch[0]).sum() * 100.0  # gradient 100 * x, norm 200

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    ex = no_gpu(make_exporter)
    data = torch.utils.data.TensorDataset(torch.ones(4, 4))
    trainer = lightning.Trainer(
        max_steps=2,
        accelerator="cpu",
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TrainmonCallback("pl-clip", socket_path=ex.socket)],
    )
    trainer.fit(Big(), torch.utils.data.DataLoader(data, batch_size=1))
    wait_for(lambda: ex.rank("pl-clip", 0) and ex.rank("pl-clip", 0)["status"] == "finished")
    m = ex.metrics()
    assert sample(m, "trainmon_train_grad_norm", run="pl-clip", rank="0") == pytest.approx(200.0)


def test_two_ddp_ranks_agree_on_the_run_id(
    make_exporter: Callable[..., InProcessExporter], tmp_path: Path
) -> None:
    ex = no_gpu(make_exporter)
    p = subprocess.run(
        [
            *(sys.executable, str(EXAMPLE), *SMALL, "--devices", "2", "--steps", "6"),
            *("--grad-accum", "2", "--eval-every", "0", "--output-dir", str(tmp_path)),
        ],
        env=child_env(TRAINMON_SOCKET=ex.socket),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    runs = wait_for(
        lambda: [
            r
            for r in ex.runs()["runs"]
            if len(r["ranks"]) == 2 and all(k["status"] == "finished" for k in r["ranks"])
        ]
    )
    assert len(ex.runs()["runs"]) == 1  # one run id across both ranks (broadcast by rank 0)
    ranks = runs[0]["ranks"]
    assert [(k["rank"], k["local_rank"], k["world_size"]) for k in ranks] == [(0, 0, 2), (1, 1, 2)]
    assert all(k["steps_total"] == 6 for k in ranks)
    m = ex.metrics()
    for r in ("0", "1"):
        # 2 micro-batches of 8 per step (DistributedSampler halves the data, not the batch)
        assert sample(m, "trainmon_train_samples_total", run=runs[0]["run"], rank=r) == 6 * 2 * 8


def test_a_resumed_fit_reports_the_checkpoint_as_a_restore(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from trainmon_client.lightning import TrainmonCallback

    ex = example()
    sockdir = short_tmpdir()
    listener = Listener(sockdir / "t.sock")
    monkeypatch.setenv("TRAINMON_SOCKET", str(listener.path))
    small = [*SMALL, "--eval-every", "0", "--checkpoint-every", "6"]
    small += ["--output-dir", str(tmp_path), "--run", "pl-resume"]
    try:
        trainer, (module, train, _) = ex.build(
            ex.parse([*small, "--steps", "6"]), [TrainmonCallback("pl-resume")]
        )
        trainer.fit(module, train)
        listener.accept()
        assert not [r for t, r in listener.records() if t == P.CHECKPOINT and r.restore]
        assert listener.conn is not None
        listener.conn.close()  # the first fit's connection; the resumed one is next
        (ckpt,) = tmp_path.glob("*.ckpt")
        trainer, (module, train, _) = ex.build(
            ex.parse([*small, "--steps", "9"]), [TrainmonCallback("pl-resume")]
        )
        trainer.fit(module, train, ckpt_path=str(ckpt))
        listener.accept()
        records = listener.records()
    finally:
        listener.close()
        shutil.rmtree(sockdir, ignore_errors=True)
    assert [r.step for t, r in records if t == P.CHECKPOINT and r.restore] == [6]
    steps = [r for t, r in records if t == P.STEP]
    assert [s.header.step for s in steps] == [7, 8, 9]
    waits = [dict(zip(s.ids, s.values, strict=True)).get(P.FIELD_DATA_TIME) for s in steps]
    assert all(w is not None and w >= 0 for w in waits), waits
