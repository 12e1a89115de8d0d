"""The exporter's image, built twice from one commit, as the release steps build it.

No registry is reachable here, so the pinned base (``python:3.11-slim-bookworm@sha256:…``) is
replaced by the stand-in ``docker_engine.py`` builds from Debian packages (``--build-arg
BASE``); everything else is the shipped Dockerfile and lock, pip fetching each wheel and
checking it against the lock's hashes. A lock without the hash of a wheel fails the build.

Both builds read one copy of the working tree, taken before the first: a checkout that changes
while the builds run (an edit, a merge) must not look like a build that is not reproducible.
Two builds with ``--no-cache`` and one ``SOURCE_DATE_EPOCH`` must give the same layers (the
same ``diff_ids``: every file's bytes, mode, owner and time, and the order of the entries);
when they do not, the first differing pair of layers is compared entry by entry and the
failure says what differs. The image configurations (the exact JSON each image ID is the
SHA-256 of) may differ only in what Docker's classic builder, which builds here, writes from
the time of each step and the container it ran in (``CLASSIC_BUILDER_STAMPS``). The release
builds with BuildKit, which writes none of the container fields and takes the times from
``SOURCE_DATE_EPOCH`` (``rewrite-timestamp=true``), so a pushed image carries none of them.

The image then runs what the DaemonSet runs: the exporter answers its own health check and
serves metrics (its dependencies are in the image, not only on the builder), the CSI node
plugin starts, and both run as uid 10001.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from ..conftest import ROOT, short_tmpdir
from .docker_engine import Engine, EngineUnavailable, build_standins, require_engine

pytestmark = [pytest.mark.slow, pytest.mark.release]

EPOCH = 1_700_000_000
TAGS = ("trainmon-exporter:repro-1", "trainmon-exporter:repro-2")

CLASSIC_BUILDER_STAMPS = {
    "created",  # the wall-clock time of the last step
    "history[].created",  # ... of each step of this Dockerfile (the base's are its own)
    "container",  # the id of the throwaway container the last step ran in
    "container_config.Image",  # the id of the local intermediate image that step ran on
    "config.Image",  # the same intermediate image
}
"""Paths in the image configuration that the classic builder fills from each build's clock and
its throwaway containers and intermediate images (whose ids hash their own ``created``): two
builds always differ there, and nowhere else. BuildKit, which the release uses, writes no
``container``, ``container_config`` or ``config.Image`` and sets the times from
``SOURCE_DATE_EPOCH``."""


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    require_engine()
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


def snapshot_context(dest: Path) -> Path:
    """Copy the files of the working tree that git tracks or would track (not ignored) to
    ``dest``, links as links and modes kept: the build context of both builds."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for rel in sorted({os.fsdecode(p) for p in listed if p}):
        src, dst = ROOT / rel, dest / rel
        if not os.path.lexists(src):  # tracked, deleted in the working tree
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, dst)
    return dest


def build(engine: Engine, context: Path, tag: str) -> tuple[str, dict[str, Any]]:
    """Build ``tag`` from ``context`` without cache: its image ID and configuration (the
    exact bytes the ID hashes, read from the engine's own image store)."""
    t0 = time.monotonic()
    engine.docker(
        "build", "--network=host", "--no-cache", "-q", "-f", "exporter/Dockerfile",
        "--build-arg", "BASE=python:3.11-slim", "--build-arg", f"SOURCE_DATE_EPOCH={EPOCH}",
        "-t", tag, str(context),
    )  # fmt: skip
    image_id = engine.docker("image", "inspect", "-f", "{{.Id}}", tag, capture=True).stdout
    image_id = image_id.strip()
    store = engine.cache / "data" / "image" / "vfs" / "imagedb" / "content" / "sha256"
    raw = (store / image_id.removeprefix("sha256:")).read_bytes()
    assert "sha256:" + hashlib.sha256(raw).hexdigest() == image_id, "not the config of the ID"
    print(f"{tag}: {image_id} in {time.monotonic() - t0:.0f} s")
    return image_id, json.loads(raw)


