"""A real Prometheus scrapes an exporter that serves HTTPS with basic auth, with the
``scrape_config`` docs/exporter.md gives: ``scheme: https``, ``tls_config.ca_file`` and
``basic_auth`` with a ``password_file``. A second job with a wrong password shows the
exporter refusing Prometheus and counting it. Then the Kubernetes overlay
``overlays/daemonset-tls``: its exporter environment, Secret layout, probes and PodMonitor,
run together."""

from __future__ import annotations

import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path, PurePosixPath

import pytest
import yaml

from trainmon_client import init
from trainmon_exporter.local import LocalExporter

from ..conftest import ROOT, child_env, parse_metrics, require_tool, sample, wait_for
from ..helpers.tls import PASSWORD, USER, bcrypt_hash, make_pki, write_web_config
from .stack import Processes, query, require_binaries


def test_prometheus_scrapes_over_tls_with_basic_auth(tmp_path: Path) -> None:
    require_binaries("prometheus", package="prometheus")
    pki = make_pki(tmp_path)
    web = write_web_config(
        tmp_path / "web.yml",
        {
            "tls_server_config": {
                "cert_file": str(pki.server_cert),
                "key_file": str(pki.server_key),
            },
            "basic_auth_users": {USER: bcrypt_hash(PASSWORD)},
        },
    )
    (tmp_path / "password").write_text(PASSWORD)
    (tmp_path / "wrong-password").write_text("not-" + PASSWORD)
    procs = Processes(tmp_path)
    with LocalExporter(
        "--web.config.file", str(web), ssl_context=pki.client_context(), auth=(USER, PASSWORD)
    ) as ex:
        run = init(run="tls-run", rank=0, world_size=1, socket_path=ex.socket)
        for step in range(5):
            run.log(step, loss=2.5, tokens=1024)
        target = f"127.0.0.1:{ex.port}"

        def job(name: str, password_file: str) -> dict[str, object]:
            return {
                "job_name": name,
                "scheme": "https",
                "tls_config": {"ca_file": str(pki.ca)},
                "basic_auth": {"username": USER, "password_file": str(tmp_path / password_file)},
                "static_configs": [{"targets": [target]}],
            }

        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [job("trainmon", "password"), job("intruder", "wrong-password")],
        }
        try:
            url = procs.prometheus(config, "prometheus")
            up = wait_for(
                lambda: (
                    {r["metric"]["job"]: r["value"][1] for r in query(url, "up")}
                    if len(query(url, "up")) == 2
                    else None
                ),
                timeout=60,
                interval=0.5,
            )
            assert up == {"trainmon": "1", "intruder": "0"}, up
            loss = wait_for(
                lambda: query(url, 'trainmon_train_loss{job="trainmon",run="tls-run"}'),
                timeout=30,
                interval=0.5,
            )
            assert loss[0]["value"][1] == "2.5"
            assert query(url, '{job="intruder",__name__=~"trainmon_.*"}') == []
            run.finish()
            refused = sample(
                parse_metrics(ex.get("/metrics").decode()),
                "trainmon_http_auth_failures_total",
                reason="rejected",
            )
            assert refused is not None and refused >= 1  # the intruder job's scrapes
        except BaseException:
            procs.dump()
            raise
        finally:
            procs.stop()


