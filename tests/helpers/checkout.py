"""The files of the checkout the tests read: what git tracks, never what a build left there.

A checkout holds more than the repository: virtual environments (``.venv``, ``.venv-demo``
with the Markdown and Python files of every package in them), caches, build outputs, a
user's own scratch files. A test that walks the directory tree judges those too, and fails
on a file of FastAPI's after ``make demo``. Every test that looks for files of the
repository asks :func:`tracked` instead.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..conftest import ROOT


def tracked(*patterns: str, under: Path = ROOT) -> list[Path]:
    """Files git tracks under ``under`` that match a glob of ``patterns``, sorted, as paths.

    Patterns are relative to ``under`` and follow git's ``glob`` pathspec magic: ``*`` stays
    within a directory, ``**/`` matches any number of them (``**/*.md`` is every Markdown
    file, at the top too). Files deleted in the work tree and not yet committed are left out.

    Raises:
        subprocess.CalledProcessError: the checkout is not a git work tree.
    """
    base = under.resolve().relative_to(ROOT)
    specs = [f":(glob){(base / p).as_posix()}" for p in patterns or ("**",)]
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--", *specs], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    paths = (ROOT / name for name in listed.split("\0") if name)
    return sorted(p for p in paths if p.is_file())


@contextmanager
def ignored_file(relative: str, text: str) -> Iterator[Path]:
    """A file the checkout's ``.gitignore`` ignores, written at ``relative`` and removed after,
    with the directories made for it: what ``make demo`` or a build leaves in a checkout.

    ``relative`` must be ignored (``__pycache__/`` anywhere, ``.venv-demo/``); a path git
    would track is refused, so the test never leaves a file the repository could take in.
    """
    path = ROOT / relative
    if subprocess.run(["git", "check-ignore", "-q", relative], cwd=ROOT).returncode != 0:
        raise ValueError(f"{relative} is not ignored by git")
    made = [p for p in reversed(path.relative_to(ROOT).parents) if not (ROOT / p).exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)
        for p in reversed(made):
            (ROOT / p).rmdir()
