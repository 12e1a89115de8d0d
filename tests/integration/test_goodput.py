"""Where the time goes, end to end: a scripted trainer with known times against a real exporter.

The trainer (``tests/helpers/timed_trainer.py``) starts up, waits for each batch through
``Run.timed()``, saves a checkpoint every 10 steps, and is killed (SIGKILL) 5 steps after its
checkpoint at step 10. After a pause a new process starts, loads that checkpoint, resumes at
step 11, stalls once long enough to be judged hung, and finishes at step 30. Every time it
spends, it measures itself; the exported buckets must match: data waits, checkpoint saves and
the restore within 15 %, goodput within 5 points, and every bucket together the wall-clock
from the first ``init()`` to the finish within a few percent (docs/goodput.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from trainmon_exporter.analytics.goodput import KINDS

from ..conftest import ROOT, ExporterProcess, child_env, sample, wait_for

pytestmark = pytest.mark.slow

TRAINER = ROOT / "tests" / "helpers" / "timed_trainer.py"
PAUSE_BEFORE_RESTART = 2.0
STALL = 2.5


def trainer(ex: ExporterProcess, truth: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            *(sys.executable, str(TRAINER), "--socket", ex.socket, "--run", "goodput"),
            *("--truth", str(truth), *args),
        ],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def events(truth: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in truth.read_text().splitlines()]


def test_exported_buckets_match_what_the_trainer_measured(
    exporter_process: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    # Hangs judged after 5 steps, 1.5 usual step times plus 0.5 s: the stall is one, the
    # 0.3 s checkpoint saves are not.
    ex = exporter_process(
        env=child_env(
            TRAINMON_ANALYTICS__MIN_HISTORY_STEPS="5",
            TRAINMON_ANALYTICS__HANG_FACTOR="1.5",
            TRAINMON_ANALYTICS__HANG_GRACE_SECONDS="0.5",
        )
    ).start()
    truth = tmp_path / "truth.jsonl"
    first = trainer(ex, truth, "--first", "1", "--last", "30", "--kill-after", "15")
    out, _ = first.communicate(timeout=120)
    assert first.returncode == -9, out
    lbl = {"run": "goodput", "rank": "0"}
    wait_for(lambda: (r := ex.runs()["runs"]) and r[0]["ranks"][0]["status"] == "crashed")
    time.sleep(PAUSE_BEFORE_RESTART)
    second = trainer(
        ex,
        truth,
        *("--first", "11", "--last", "30", "--startup", "0.5", "--restore", "0.4"),
        *("--pause-at", "25", "--pause", str(STALL)),
    )
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 0, out
    wait_for(lambda: ex.runs()["runs"][0]["ranks"][0]["status"] == "finished")

    ev = events(truth)
    inits = [e["t"] for e in ev if e["ev"] == "init"]
    (kill,) = [e["t"] for e in ev if e["ev"] == "kill"]
    (finish,) = [e["t"] for e in ev if e["ev"] == "finish"]
    steps = [e for e in ev if e["ev"] == "step"]
    wall = finish - inits[0]
    data = sum(e["wait"] for e in steps)
    saves = sum(e["seconds"] for e in ev if e["ev"] == "save")
    (restore,) = [e["seconds"] for e in ev if e["ev"] == "restore"]
    # Kept: the first process's steps up to its checkpoint at step 10, and all the second's.
    first_run = [e for e in steps if e["t"] < kill]
    kept = [e for e in first_run if e["step"] <= 10] + [e for e in steps if e["t"] > kill]
    lost = [e for e in first_run if e["step"] > 10]
    good = sum(e["compute"] for e in kept)

    m = ex.metrics()
    got = {k: sample(m, "trainmon_train_badput_seconds_total", kind=k, **lbl) for k in KINDS}
    productive = sample(m, "trainmon_train_productive_seconds_total", **lbl)
    assert productive is not None and all(v is not None for v in got.values()), got
    assert sample(m, "trainmon_train_uncheckpointed_seconds", **lbl) == 0  # finished cleanly
    total = productive + sum(v for v in got.values() if v is not None)
    measured = {"wall": wall, "data": data, "saves": saves, "restore": restore, "good": good}
    measured["recovery"] = inits[1] - kill
    report = {"truth": measured, **got}
    print(json.dumps({"productive": productive, "total": total, **report}, indent=1))

    assert total == pytest.approx(wall, rel=0.03), report
    assert got["data_loading"] == pytest.approx(data, rel=0.15), report
    assert got["checkpoint_save"] == pytest.approx(saves, rel=0.15), report
    assert got["checkpoint_restore"] == pytest.approx(restore, rel=0.15), report
    assert abs(productive / total - good / wall) < 0.05, report
    # The steps after the checkpoint that the kill threw away, and the step in progress.
    wasted = sum(e["compute"] for e in lost) + (kill - lost[-1]["t"])
    # The exporter sees the connection close on its next drain (0.1 s), later under load:
    # that moves a little time from recovery to the step in progress, both ways equal.
    assert got["wasted_progress"] == pytest.approx(wasted, abs=0.3), report
    assert got["recovery"] == pytest.approx(inits[1] - kill, abs=0.3), report
    assert STALL * 0.8 < (got["hang"] or 0) < STALL * 1.1, report
    assert got["startup"] == pytest.approx(1.0 + 0.5, abs=0.5), report
    view = ex.runs()["runs"][0]
    assert view["goodput_ratio"] == pytest.approx(productive / total, abs=0.01)
    assert view["ranks"][0]["goodput"]["badput_seconds"]["hang"] == pytest.approx(got["hang"])
