"""A real Prometheus scrapes an exporter that serves HTTPS with basic auth, with the
``scrape_config`` docs/exporter.md gives: ``scheme: https``, ``tls_config.ca_file`` and
``basic_auth`` with a ``password_file``. A second job with a wrong password shows the
exporter refusing Prometheus and counting it."""

from __future__ import annotations

from pathlib import Path

from trainmon_client import init
from trainmon_exporter.local import LocalExporter

from ..conftest import parse_metrics, sample, wait_for
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
