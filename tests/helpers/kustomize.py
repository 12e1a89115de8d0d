"""deploy/kubernetes rendered with ``kubectl kustomize`` (Debian's ``kubernetes-client``), once
per path and test session."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any

import yaml

from ..conftest import ROOT, require_tool

K8S = ROOT / "deploy" / "kubernetes"


def kubectl() -> str:
    return require_tool("kubectl", "kubernetes-client")


@functools.cache
def rendered(path: Path) -> tuple[dict[str, Any], ...]:
    """The objects ``kubectl kustomize deploy/kubernetes/<path>`` prints."""
    out = subprocess.run(
        [kubectl(), "kustomize", str(K8S / path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, f"kubectl kustomize {path}: {out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def the(objs: tuple[dict[str, Any], ...], kind: str, name: str | None = None) -> dict[str, Any]:
    """The one object of ``kind`` (and ``name``) among ``objs``."""
    (obj,) = [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    return obj


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    """The container (or init container) ``name`` of a pod spec."""
    (c,) = [c for c in [*spec.get("initContainers", []), *spec["containers"]] if c["name"] == name]
    return c
