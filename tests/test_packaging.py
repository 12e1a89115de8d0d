"""Packaging: one version, a licence in both distributions, installs that work from the repository.

The slow test builds both wheels and sdists with ``python -m build`` (the wheel from the sdist,
as PyPI users get it), installs the repository's two directories with the one documented
command into a clean venv, then the built wheels and sdists, and runs both CLIs from there.
Dependencies come from the package index pip is configured with, as for any user.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

from tests.conftest import ROOT

CLIENT = ROOT / "client"
EXPORTER = ROOT / "exporter"


def written_version() -> str:
    """The version as written in ``trainmon_client/_version.py``."""
    tree = ast.parse((CLIENT / "src" / "trainmon_client" / "_version.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "__version__":  # type: ignore[attr-defined]
            return str(ast.literal_eval(node.value))
    raise AssertionError("no __version__ in _version.py")


def checkout_revision() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def test_the_version_is_written_once() -> None:
    version = written_version()
    link = EXPORTER / "src" / "trainmon_exporter" / "_version.py"
    assert link.is_symlink(), "the exporter's _version.py must be a link to the client's"
    assert link.resolve() == (CLIENT / "src" / "trainmon_client" / "_version.py").resolve()
    for project in (CLIENT, EXPORTER):
        meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
        assert "version" not in meta and "version" in meta["dynamic"], project
    deps = tomllib.loads((EXPORTER / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"trainmon-client=={version}" in deps, "the exporter must require its own version"
    assert re.search(rf"^## \[?{re.escape(version)}\]?", (ROOT / "CHANGELOG.md").read_text(), re.M)


def test_both_distributions_carry_the_licence_and_metadata() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the whole text, not a pointer to it
    for project in (CLIENT, EXPORTER):
        assert (project / "LICENSE").read_text() == text
        meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
        assert meta["license"] == "Apache-2.0" and meta["license-files"] == ["LICENSE"]
        assert meta["readme"] == "README.md" and (project / "README.md").is_file()
        assert meta["requires-python"].startswith(">=3.")
        assert {"Homepage", "Documentation", "Changelog"} <= set(meta["urls"])
        classifiers = meta["classifiers"]
        assert any(c.startswith("Programming Language :: Python :: 3.") for c in classifiers)


def test_no_wheels_committed_at_the_root() -> None:
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert not [f for f in tracked if f.endswith((".whl", ".tar.gz"))], "install from the index"


def _run(*cmd: str | Path, cwd: Path | None = None) -> str:
    out = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode == 0, f"{cmd} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


@pytest.mark.slow
def test_build_and_install_into_a_clean_venv(tmp_path: Path) -> None:
    version = written_version()
    # A copy of the two source trees (what a clone holds: no build/ or egg-info leftovers).
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "_revision.txt")
    for project in (CLIENT, EXPORTER):
        shutil.copytree(project, src / project.name, symlinks=True, ignore=ignore)
    # The exporter's version link points at the client's file by a relative path: keep both.
    dist = tmp_path / "dist"
    for project in (CLIENT, EXPORTER):
        _run(sys.executable, "-m", "build", "-q", "-o", dist, project)  # sdist, then wheel from it
    built = sorted(p.name for p in dist.iterdir())
    assert built == sorted(
        [
            f"trainmon_client-{version}-py3-none-any.whl",
            f"trainmon_client-{version}.tar.gz",
            f"trainmon_exporter-{version}-py3-none-any.whl",
            f"trainmon_exporter-{version}.tar.gz",
        ]
    ), built
    rev = checkout_revision()
    wheel = dist / f"trainmon_exporter-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        assert z.read("trainmon_exporter/_revision.txt").decode().strip() == rev
        assert any(n.endswith("licenses/LICENSE") for n in z.namelist())
    with tarfile.open(dist / f"trainmon_exporter-{version}.tar.gz") as t:
        names = t.getnames()
        assert f"trainmon_exporter-{version}/LICENSE" in names
        assert f"trainmon_exporter-{version}/src/trainmon_exporter/_version.py" in names

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    # The one command the README gives for installing from the repository.
    _run(py, "-m", "pip", "install", "-q", src / "client", src / "exporter")
    assert _run(env_dir / "bin" / "trainmon-exporter", "--version").strip() == (
        f"trainmon-exporter {version}"
    )
    assert _run(env_dir / "bin" / "trainmon", "--version").strip() == f"trainmon {version}"
    # The built wheels and sdists install too (dependencies already satisfied).
    for kind in ("*.whl", "*.tar.gz"):
        files = sorted(dist.glob(kind))
        _run(py, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", *files)
        assert _run(env_dir / "bin" / "trainmon", "--version").strip() == f"trainmon {version}"
    # build_info's revision is the build's, even when run inside another git repository.
    other = tmp_path / "users-own-repo"
    other.mkdir()
    _run("git", "init", "-q", cwd=other)
    _run(
        "git", "-c", "user.name=u", "-c", "user.email=u@x", "commit", "-q", "--allow-empty",
        "-m", "x", cwd=other,
    )  # fmt: skip
    probe = "from trainmon_exporter._build import revision; print(revision())"
    assert _run(py, "-c", probe, cwd=other).strip() == rev
