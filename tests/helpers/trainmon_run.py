"""Running a training script under ``trainmon-run``, and reading its rank back from an exporter.

Shared by tests/integration/test_trainmon_run.py and the framework tests in tests/frameworks.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from ..conftest import child_env, wait_for

TRAINMON_RUN = str(Path(sys.executable).parent / "trainmon-run")
"""The console script of the installed client, beside this Python."""


def run_script(
    command: list[str], *, launcher: bool, timeout: float = 180, **env: str
) -> subprocess.CompletedProcess[str]:
    """``command`` to its end, under ``trainmon-run`` when ``launcher``; ``env`` added to a
    clean environment (:func:`tests.conftest.child_env`). Fails the test on a non-zero exit."""
    if launcher:
        command = [TRAINMON_RUN, "--", *command]
    out = subprocess.run(
        command, env=child_env(**env), capture_output=True, text=True, timeout=timeout, check=False
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def finished_rank(exporter: Any, run: str, rank: int = 0, timeout: float = 20) -> dict[str, Any]:
    """The rank's view in the exporter's ``/api/v1/runs`` once it is finished."""

    def view() -> dict[str, Any] | None:
        for r in exporter.runs()["runs"]:
            if r["run"] == run:
                for k in r["ranks"]:
                    if k["rank"] == rank and k["status"] == "finished":
                        return k  # type: ignore[no-any-return]
        return None

    return wait_for(view, timeout=timeout)  # type: ignore[no-any-return]
