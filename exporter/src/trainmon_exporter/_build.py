"""Build identity: the git revision this package was built from.

A built package (wheel, sdist, image) carries the revision in ``_revision.txt``, written by the
build (``exporter/setup.py``) from the checkout it was built in. Running from a checkout of
trainmon itself (an editable install, the tests), the revision is asked of git there. Never
of the current directory's repository: a venv inside a user's own checkout must not report
the user's commit, so git is only asked when its work tree is the one this file lives in.

The revision is read on first use (the first scrape of ``trainmon_build_info``), not at
import: ``trainmon status`` and the CLI's argument checks never run git.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

STAMP = "_revision.txt"
"""File name of the revision stamp a build writes next to this module."""


def _git(here: Path, *args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=2,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


@functools.cache
def revision() -> str:
    """Short git revision trainmon was built from, or ``"unknown"`` (read once, then kept)."""
    here = Path(__file__).resolve().parent
    stamp = here / STAMP
    if stamp.is_file():
        return stamp.read_text().strip() or "unknown"
    top = _git(here, "rev-parse", "--show-toplevel")
    if not top:
        return "unknown"
    ours = Path(top) / "exporter" / "src" / "trainmon_exporter" / "_build.py"
    if not ours.is_file() or ours.resolve() != Path(__file__).resolve():
        return "unknown"  # someone else's repository around an installed copy
    return _git(here, "rev-parse", "--short=12", "HEAD") or "unknown"