def test_prometheus_scrapes_the_kubernetes_tls_overlay_as_its_podmonitor_says(
    tmp_path: Path,
) -> None:
    """overlays/daemonset-tls for real, without a cluster: the exporter runs with the
    container's TRAINMON_* environment and its Secret's files laid out as the volume would
    be, the kubelet's tcpSocket probe connects without credentials while HTTP routes refuse
    them, and Prometheus scrapes with what the PodMonitor names (scheme, CA, server name,
    basic auth, sample limit), as prometheus-operator would configure it."""
    require_binaries("prometheus", package="prometheus")
    kubectl = require_tool("kubectl", "kubernetes-client")
    out = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "deploy" / "kubernetes" / "overlays" / "daemonset-tls")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    objs = [d for d in yaml.safe_load_all(out.stdout) if d]
    (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
    (pm,) = [o for o in objs if o["kind"] == "PodMonitor"]
    spec = ds["spec"]["template"]["spec"]
    (c,) = [c for c in spec["containers"] if c["name"] == "exporter"]
    # The downward API's fields as the kubelet would fill them in for this pod.
    fields = {"metadata.namespace": ds["metadata"]["namespace"]}
    env = {
        e["name"]: e["value"] if "value" in e else fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        for e in c["env"]
    }
    # Each Secret volume becomes a directory here; the paths in web.yml follow the mounts.
    mounted = {}
    for mount in c["volumeMounts"]:
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        if "secret" in volume:
            mounted[PurePosixPath(mount["mountPath"])] = tmp_path / volume["secret"]["secretName"]
            mounted[PurePosixPath(mount["mountPath"])].mkdir()

    def here(path: str) -> Path:
        return mounted[PurePosixPath(path).parent] / PurePosixPath(path).name

    endpoint = pm["spec"]["podMetricsEndpoints"][0]
    tls = endpoint["tlsConfig"]
    pki = make_pki(tmp_path, tls["serverName"])
    cert, key = "/etc/trainmon/tls/tls.crt", "/etc/trainmon/tls/tls.key"  # docs/exporter.md
    here(cert).write_bytes(pki.server_cert.read_bytes())
    here(key).write_bytes(pki.server_key.read_bytes())
    assert here(cert).parent.name == "trainmon-exporter-tls"
    web = here(env["TRAINMON_WEB_CONFIG_FILE"])
    write_web_config(
        web,
        {
            "tls_server_config": {"cert_file": str(here(cert)), "key_file": str(here(key))},
            "basic_auth_users": {USER: bcrypt_hash(PASSWORD)},
        },
    )
    # The scrape Secret: CA, user name and password under the keys the PodMonitor names.
    scrape_dir = tmp_path / "scrape-secret"
    scrape_dir.mkdir()
    (scrape_dir / tls["ca"]["secret"]["key"]).write_bytes(pki.ca.read_bytes())
    auth = endpoint["basicAuth"]
    (scrape_dir / auth["username"]["key"]).write_text(USER)
    (scrape_dir / auth["password"]["key"]).write_text(PASSWORD)
    assert {tls["ca"]["secret"]["name"], auth["username"]["name"], auth["password"]["name"]} == {
        "trainmon-scrape"
    }

    child = {k: v for k, v in env.items() if k.startswith("TRAINMON_")}
    for k in ("TRAINMON_LISTEN", "TRAINMON_SOCKET", "TRAINMON_SOCKET_GROUP"):
        child.pop(k)  # this test's own port and socket
    child["TRAINMON_WEB_CONFIG_FILE"] = str(web)
    procs = Processes(tmp_path)
    with LocalExporter(
        env=child_env(**child), ssl_context=pki.client_context(), auth=(USER, PASSWORD)
    ) as ex:
        # The probes: a TCP connection without credentials, where HTTP needs them.
        for probe in (c["readinessProbe"], c["livenessProbe"]):
            assert "httpGet" not in probe and probe["tcpSocket"]["port"] == "metrics"
        with socket.create_connection(("127.0.0.1", ex.port), timeout=5):
            pass
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{ex.url}/readyz", context=pki.client_context(), timeout=5)
        refused.value.close()
        assert refused.value.code == 401  # an httpGet probe would need the credentials
        target = f"127.0.0.1:{ex.port}"
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [
                {
                    "job_name": "trainmon",
                    "scheme": endpoint["scheme"],
                    "sample_limit": pm["spec"]["sampleLimit"],
                    "tls_config": {
                        "ca_file": str(scrape_dir / tls["ca"]["secret"]["key"]),
                        "server_name": tls["serverName"],
                    },
                    "basic_auth": {
                        "username": (scrape_dir / auth["username"]["key"]).read_text(),
                        "password_file": str(scrape_dir / auth["password"]["key"]),
                    },
                    "static_configs": [{"targets": [target]}],
                }
            ],
        }
        try:
            url = procs.prometheus(config, "prometheus")
            up = wait_for(lambda: query(url, "up"), timeout=60, interval=0.5)
            wait_for(lambda: query(url, "up == 1"), timeout=30, interval=0.5)
            limit = wait_for(
                lambda: query(url, "trainmon_exporter_sample_limit"), timeout=30, interval=0.5
            )
            assert float(limit[0]["value"][1]) == pm["spec"]["sampleLimit"], up
            assert query(url, "trainmon_http_auth_failures_total{reason='rejected'} > 0") == []
        except BaseException:
            procs.dump()
            raise
        finally:
            procs.stop()
