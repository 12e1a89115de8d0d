"""Build identity: the git revision, when the package runs from a checkout."""

from __future__ import annotations

import subprocess
from pathlib import Path


def _revision() -> str:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=2,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


REVISION = _revision()
"""Short git revision of the source tree, or ``"unknown"`` outside a checkout."""