def json_differences(a: Any, b: Any, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    """Where two JSON values differ: each path (``history[3].created``) and its two values
    (``None`` for a key only one has)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(a.keys() | b.keys()):
            yield from json_differences(a.get(k), b.get(k), f"{path}.{k}" if path else k)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from json_differences(x, y, f"{path}[{i}]")
    elif a != b:
        yield path, a, b


def layer_entries(stream: IO[bytes]) -> list[tuple[str, dict[str, Any], str]]:
    """Each entry of a layer tarball in order: its name, header fields and content digest."""
    out = []
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for m in tar:
            data = tar.extractfile(m) if m.isfile() else None
            digest = hashlib.sha256(data.read() if data else b"").hexdigest()[:16]
            header = {
                "type": m.type,
                "mode": oct(m.mode),
                "uid": m.uid,
                "gid": m.gid,
                "uname": m.uname,
                "gname": m.gname,
                "mtime": m.mtime,
                "size": m.size,
                "linkname": m.linkname,
                "pax": m.pax_headers,
            }
            out.append((m.name, header, digest))
    return out


def layer_differences(engine: Engine, tmp: Path, first: str, second: str, index: int) -> str:
    """What differs between layer ``index`` of two images (``docker save``): the entries only
    in one, the first place their order differs, each header field and content that differs."""
    entries = []
    for n, tag in enumerate((first, second)):
        saved = tmp / f"image-{n}.tar"
        engine.docker("save", "-o", str(saved), tag)
        with tarfile.open(saved) as image:
            manifest = json.load(image.extractfile("manifest.json"))  # type: ignore[arg-type]
            layer = image.extractfile(manifest[0]["Layers"][index])
            assert layer is not None
            entries.append(layer_entries(layer))
        saved.unlink()
    a, b = entries
    lines = [f"layer {index}: {len(a)} entries vs {len(b)}"]
    names_a, names_b = [e[0] for e in a], [e[0] for e in b]
    lines += [f"only in the first: {n}" for n in sorted(set(names_a) - set(names_b))[:20]]
    lines += [f"only in the second: {n}" for n in sorted(set(names_b) - set(names_a))[:20]]
    common_a = [n for n in names_a if n in set(names_b)]
    common_b = [n for n in names_b if n in set(names_a)]
    if common_a != common_b:
        i = next(i for i, (x, y) in enumerate(zip(common_a, common_b, strict=False)) if x != y)
        lines.append(f"entry order differs from entry {i}: {common_a[i]} vs {common_b[i]}")
    by_name = {name: (h, d) for name, h, d in b}
    for name, header, digest in a:
        if name not in by_name:
            continue
        h2, d2 = by_name[name]
        fields = {k: (v, h2[k]) for k, v in header.items() if v != h2[k]}
        if fields:
            lines.append(f"header of {name}: {fields}")
        if digest != d2:
            lines.append(f"content of {name}")
    return "\n".join(lines[:80])


def new_dangling(engine: Engine, before: set[str]) -> list[str]:
    ids = engine.docker("images", "-q", "--no-trunc", "-f", "dangling=true", capture=True)
    return [i for i in ids.stdout.split() if i not in before]


def test_two_builds_of_one_commit_have_the_same_layers(engine: Engine, tmp_path: Path) -> None:
    for tag in TAGS:  # what a failed run kept for inspection
        engine.docker("rmi", tag, check=False, capture=True)
    dangling = engine.docker("images", "-q", "--no-trunc", "-f", "dangling=true", capture=True)
    before = set(dangling.stdout.split())
    context = snapshot_context(tmp_path / "context")
    try:
        id1, first = build(engine, context, TAGS[0])
        time.sleep(1.5)  # a build a second later: any time that leaks in would differ
        id2, second = build(engine, context, TAGS[1])
    finally:
        # The build stage's intermediate images (full copies of the tree under vfs).
        for image in new_dangling(engine, before):
            engine.docker("rmi", image, check=False, capture=True)

    l1, l2 = first["rootfs"]["diff_ids"], second["rootfs"]["diff_ids"]
    if l1 != l2:
        index = next((i for i, (x, y) in enumerate(zip(l1, l2, strict=False)) if x != y), None)
        why = (
            f"{len(l1)} layers vs {len(l2)}"
            if index is None
            else layer_differences(engine, tmp_path, *TAGS, index)
        )
        pytest.fail(f"the layers differ (both images kept: {', '.join(TAGS)})\n{why}")

    differs = list(json_differences(first, second))
    fields = {re.sub(r"\[\d+\]", "[]", path) for path, _, _ in differs}
    unexpected = [
        d for d in differs if re.sub(r"\[\d+\]", "[]", d[0]) not in CLASSIC_BUILDER_STAMPS
    ]
    assert not unexpected, unexpected
    print(
        f"layers identical ({len(l1)}, the last {l1[-1]}); image IDs "
        f"{'identical' if id1 == id2 else 'differ'}: "
        f"the configurations differ in {len(differs)} places, all classic builder stamps "
        f"({', '.join(sorted(fields)) or 'none'}); created {first['created']} vs "
        f"{second['created']}"
    )

    image = TAGS[0]
    # The exporter itself, as docker-compose.yml runs it (its socket directory a tmpfs of
    # its user): the image's HEALTHCHECK command passes and /metrics answers.
    cid = engine.docker(
        "run", "-d", "--network=none", "--tmpfs", "/run/trainmon:uid=10001,gid=10001,mode=0750",
        "-e", "TRAINMON_COLLECTORS__GPU=false", "-e", "TRAINMON_COLLECTORS__RANK_GPU=false",
        image, capture=True,
    ).stdout.strip()  # fmt: skip
    try:
        health = engine.docker(
            "image", "inspect", "-f", "{{json .Config.Healthcheck.Test}}", image, capture=True
        ).stdout
        test = json.loads(health)
        assert test[0] == "CMD-SHELL", test
        deadline = time.monotonic() + 60
        while True:
            check = engine.docker("exec", cid, "sh", "-c", test[1], check=False, capture=True)
            if check.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        logs = engine.docker("logs", cid, check=False, capture=True)
        assert check.returncode == 0, check.stderr + logs.stdout + logs.stderr
        metrics = engine.docker(
            "exec", cid, "python", "-c",
            "import urllib.request as u; print(u.urlopen('http://127.0.0.1:9478/metrics').read().decode())",
            capture=True,
        ).stdout  # fmt: skip
        assert "\ntrainmon_build_info{" in metrics, metrics[:2000]
        uid = engine.docker("exec", cid, "id", capture=True).stdout
        assert uid.startswith("uid=10001(trainmon) gid=10001(trainmon)"), uid
    finally:
        engine.docker("rm", "-f", cid, check=False, capture=True)
    csi = engine.docker(
        "run", "--rm", "--network=none", "--entrypoint", "trainmon-csi-node", image, "--help",
        capture=True,
    )  # fmt: skip
    assert csi.returncode == 0 and "--socket-dir" in csi.stdout, csi.stdout + csi.stderr
    for tag in TAGS:
        engine.docker("rmi", tag, check=False, capture=True)
