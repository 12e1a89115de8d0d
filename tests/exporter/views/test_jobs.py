"""A run's job-wide figures, read back from the Prometheus that records them (``prometheus_url``).

A loopback HTTP server answers as Prometheus' query API does (the figures of a real
Prometheus evaluating the shipped rules are checked in tests/integration/test_goodput_job.py).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from trainmon_exporter.local import free_port
from trainmon_exporter.views.api import RunsResponse, RunView
from trainmon_exporter.views.cells import TERMINAL
from trainmon_exporter.views.jobs import JobSource


def sample(name: str, value: float, **labels: str) -> dict[str, Any]:
    return {"metric": {"__name__": name, **labels}, "value": [1.0, str(value)]}


ANSWER = [
    sample("run:trainmon_train_goodput:ratio", 0.41, run="llama", namespace="team-a"),
    sample("run:trainmon_train_goodput:ratio_1h", 0.35, run="llama", namespace="team-a"),
    sample(
        "run:trainmon_train_badput_seconds:sum",
        120,
        run="llama",
        namespace="team-a",
        kind="recovery",
    ),
    sample(
        "run:trainmon_train_badput_seconds:data_loading_critical_rank",
        0.5,
        run="llama",
        namespace="team-a",
        rank="3",
        hostname="gpu-7",
        instance="gpu-7:9478",
    ),
    # The same run id in two clusters: which one this exporter's is, is unknown.
    sample("run:trainmon_train_goodput:ratio", 0.9, run="twin", cluster="east"),
    sample("run:trainmon_train_goodput:ratio", 0.2, run="twin", cluster="west"),
]


class Fake:
    def __init__(self) -> None:
        self.queries: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.queries.append(parse_qs(urlparse(self.path).query)["query"][0])
                body = json.dumps({"status": "success", "data": {"result": ANSWER}}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def fake() -> Iterator[Fake]:
    f = Fake()
    yield f
    f.server.shutdown()
    f.server.server_close()


def runs(*keys: tuple[str, str]) -> RunsResponse:
    return RunsResponse(
        time=0.0,
        runs=[
            RunView(run=r, namespace=ns, world_size=4, owner_uid=None, goodput_ratio=0.5, ranks=[])
            for ns, r in keys
        ],
    )


def test_each_run_gets_its_job_figures_once_per_cache_period(fake: Fake) -> None:
    source = JobSource(fake.url)
    got = source.add_to(runs(("team-a", "llama"), ("", "twin"), ("", "absent")))
    llama, twin, absent = got.runs
    assert llama.job is not None
    assert (llama.job.goodput_ratio, llama.job.goodput_ratio_1h) == (0.41, 0.35)
    assert llama.job.badput_seconds == {"recovery": 120.0}
    assert (llama.job.waits_on_rank, llama.job.waits_on_hostname) == (3, "gpu-7")
    assert twin.job is None and absent.job is None
    # One query for every run, its run ids escaped inside the PromQL string.
    (query,) = fake.queries
    assert 'run=~"absent|llama|twin"' in query and "__name__=~" in query
    source.add_to(runs(("team-a", "llama")))
    assert len(fake.queries) == 1  # served from the cache
    line = TERMINAL.job(llama)
    assert line is not None and "whole job 41.0%, last hour 35.0%, waits on rank 3 on gpu-7" in line


def test_a_prometheus_that_does_not_answer_leaves_job_empty_in_bounded_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    source = JobSource(f"http://127.0.0.1:{free_port()}", timeout=1.0)
    t0 = time.monotonic()
    got = source.add_to(runs(("", "llama")))
    assert time.monotonic() - t0 < 2.0
    assert got.runs[0].job is None
    assert "cannot read job figures" in caplog.text
