"""exporter/Dockerfile and its lock, offline: what a release pulls is pinned, what it pushes is
what the manifests name (tests/integration/test_image.py builds it, twice)."""

from __future__ import annotations

import re

import tomllib
import yaml
from packaging.requirements import Requirement

from ..conftest import ROOT

DOCKERFILE = ROOT / "exporter" / "Dockerfile"
LOCK = ROOT / "exporter" / "requirements-image.txt"


def locked() -> dict[str, tuple[str, list[str]]]:
    """``{name: (version, [sha256, ...])}`` of the lock."""
    out: dict[str, tuple[str, list[str]]] = {}
    text = LOCK.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.match(r"([A-Za-z0-9_.-]+)==(\S+)\s+(.*)", line)
        assert m, f"unpinned line in the lock: {line}"
        hashes = re.findall(r"--hash=sha256:([0-9a-f]{64})", m.group(3))
        out[m.group(1).lower().replace("_", "-")] = (m.group(2), hashes)
    return out


def test_the_base_image_is_pinned_by_digest() -> None:
    text = DOCKERFILE.read_text()
    (base,) = re.findall(r"^ARG BASE=(\S+)$", text, re.M)
    assert re.fullmatch(r"python:3\.11-slim-bookworm@sha256:[0-9a-f]{64}", base), base
    froms = re.findall(r"^FROM (\S+)", text, re.M)
    assert froms and all(f == "${BASE}" for f in froms), froms


def pip_commands(verb: str) -> list[str]:
    """The arguments of every ``pip <verb>`` in the Dockerfile, continuation lines joined."""
    return re.findall(rf"pip {verb} ([^&\n]*)", DOCKERFILE.read_text().replace("\\\n", " "))


def test_every_pip_install_is_hashed_or_offline() -> None:
    """Third-party packages only from the lock, with hashes and as wheels: downloaded once,
    then installed from that directory alone, each file checked against the lock again; the
    two packages of this repository from the build context, with no index."""
    (download,) = pip_commands("download")
    assert "-r requirements-image.txt" in download, download
    for flag in ("--require-hashes", "--only-binary=:all:", "--no-deps"):
        assert flag in download, (flag, download)
    (wheels,) = re.findall(r"-d (\S+)", download)
    installs = pip_commands("install")
    assert installs
    for args in installs:
        assert "--no-index" in args and "--no-deps" in args, args
        if "-r requirements-image.txt" in args:
            assert "--require-hashes" in args and f"--find-links {wheels} " in args, args
        else:
            assert set(re.findall(r"\./\S+", args)) == {"./client", "./exporter"}, args


def test_the_locked_packages_reach_the_image() -> None:
    """The build stage installs the lock for itself (its setuptools builds the two packages),
    then into /staging, all the image copies. That second install must not count the stage's
    copies as installed: without --ignore-installed pip finds every package "already
    satisfied" and writes nothing under /staging (an image whose exporter cannot import
    uvicorn)."""
    into_staging = [a for a in pip_commands("install") if "--root /staging" in a]
    locked_into_staging = [a for a in into_staging if "-r requirements-image.txt" in a]
    assert len(locked_into_staging) == 1, into_staging
    assert "--ignore-installed" in locked_into_staging[0], locked_into_staging


def test_the_lock_pins_every_dependency_with_hashes() -> None:
    """Every dependency of the exporter and of its [csi] extra (the client aside: it comes from
    the repository) is in the lock, at a version its specifier allows, with hashes."""
    project = tomllib.loads((ROOT / "exporter" / "pyproject.toml").read_text())["project"]
    wanted = [
        Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["csi"]]
    ]
    lock = locked()
    for req in wanted:
        name = req.name.lower().replace("_", "-")
        if name == "trainmon-client":
            continue
        assert name in lock, f"{name} is not in {LOCK.name}"
        version, hashes = lock[name]
        assert req.specifier.contains(version), (name, version, str(req.specifier))
        assert hashes, name
    for name, (_, hashes) in lock.items():
        assert hashes, f"{name} has no hash"
    assert "setuptools" in lock  # builds the two packages with --no-build-isolation


def test_the_release_pushes_the_reference_the_manifests_name() -> None:
    """docs/scaling.md's release steps push one reference, and every kustomization's images:
    entry for the exporter names exactly it."""
    doc = (ROOT / "docs" / "scaling.md").read_text()
    block = doc.split("**The release steps**", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    (pushed,) = re.findall(r"-t (\S+) \.", block)
    assert "--output type=registry" in block and "SOURCE_DATE_EPOCH" in block
    names = set()
    for k in (ROOT / "deploy" / "kubernetes").rglob("kustomization.yaml"):
        for img in yaml.safe_load(k.read_text()).get("images", []):
            if img["name"] == "trainmon-exporter":
                names.add(f"{img['newName']}:{img['newTag']}")
    assert names == {pushed}, (names, pushed)


def test_the_lock_says_how_to_regenerate_it() -> None:
    text = (ROOT / "exporter" / "requirements-image.in").read_text()
    assert "pip-compile --generate-hashes" in text
    assert "requirements-image.txt" in LOCK.read_text().split("\n\n", 1)[0]
