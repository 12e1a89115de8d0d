"""The HF ``Trainer`` and Lightning under ``trainmon-run``: their callback reports, never both.

Under ``trainmon-run`` the PyTorch hooks would see every optimizer step a framework takes;
where the framework's callback is used instead, they must stop, or each step would be sent
twice (and the second run of the same rank refused by the exporter). Each example runs as a
real process under ``trainmon-run`` against a real exporter: once without a callback of its
own (``--no-trainmon``: trainmon-run adds it), once with it (trainmon-run adds none).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ..conftest import ROOT, ExporterProcess, child_env, sample, wait_for
from ..helpers.trainmon_run import TRAINMON_RUN

pytestmark = pytest.mark.slow

SMALL = ["--dim", "32", "--layers", "1", "--heads", "2", "--seq-len", "32"]
SMALL += ["--corpus-bytes", "60000", "--steps", "8"]
EXAMPLES = {
    "transformers": ["examples/train_hf_trainer.py", "--eval-steps", "0", "--logging-steps", "1"],
    "lightning": ["examples/train_lightning.py", "--eval-every", "0"],
}


@pytest.mark.parametrize("own_callback", [False, True], ids=["added", "own"])
@pytest.mark.parametrize("framework", sorted(EXAMPLES))
def test_a_framework_under_trainmon_run_is_counted_once(
    exporter_process: Callable[..., ExporterProcess],
    tmp_path: Path,
    framework: str,
    own_callback: bool,
) -> None:
    pytest.importorskip(framework)
    ex = exporter_process().start()
    script, *flags = EXAMPLES[framework]
    command = [
        *(TRAINMON_RUN, "--socket", ex.socket, "--run", "fw", "--"),
        *(sys.executable, str(ROOT / script), *SMALL, *flags, "--output-dir", str(tmp_path)),
        *(("--run", "fw") if own_callback else ("--no-trainmon",)),
    ]
    out = subprocess.run(
        command, env=child_env(), capture_output=True, text=True, timeout=180, check=False
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    wait_for(lambda: any(r["run"] == "fw" for r in ex.runs()["runs"]), timeout=20)
    m = ex.metrics()
    assert sample(m, "trainmon_train_steps_total", run="fw", rank="0") == 8
    assert sample(m, "trainmon_ingest_connections_total") == 1
    refused = [v for (name, _), v in m.items() if name == "trainmon_ingest_hellos_refused_total"]
    assert not any(refused)
    # The framework's own numbers, which the hooks do not have: tokens (Lightning: from
    # count_tokens, given only by the example's own callback; HF: from input_ids).
    tokens = sample(m, "trainmon_train_tokens_total", run="fw", rank="0")
    if framework == "transformers":
        assert tokens == 8 * 8 * 32
