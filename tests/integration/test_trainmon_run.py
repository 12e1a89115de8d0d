"""``trainmon-run`` with an unmodified training script and a real exporter.

examples/train_plain_loop.py imports nothing of trainmon: a DataLoader over a slow dataset,
gradient accumulation, ``clip_grad_norm_``, AdamW with a schedule, a validation pass under
``no_grad`` and ``torch.save`` checkpoints. Under ``trainmon-run`` every optimizer step must
reach the exporter with the loss the script computed, data loading, checkpoints and the
validation must be in the goodput buckets, the seeded losses must be those of a run without
trainmon, and the program keeps its process id, exit status and signals. ``torchrun`` ranks
are each covered, and its agent is not a rank.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ..conftest import ROOT, ExporterProcess, child_env, sample, wait_for
from ..helpers.trainmon_run import TRAINMON_RUN, finished_rank

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "examples" / "train_plain_loop.py"


def trainer(
    *args: str, losses: Path, socket: str | None = None, under: bool = True, **env: str
) -> subprocess.CompletedProcess[str]:
    """The example, to its end (90 s at most), under trainmon-run or not."""
    command = [sys.executable, str(SCRIPT), "--losses", str(losses), *args]
    if under:
        command = [TRAINMON_RUN, *(("--socket", socket) if socket else ()), "--", *command]
    return subprocess.run(
        command,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def rank_view(ex: ExporterProcess, run: str, rank: int = 0) -> dict[str, Any] | None:
    for r in ex.runs()["runs"]:
        if r["run"] == run:
            for k in r["ranks"]:
                if k["rank"] == rank:
                    return k  # type: ignore[no-any-return]
    return None


def test_a_plain_loop_is_reported_step_by_step_with_its_own_loss(
    exporter_process: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    ex = exporter_process().start()
    losses = tmp_path / "losses.jsonl"
    steps, accum, batch, delay = 30, 2, 8, 0.002
    out = trainer(
        *("--steps", str(steps), "--accum", str(accum), "--batch-size", str(batch)),
        *("--data-delay", str(delay), "--eval-every", "10", "--checkpoint-every", "10"),
        *("--checkpoint-dir", str(tmp_path / "ckpt")),
        losses=losses,
        socket=ex.socket,
        TRAINMON_RUN="plain",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    computed = lines(losses)
    assert [c["step"] for c in computed] == list(range(1, steps + 1))
    view = finished_rank(ex, "plain")
    m = ex.metrics()
    lbl = {"run": "plain", "rank": "0"}
    assert sample(m, "trainmon_train_steps_total", **lbl) == steps
    assert sample(m, "trainmon_checkpoints_total", **lbl) == 3
    assert sample(m, "trainmon_train_samples_total", **lbl) == steps * accum * batch
    # The loss the script computed, step by step (the exporter keeps one point a step here).
    trend = view["trend"]
    assert trend["steps"] == list(range(1, steps + 1))
    for mine, theirs in zip(computed, trend["loss"], strict=True):
        assert theirs == pytest.approx(mine["loss"], rel=1e-6), (mine, theirs)
    assert sample(m, "trainmon_train_loss", **lbl) == pytest.approx(computed[-1]["loss"], rel=1e-6)
    assert sample(m, "trainmon_train_grad_norm", **lbl) == pytest.approx(
        computed[-1]["grad_norm"], rel=1e-6
    )
    assert sample(m, "trainmon_train_learning_rate", **lbl) == pytest.approx(computed[-1]["lr"])
    # Where the time went: data loading at least the dataset's sleeps, the three checkpoint
    # saves and the three validation passes each in their bucket.
    slept = steps * accum * batch * delay
    badput = {
        kind: sample(m, "trainmon_train_badput_seconds_total", kind=kind, **lbl)
        for kind in ("data_loading", "checkpoint_save", "evaluation", "startup")
    }
    assert badput["data_loading"] is not None and badput["data_loading"] >= 0.9 * slept, badput
    assert badput["checkpoint_save"] is not None and badput["checkpoint_save"] > 0, badput
    assert badput["evaluation"] is not None and badput["evaluation"] > 0, badput
    # Start-up counts from the process's start (imports included), not from the first step.
    assert badput["startup"] is not None and badput["startup"] > 0.3, badput
    assert sample(m, "trainmon_monitoring_operations_total", operation="evaluation", **lbl) == 3
    assert sample(m, "trainmon_ingest_connections_total") == 1  # one process, one run


def test_seeded_losses_are_those_of_a_run_without_trainmon(tmp_path: Path) -> None:
    args = ("--steps", "25", "--accum", "2", "--eval-every", "10", "--batch-size", "8")
    sock = str(tmp_path / "nobody.sock")  # nothing listens: sends fail, training goes on
    with_tm = trainer(*args, losses=tmp_path / "with.jsonl", socket=sock)
    without = trainer(*args, losses=tmp_path / "without.jsonl", under=False)
    assert with_tm.returncode == 0 and without.returncode == 0, with_tm.stderr + without.stderr
    assert lines(tmp_path / "with.jsonl") == lines(tmp_path / "without.jsonl")


def test_a_resumed_run_reports_the_restore_and_continues_the_steps(
    exporter_process: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    ex = exporter_process().start()
    ckpt = ("--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "10")
    first = trainer("--steps", "20", *ckpt, losses=tmp_path / "a", socket=ex.socket,
                    TRAINMON_RUN="resumed")  # fmt: skip
    assert first.returncode == 0, first.stderr
    finished_rank(ex, "resumed")
    second = trainer("--steps", "26", "--resume", *ckpt, losses=tmp_path / "b",
                     socket=ex.socket, TRAINMON_RUN="resumed")  # fmt: skip
    assert second.returncode == 0, second.stderr
    assert [c["step"] for c in lines(tmp_path / "b")] == list(range(21, 27))

    def resumed() -> dict[str, Any] | None:
        v = rank_view(ex, "resumed")
        return v if v is not None and v["step"] == 26 and v["status"] == "finished" else None

    view = wait_for(resumed, timeout=20)
    assert view["trend"]["steps"] == list(range(21, 27))  # the new process goes on from 20
    m = ex.metrics()
    lbl = {"run": "resumed", "rank": "0"}
    restore = sample(m, "trainmon_train_badput_seconds_total", kind="checkpoint_restore", **lbl)
    assert restore is not None and restore > 0
    # Resumed from step 20, the last checkpoint: nothing was lost.
    wasted = sample(m, "trainmon_train_badput_seconds_total", kind="wasted_progress", **lbl)
    assert not wasted
    assert not sample(m, "trainmon_train_step_rollbacks_total", **lbl)


def test_the_program_keeps_its_pid_exit_status_and_signals(tmp_path: Path) -> None:
    sock = str(tmp_path / "nobody.sock")
    out = trainer("--steps", "3", "--exit-code", "3", losses=tmp_path / "l", socket=sock)
    assert out.returncode == 3, out.stderr
    # A signal to trainmon-run's process is the program's: it is the same process.
    with subprocess.Popen(
        [TRAINMON_RUN, "--socket", sock, "--", sys.executable, "-c",
         "import os, time, torch; print(os.getpid(), flush=True); time.sleep(60)"],
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:  # fmt: skip
        try:
            assert proc.stdout is not None
            assert int(proc.stdout.readline()) == proc.pid
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == -signal.SIGTERM
        finally:
            proc.kill()
    missing = subprocess.run(
        [TRAINMON_RUN, "--", "no-such-program-here"], capture_output=True, text=True, check=False
    )
    assert missing.returncode == 127 and "command not found" in missing.stderr


def test_every_torchrun_rank_is_covered_and_the_agent_is_not_a_rank(
    exporter_process: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    ex = exporter_process().start()
    command = [
        TRAINMON_RUN, "--socket", ex.socket, "--run", "ddp", "--",
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(SCRIPT), "--steps", "12", "--losses", str(tmp_path / "l"),
    ]  # fmt: skip
    env = child_env(OMP_NUM_THREADS="1")
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        finished_rank(ex, "ddp", rank)
    m = ex.metrics()
    for rank in ("0", "1"):
        assert sample(m, "trainmon_train_steps_total", run="ddp", rank=rank) == 12
    assert sample(m, "trainmon_ingest_connections_total") == 2  # the agent opened none
    runs = [r for r in ex.runs()["runs"] if r["run"] == "ddp"]
    assert len(runs) == 1 and sorted(k["rank"] for k in runs[0]["ranks"]) == [0, 1]


def test_options_reach_the_program(tmp_path: Path) -> None:
    """``--off`` runs the program bare; ``--no-hook`` and ``--metrics`` reach each process."""
    probe = (
        "import os, sys; from trainmon_client import _autorun as a; i = a.current(); "
        "print(None if i is None else (sorted(i.hooks), sorted(i.metrics)), "
        "os.environ.get('TORCH_FR_BUFFER_SIZE'), "
        "any(p.endswith('_bootstrap') for p in sys.path))"
    )
    run = [TRAINMON_RUN, "--no-hook", "dataloader", "--metrics", "loss,lr", "--flight-recorder",
           "2000", "--", sys.executable, "-c", probe]  # fmt: skip
    out = subprocess.run(run, env=child_env(), capture_output=True, text=True, check=False)
    hooks = ["backward", "checkpoint", "clip_grad_norm", "frameworks", "optimizer"]
    assert out.stdout.strip() == f"({hooks}, ['loss', 'lr']) 2000 False", out.stderr
    off = [TRAINMON_RUN, "--off", "--", sys.executable, "-c", probe]
    out = subprocess.run(off, env=child_env(), capture_output=True, text=True, check=False)
    assert out.stdout.strip() == "None None False", out.stderr
    # A sitecustomize of the environment still runs (the one trainmon-run puts first hides it).
    (tmp_path / "sitecustomize.py").write_text("import os; os.environ['MINE'] = 'ran'\n")
    env = child_env(PYTHONPATH=str(tmp_path))
    mine = [TRAINMON_RUN, "--", sys.executable, "-c", "import os; print(os.environ.get('MINE'))"]
    out = subprocess.run(mine, env=env, capture_output=True, text=True, check=False)
    assert out.stdout.strip() == "ran", out.stderr
