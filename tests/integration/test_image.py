"""The exporter's image, built twice from one commit, as the release steps build it.

No registry is reachable here, so the pinned base (``python:3.11-slim-bookworm@sha256:…``) is
replaced by the stand-in ``docker_engine.py`` builds from Debian packages (``--build-arg
BASE``); everything else is the shipped Dockerfile and lock, pip fetching each wheel and
checking it against the lock's hashes. Two builds with ``--no-cache`` and one
``SOURCE_DATE_EPOCH`` must give the same layers (the same ``diff_ids``: every file's bytes,
mode, owner and time); the image configurations may differ only in what Docker's classic
builder stamps with the time and builder container of each build (``created``, each
``history[].created``, ``container``, ``container_config.Hostname``), which BuildKit sets from
``SOURCE_DATE_EPOCH`` instead. A lock without the hash of a wheel fails the build.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ..conftest import ROOT, short_tmpdir
from .docker_engine import Engine, EngineUnavailable, build_standins
from .stack import require_binaries

pytestmark = [pytest.mark.slow, pytest.mark.release]

BUILDER_STAMPS = {"created", "container"}
"""Top-level configuration fields the classic builder sets from the build's time and container."""


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    require_binaries("dockerd", "docker", package="docker.io")
    require_binaries("debootstrap", package="debootstrap")
    if os.geteuid() != 0:
        pytest.skip("dockerd needs root")
    tmp = short_tmpdir()
    tmp.chmod(0o755)
    log = (tmp / "docker.log").open("wb")
    eng = Engine(tmp, log)
    try:
        eng.start()
    except EngineUnavailable as e:
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.skip(f"dockerd cannot start here: {e}")
    try:
        build_standins(eng, {})
        yield eng
    finally:
        eng.stop()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def build(engine: Engine, tag: str, epoch: int) -> dict[str, Any]:
    t0 = time.monotonic()
    engine.docker(
        "build", "--network=host", "--no-cache", "-q", "-f", "exporter/Dockerfile",
        "--build-arg", "BASE=python:3.11-slim", "--build-arg", f"SOURCE_DATE_EPOCH={epoch}",
        "-t", tag, str(ROOT),
    )  # fmt: skip
    out = engine.docker("image", "inspect", tag, capture=True).stdout
    (image,) = json.loads(out)
    print(f"{tag}: {image['Id']} in {time.monotonic() - t0:.0f} s")
    return image  # type: ignore[no-any-return]


def test_two_builds_of_one_commit_have_the_same_layers(engine: Engine) -> None:
    first = build(engine, "trainmon-exporter:repro-1", 1_700_000_000)
    time.sleep(1.5)  # a build a second later: any time that leaks in would differ
    second = build(engine, "trainmon-exporter:repro-2", 1_700_000_000)
    assert first["RootFS"]["Layers"] == second["RootFS"]["Layers"]
    differs = {k for k in first.keys() | second.keys() if first.get(k) != second.get(k)} - {
        "Id",
        "RepoTags",
        "RepoDigests",
        "Metadata",
        "ContainerConfig",
        "Created",
        "Container",
        "Parent",  # the classic builder's local intermediate image; never pushed
        "Config",  # compared below
    }
    assert not differs, {k: (first.get(k), second.get(k)) for k in differs}
    c1, c2 = first.get("Config") or {}, second.get("Config") or {}
    # Config.Image names that local intermediate image, Config.Hostname the builder container.
    c_differs = {k for k in c1.keys() | c2.keys() if c1.get(k) != c2.get(k)}
    assert c_differs <= {"Image", "Hostname"}, {k: (c1.get(k), c2.get(k)) for k in c_differs}
    cc1, cc2 = first.get("ContainerConfig") or {}, second.get("ContainerConfig") or {}
    cc_differs = {k for k in cc1.keys() | cc2.keys() if cc1.get(k) != cc2.get(k)}
    # the builder container's id, its step, the local intermediate image it ran on
    assert cc_differs <= {"Hostname", "Cmd", "Image"}, cc_differs
    same_id = first["Id"] == second["Id"]
    print(
        f"layers identical ({len(first['RootFS']['Layers'])}); image IDs "
        f"{'identical' if same_id else 'differ'}: created {first['Created']} vs {second['Created']}"
    )
    # The image runs what the DaemonSet runs: the exporter and the CSI node plugin.
    for argv in (["--help"],):
        run = engine.docker(
            "run", "--rm", "--network=none", "trainmon-exporter:repro-1", *argv, capture=True
        )
        assert run.returncode == 0, run.stderr
    csi = engine.docker(
        "run", "--rm", "--network=none", "--entrypoint", "trainmon-csi-node",
        "trainmon-exporter:repro-1", "--help", capture=True,
    )  # fmt: skip
    assert csi.returncode == 0 and "--socket-dir" in csi.stdout, csi.stdout + csi.stderr
    uid = engine.docker(
        "run", "--rm", "--network=none", "--entrypoint", "id", "trainmon-exporter:repro-1",
        capture=True,
    ).stdout  # fmt: skip
    assert uid.startswith("uid=10001(trainmon) gid=10001(trainmon)"), uid
