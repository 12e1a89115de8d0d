"""The example trainer as the integration tests start it, and how they read its outcome."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ..conftest import ROOT, ExporterProcess, child_env

EXAMPLE = ROOT / "examples" / "train_char_transformer.py"
SMALL = [
    "--dim",
    "32",
    "--layers",
    "1",
    "--heads",
    "2",
    "--seq-len",
    "32",
    "--batch-size",
    "8",
    "--corpus-bytes",
    "200000",
]


def trainer(sock: str, *args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLE), *SMALL, *args],
        env=child_env(TRAINMON_SOCKET=sock, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def torchrun(socket: str, launcher: list[str], *args: str) -> subprocess.Popen[str]:
    """The example trainer under torchrun (``launcher`` flags), reporting to ``socket``."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *launcher, str(EXAMPLE), *SMALL, *args],
        env=child_env(TRAINMON_SOCKET=socket),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finished_output(p: subprocess.Popen[str], timeout: float) -> str:
    """``p``'s output once it exits; if it has not within ``timeout`` s, its stack and output.

    The stack comes from ``py-spy dump`` where py-spy is installed, the signal masks from
    ``/proc/PID/status`` (a hung trainer is a bug whose evidence would otherwise be lost with
    the kill).
    """
    try:
        return p.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        status = Path(f"/proc/{p.pid}/status")
        signals = [ln for ln in status.read_text().splitlines() if ln.startswith(("State", "Sig"))]
        stack = "(py-spy not installed)"
        spy = shutil.which("py-spy", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
        if spy:
            dump = [spy, "dump", "--pid", str(p.pid)]
            stack = subprocess.run(dump, capture_output=True, text=True, check=False).stdout
        p.kill()
        out = p.communicate()[0]
        pytest.fail(
            f"still running {timeout} s after SIGINT; {signals}\n{stack}\noutput:\n{out[-4000:]}"
        )


def ranks_of(ex: ExporterProcess, run: str) -> list[dict[str, Any]]:
    for r in ex.runs()["runs"]:
        if r["run"] == run:
            return r["ranks"]  # type: ignore[no-any-return]
    return []
