"""Ray Train with trainmon: the callback, and the unmodified script under ``trainmon-run``.

examples/train_ray.py, two CPU workers (DDP over gloo) on a local Ray cluster, as a real
process against a real exporter. With the callback, the controller sends every worker's
reports under that worker's rank; under ``trainmon-run`` the workers inherit its environment
and report themselves through the hooks; with both, each step once. Ray is large (about 500 MB
installed with ``ray[train]``): these tests run where ``requirements-frameworks.txt`` was
installed, and skip elsewhere.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ..conftest import ROOT, ExporterProcess, sample, wait_for
from ..helpers.trainmon_run import run_script

pytest.importorskip("ray.train")
pytestmark = pytest.mark.slow

SCRIPT = ROOT / "examples" / "train_ray.py"


@pytest.mark.parametrize(
    ("launcher", "callback"),
    [(False, True), (True, False), (True, True)],
    ids=["callback", "trainmon-run", "both"],
)
def test_every_workers_steps_are_reported_under_its_rank(
    exporter_process: Callable[..., ExporterProcess], tmp_path: Path, launcher: bool, callback: bool
) -> None:
    ex = exporter_process().start()
    losses = tmp_path / "losses"
    losses.mkdir()
    command = [sys.executable, str(SCRIPT), "--workers", "2", "--steps", "8",
               "--checkpoint-every", "4", "--losses", str(losses),
               "--storage", str(tmp_path / "storage")]  # fmt: skip
    if callback:
        command.append("--trainmon-callback")
    env = {"TRAINMON_SOCKET": ex.socket, "TRAINMON_RUN": "ray", "RAY_USAGE_STATS_ENABLED": "0"}
    run_script(command, launcher=launcher, timeout=300, **env)

    def both_ranks() -> list[dict] | None:  # type: ignore[type-arg]
        for r in ex.runs()["runs"]:
            if (
                r["run"] == "ray"
                and len(r["ranks"]) == 2
                and all(k["step"] == 8 for k in r["ranks"])
            ):
                return sorted(r["ranks"], key=lambda k: k["rank"])  # type: ignore[no-any-return]
        return None

    ranks = wait_for(both_ranks, timeout=30)
    m = ex.metrics()
    for rank in ranks:
        computed = [
            json.loads(x) for x in (losses / f"rank-{rank['rank']}.jsonl").read_text().splitlines()
        ]
        assert rank["trend"]["steps"] == [c["step"] for c in computed] == list(range(1, 9))
        assert rank["trend"]["loss"] == pytest.approx([c["loss"] for c in computed], rel=1e-6)
        lbl = {"run": "ray", "rank": str(rank["rank"])}
        assert sample(m, "trainmon_train_steps_total", **lbl) == 8
        saved = sample(m, "trainmon_checkpoints_total", **lbl)
        if not launcher:  # the controller reports each checkpoint for every rank
            assert saved == 2
        elif rank["rank"] == 0:  # the hooks: rank 0's torch.save; the last one is reported at
            assert saved and saved >= 1  # exit, which Ray's workers never reach (killed)
        else:
            assert not saved
    assert sample(m, "trainmon_ingest_connections_total") == 2  # one per rank, never both
