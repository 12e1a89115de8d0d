"""Fleet storage for real, with the shipped configs and rule files unchanged.

1. Agent path: Prometheus in agent mode (``prometheus-agent.yml``) scrapes two exporters
   through file_sd and remote-writes to VictoriaMetrics; ``vmalert`` evaluates the shipped rule
   files against it, writes the recordings back and sends alerts to Alertmanager (shipped
   routes and templates) and on to a receiver on loopback. A NaN in a real two-rank run pages
   through that chain. The filter sits on the agent's ``remote_write`` (it is the only writer
   besides vmalert): VictoriaMetrics holds trainmon's series and ``up``, which the rules need,
   plus what vmalert wrote, and nothing else the agent scraped.
2. Cluster path: two per-cluster Prometheus servers (``prometheus-cluster.yml``, clusters
   ``east`` and ``west``) evaluate the rules and forward with ``write_relabel_configs`` to a
   Prometheus started with ``--web.enable-remote-write-receiver``, standing in for Mimir or
   Thanos Receive. It receives only ``run:*``, ``trainmon_rank_info`` and ``ALERTS``, keyed by
   cluster: the same run id from two clusters stays two runs.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from ..conftest import ExporterProcess, free_port, short_tmpdir, wait_for
from ..helpers.training import finished_output, torchrun
from .stack import (
    RULE_FILES,
    Processes,
    Receiver,
    am_alerts,
    fast_timing,
    query,
    require_binaries,
    shipped,
)

pytestmark = pytest.mark.slow


class Nodes:
    """Two exporters ("node1", "node2") and the file_sd file that lists them."""

    def __init__(self, tmp: Path, make: Callable[..., ExporterProcess]) -> None:
        self.exporters = [make().start(), make().start()]
        self.sd = tmp / "file_sd"
        self.sd.mkdir()
        groups = [
            {
                "targets": [f"127.0.0.1:{ex.port}"],
                "labels": {"instance": f"node{i}:9478", "node": f"node{i}"},
            }
            for i, ex in enumerate(self.exporters, 1)
        ]
        (self.sd / "trainmon.json").write_text(json.dumps(groups))

    def train(self, run: str, *args: str) -> float:
        """A real DDP run: one rank per node under two torchrun agents; its start time."""
        port, t0 = free_port(), time.time()
        agents = [
            torchrun(
                ex.socket,
                [
                    "--nnodes=2",
                    f"--node-rank={i}",
                    "--nproc-per-node=1",
                    "--master-addr=127.0.0.1",
                    f"--master-port={port}",
                    f"--rdzv-id={run}",
                ],
                *args,
            )
            for i, ex in enumerate(self.exporters)
        ]
        for p in agents:
            out = finished_output(p, timeout=300)
            assert p.returncode == 0, out
        return t0


@pytest.fixture
def stack_dir(request: pytest.FixtureRequest) -> Iterator[tuple[Path, Processes, Receiver]]:
    tmp = short_tmpdir()
    procs, receiver = Processes(tmp), Receiver()
    failed = request.session.testsfailed
    try:
        yield tmp, procs, receiver
    finally:
        procs.stop()
        if request.session.testsfailed > failed:
            procs.dump()
            print("--- receiver", [(p, json.dumps(b)[:300]) for p, b, _ in receiver.posts])
        receiver.close()
        shutil.rmtree(tmp, ignore_errors=True)


def names(url: str) -> set[str]:
    with urllib.request.urlopen(f"{url}/api/v1/label/__name__/values", timeout=5) as r:
        return set(json.loads(r.read())["data"])


def series(url: str, match: str) -> list[dict[str, str]]:
    q = urllib.parse.urlencode({"match[]": match, "start": time.time() - 3600})
    with urllib.request.urlopen(f"{url}/api/v1/series?{q}", timeout=10) as r:
        return json.loads(r.read())["data"]  # type: ignore[no-any-return]


def count_by_kind(found: list[dict[str, str]]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for s in found:
        name = s["__name__"]
        kind = (
            "run:*"
            if name.startswith("run:")
            else "trainmon_*"
            if name.startswith("trainmon_")
            else name
        )
        kinds[kind] = kinds.get(kind, 0) + 1
    return dict(sorted(kinds.items()))


def test_agent_victoriametrics_vmalert_alertmanager(
    exporter_process: Callable[..., ExporterProcess],
    stack_dir: tuple[Path, Processes, Receiver],
) -> None:
    require_binaries("victoria-metrics", "vmalert", package="victoria-metrics")
    require_binaries("prometheus", package="prometheus")
    require_binaries("prometheus-alertmanager", package="prometheus-alertmanager")
    tmp, procs, receiver = stack_dir
    nodes = Nodes(tmp, exporter_process)
    vm_port = free_port()
    vm = f"http://127.0.0.1:{vm_port}"
    procs.start(
        [
            "victoria-metrics",
            f"-storageDataPath={tmp / 'vm'}",
            f"-httpListenAddr=127.0.0.1:{vm_port}",
            "-retentionPeriod=1d",
            "-search.latencyOffset=0s",  # answer with the newest samples (default: 30 s back)
        ],
        "vm.log",
    )
    am = procs.alertmanager(receiver)
    agent = shipped("prometheus-agent.yml")
    fast_timing(agent)
    agent["global"]["external_labels"] = {"cluster": "east"}
    agent["scrape_configs"][0]["file_sd_configs"][0]["files"] = [str(nodes.sd / "*.json")]
    agent["remote_write"][0]["url"] = f"{vm}/api/v1/write"
    agent["remote_write"][0]["queue_config"] = {"batch_send_deadline": "1s"}
    procs.prometheus(agent, "agent", "--enable-feature=agent")
    vmalert_port = free_port()
    procs.start(
        [
            "vmalert",
            *(f"-rule={f}" for f in RULE_FILES),  # the shipped files, as they are
            f"-datasource.url={vm}",
            f"-remoteWrite.url={vm}",
            f"-remoteRead.url={vm}",
            f"-notifier.url={am}",
            "-evaluationInterval=1s",
            "-remoteWrite.flushInterval=1s",
            f"-httpListenAddr=127.0.0.1:{vmalert_port}",
        ],
        "vmalert.log",
    )
    t_up = time.time()
    wait_for(lambda: len(query(vm, 'up{job="trainmon",cluster="east"} == 1')) == 2, timeout=60)
    print(f"\nboth exporters queryable in VictoriaMetrics {time.time() - t_up:.1f} s after start")

    t0 = nodes.train("fleet-nan", "--steps", "120", "--inject-nan-at", "40")
    nan = 'trainmon_train_nonfinite_values_total{run="fleet-nan",field="loss"} > 0'
    wait_for(lambda: len(query(vm, nan)) == 2, timeout=60, interval=0.2)
    t_vm = time.time()
    hits = wait_for(
        lambda: receiver.find("/pagerduty", "fleet-nan", "TrainmonRunNonFinite"),
        timeout=90,
        interval=0.2,
    )
    body, arrived = hits[0]
    details = json.dumps(body["payload"]["custom_details"])
    assert "run: fleet-nan" in details
    assert "ranks with any so far: 0 on node1:9478, 1 on node2:9478" in details, details
    # vmalert keeps the series' cluster label on the alert: the fleet's key for the run.
    held = am_alerts(am, 'alertname="TrainmonRunNonFinite"', 'run="fleet-nan"')
    assert held and held[0]["labels"]["cluster"] == "east", held
    print(
        f"run of 120 steps (NaN at 40) took {t_vm - t0:.1f} s to a NaN count in VictoriaMetrics; "
        f"page {arrived - t_vm:.1f} s later"
    )

    # vmalert evaluates every shipped rule against VictoriaMetrics without an error.
    with urllib.request.urlopen(f"http://127.0.0.1:{vmalert_port}/api/v1/rules") as r:
        groups = json.loads(r.read())["data"]["groups"]
    rules = [rule for g in groups for rule in g["rules"]]
    shipped_rules = sum(
        len(g["rules"]) for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"]
    )
    assert len(rules) == shipped_rules
    assert not [(r["name"], r["lastError"]) for r in rules if r.get("lastError")]
    wait_for(lambda: query(vm, 'run:trainmon_run_world_size:max{run="fleet-nan"} == 2'))

    # The store holds what the agent forwarded and what vmalert wrote, nothing else.
    stored = names(vm)
    recorded = {
        rule["record"]
        for f in RULE_FILES
        for g in yaml.safe_load(f.read_text())["groups"]
        for rule in g["rules"]
        if "record" in rule
    }
    allowed = re.compile(r"trainmon_.+|up|ALERTS|ALERTS_FOR_STATE")
    unknown = {n for n in stored if n not in recorded and not allowed.fullmatch(n)}
    assert stored and not unknown, sorted(unknown)
    scraped = {name for name, _ in nodes.exporters[0].metrics()}
    dropped = sorted(n for n in scraped if not allowed.fullmatch(n))
    assert dropped and not set(dropped) & stored  # e.g. process_*: scraped, not forwarded
    assert "scrape_duration_seconds" not in stored
    everything = series(vm, '{__name__=~".+"}')
    print(f"VictoriaMetrics holds {len(everything)} series: {count_by_kind(everything)}")
    print(f"filtered out at the agent: {len(dropped)} names, e.g. {dropped[:3]}")


def test_cluster_prometheus_forwards_only_what_the_fleet_needs(
    exporter_process: Callable[..., ExporterProcess],
    stack_dir: tuple[Path, Processes, Receiver],
) -> None:
    require_binaries("prometheus", package="prometheus")
    tmp, procs, _ = stack_dir
    nodes = Nodes(tmp, exporter_process)
    fleet = procs.prometheus(
        {"global": {"scrape_interval": "1m"}}, "fleet", "--web.enable-remote-write-receiver"
    )
    clusters = {}
    for name in ("east", "west"):
        cfg = shipped("prometheus-cluster.yml")
        fast_timing(cfg)
        cfg["global"]["external_labels"] = {"cluster": name}
        cfg["rule_files"] = [str(f) for f in RULE_FILES]
        del cfg["alerting"]  # ALERTS series exist without an Alertmanager
        cfg["scrape_configs"][0]["file_sd_configs"][0]["files"] = [str(nodes.sd / "*.json")]
        cfg["remote_write"][0]["url"] = f"{fleet}/api/v1/write"
        cfg["remote_write"][0]["queue_config"] = {"batch_send_deadline": "1s"}
        clusters[name] = procs.prometheus(cfg, f"prom-{name}")
    for url in clusters.values():
        wait_for(lambda u=url: len(query(u, 'up{job="trainmon"} == 1')) == 2, timeout=60)

    nodes.train("fleet-two", "--steps", "60")
    per_cluster = 'run:trainmon_run_world_size:max{run="fleet-two"}'
    got = wait_for(lambda: (r := query(fleet, per_cluster)) and len(r) == 2 and r, timeout=60)
    assert sorted(r["metric"]["cluster"] for r in got) == ["east", "west"]
    assert [r["value"][1] for r in got] == ["2", "2"]  # two ranks each, not four mixed
    wait_for(lambda: query(fleet, 'ALERTS{alertname="Watchdog"}'), timeout=30)
    wait_for(lambda: len(query(fleet, 'trainmon_rank_info{run="fleet-two"}')) == 4, timeout=30)

    stored = names(fleet)
    assert all(re.fullmatch(r"run:.+|trainmon_rank_info|ALERTS", n) for n in stored), stored
    assert {"trainmon_rank_info", "ALERTS"} <= stored
    received = series(fleet, '{__name__=~".+"}')
    local = series(clusters["east"], '{__name__=~".+"}')
    assert {s["cluster"] for s in received} == {"east", "west"}
    print(
        f"\ncluster east holds {len(local)} series; the fleet store received "
        f"{len(received)} from both clusters: {count_by_kind(received)}"
    )
