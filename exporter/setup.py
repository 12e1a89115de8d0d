"""Build hook: stamps the git revision the exporter is built from into the package.

Everything else about the distribution is in pyproject.toml. ``trainmon_build_info{revision}``
reads the stamp (``trainmon_exporter/_revision.txt``): taken here at build time from this
repository's checkout, carried inside the sdist, so a wheel built from the sdist (no git there)
keeps it; never taken from the directory the exporter later runs in.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
STAMP = Path("trainmon_exporter") / "_revision.txt"


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args], cwd=HERE, capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def revision() -> str:
    """This checkout's short commit; else the stamp an sdist carries; else ``unknown``."""
    top = _git("rev-parse", "--show-toplevel")
    if top and (Path(top) / "exporter" / "setup.py").resolve() == Path(__file__).resolve():
        rev = _git("rev-parse", "--short=12", "HEAD")
        if rev:
            return rev
    carried = HERE / "src" / STAMP
    if carried.is_file():
        return carried.read_text().strip() or "unknown"
    return "unknown"


def _write(path: Path, text: str) -> None:
    path.unlink(missing_ok=True)  # sdist trees hard-link the sources: never write through one
    path.write_text(text)


class BuildPy(build_py):
    """Writes the revision stamp into the built package."""

    def run(self) -> None:  # noqa: D102
        super().run()
        if not self.editable_mode:
            _write(Path(self.build_lib) / STAMP, revision() + "\n")


class Sdist(sdist):
    """Carries the revision stamp inside the sdist."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:  # noqa: D102
        super().make_release_tree(base_dir, files)
        _write(Path(base_dir) / "src" / STAMP, revision() + "\n")


setup(cmdclass={"build_py": BuildPy, "sdist": Sdist})
