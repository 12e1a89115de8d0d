"""A hung multi-node job, for real: the page names the rank and the line.

Two torch.distributed gloo jobs of four ranks on CPU, each with two ranks on each of two
exporters (two sockets, as two nodes); a real Prometheus with the shipped rules scraping both,
Alertmanager with the shipped routes, a receiver on loopback. In each job one rank never gets
its batch: in job ``sleep`` rank 2 waits in ``load_batch`` in a C call that released the GIL,
in job ``spin`` rank 1 spins in ``load_batch`` in pure Python, holding the GIL; the other three
ranks of each wait inside the all-reduce after it. The PagerDuty page of each run must name
its stuck rank with its function and line, and no other rank, within a minute of the hang
verdict; the status page of one node (its peer merged in) and ``trainmon status`` over both
must show "3 ranks in all_reduce, 1 not"; and the evidence must outlive the job's processes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from ..conftest import ROOT, ExporterProcess, child_env, free_port, short_tmpdir, wait_for
from .stack import PROM_DIR, Processes, Receiver, require_binaries, shipped

pytestmark = pytest.mark.slow
JOB = ROOT / "tests" / "helpers" / "hang_job.py"
SOURCE = JOB.read_text().splitlines()
SLEEP_LINE = next(i for i, ln in enumerate(SOURCE, 1) if "time.sleep(HOURS)" in ln)
SPIN_LINES = tuple(
    i for i, ln in enumerate(SOURCE, 1) if ln.strip().startswith(("while True:", "n += 1"))
)
CASES = {"sleep": 2, "spin": 1}
"""Job -> its stuck rank (ranks 0, 1 report to node A, 2, 3 to node B)."""


class Cluster:
    """Two exporters (node A reads node B as its status peer), Prometheus, Alertmanager."""

    def __init__(self) -> None:
        self.tmp = short_tmpdir()
        port_b = free_port()
        grace = ("--analytics.hang-grace-seconds", "2")
        self.b = ExporterProcess(self.tmp / "b.sock", port_b, *grace).start()
        peer = f"http://127.0.0.1:{port_b}"
        self.a = ExporterProcess(
            self.tmp / "a.sock", free_port(), *grace, "--status-peers", peer
        ).start()
        self.receiver = Receiver()
        self.procs = Processes(self.tmp)
        am = self.procs.alertmanager(self.receiver)
        prom = shipped("prometheus.yml")
        prom["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        prom["rule_files"] = [str(PROM_DIR / f) for f in prom["rule_files"]]
        prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [
            am.removeprefix("http://")
        ]
        prom["scrape_configs"][0]["static_configs"][0]["targets"] = [
            f"127.0.0.1:{self.a.port}",
            f"127.0.0.1:{self.b.port}",
        ]
        self.prom = self.procs.prometheus(prom, "prometheus")

    def node(self, rank: int) -> ExporterProcess:
        return self.a if rank < 2 else self.b

    def stop(self) -> None:
        self.procs.stop()
        self.a.stop()
        self.b.stop()
        self.receiver.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    require_binaries("prometheus", package="prometheus")
    require_binaries("prometheus-alertmanager", package="prometheus-alertmanager")
    pytest.importorskip("torch.distributed")
    c = Cluster()
    try:
        yield c
    finally:
        c.stop()


def start_job(c: Cluster, how: str) -> list[subprocess.Popen[str]]:
    port = free_port()
    return [
        subprocess.Popen(
            [
                sys.executable,
                str(JOB),
                *("--rank", str(rank), "--local-rank", str(rank % 2), "--port", str(port)),
                *("--socket", c.node(rank).socket, "--run", f"hang-{how}"),
                *("--stuck", str(CASES[how]), "--how", how),
            ],
            env=child_env(TORCH_FR_BUFFER_SIZE="2000"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(4)
    ]


def ranks(c: Cluster, run: str) -> dict[int, dict[str, Any]]:
    out = {}
    for ex in (c.a, c.b):
        for r in ex.runs()["runs"]:
            if r["run"] == run:
                out.update({k["rank"]: k for k in r["ranks"]})
    return out


def verdict(c: Cluster, run: str) -> float | None:
    """When the exporters judged the last of the run's four ranks hung (Unix s), once all were."""
    seen = ranks(c, run)
    times = [
        max((e["time"] for e in k["events"] if e["kind"] == "hang"), default=None)
        for k in seen.values()
    ]
    if len(seen) < 4 or None in times:
        return None
    return max(t for t in times if t is not None)


def pages(c: Cluster, run: str) -> list[tuple[Any, float]]:
    return [
        h
        for h in c.receiver.find("/pagerduty", f"run {run}", "TrainmonRunHung")
        if h[0]["event_action"] == "trigger"
    ]


def test_the_page_names_the_stuck_rank_and_its_line_on_two_nodes(cluster: Cluster) -> None:
    c = cluster
    wait_for(lambda: len(c.procs.log("prometheus.log")) > 0, timeout=30)
    jobs = {how: start_job(c, how) for how in CASES}
    try:
        verdicts = {
            how: wait_for(lambda how=how: verdict(c, f"hang-{how}"), timeout=180, interval=0.5)
            for how in CASES
        }
        paged = {
            how: wait_for(lambda how=how: pages(c, f"hang-{how}"), timeout=120, interval=0.5)[0]
            for how in CASES
        }
        for how, stuck in CASES.items():
            body, arrived = paged[how]
            text = body["payload"]["custom_details"]["summary"]
            node = c.node(stuck)
            line = f"{SLEEP_LINE}" if how == "sleep" else "(" + "|".join(map(str, SPIN_LINES)) + ")"
            named = re.search(
                rf"Suspects 1: rank {stuck} in load_batch \(hang_job\.py:{line}\) on "
                rf"127\.0\.0\.1:{node.port}\. Most wait in gloo:all_reduce \(3 ranks\)\.",
                text,
            )
            assert named, text
            others = [r for r in range(4) if r != stuck]
            assert not any(f"rank {r} in" in text for r in others), text
            took = arrived - verdicts[how]
            print(f"\n{how}: hang verdict -> page naming rank {stuck} after {took:.1f} s")
            assert took < 60, took
        # The node's status page, its peer merged in: one view per run, the suspect first.
        page = c.a.get("/").decode()
        for how, stuck in CASES.items():
            section = page[page.index(f"Hang · hang-{how}:") :]
            section = section[: section.find("<h2", 10) if "<h2" in section[10:] else None]
            assert f"suspects: rank {stuck};" in section, section[:400]
            heads = [h.rstrip(" ·") for h in re.findall(r"<td class='headline'>([^<]*)", section)]
            assert heads == ["1 rank in load_batch, 3 not", "3 ranks in all_reduce, 1 not"], heads
            assert section.index("<b>suspect</b>") < section.index("3 ranks in all_reduce")
        once = subprocess.run(
            [
                sys.executable,
                "-m",
                "trainmon_exporter",
                "status",
                "--once",
                "--url",
                c.a.url,
                "--url",
                c.b.url,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=child_env(),
            check=True,
        ).stdout
        hangs = once[once.index("# hangs") :]
        for how, stuck in CASES.items():
            assert f"hang-{how}: 4 of 4 ranks hung" in hangs and f"suspects: rank {stuck};" in hangs
        assert hangs.count("3 ranks in all_reduce, 1 not: ranks") == 2, hangs
        # The stuck ranks: one waited in C (no CPU), one spun holding the GIL (CPU).
        sleeping = ranks(c, "hang-sleep")[2]["hang"]["threads"][0]
        spinning = ranks(c, "hang-spin")[1]["hang"]["threads"][0]
        assert sleeping["training"] and sleeping["cpu"] == 0
        assert spinning["training"] and spinning["cpu"] > 0
        groups = ranks(c, "hang-sleep")[0]["hang"]["groups"]
        assert groups[0]["pending"]["op"] == "gloo:all_reduce", groups
    finally:
        for procs in jobs.values():
            for p in procs:
                p.kill()
        for procs in jobs.values():
            for p in procs:
                p.communicate(timeout=30)

    # The watchdog (here: SIGKILL) ended the processes; the evidence stays until they expire.
    def ended() -> bool:
        return all(not k["up"] for k in ranks(c, "hang-sleep").values())

    wait_for(ended, timeout=30)
    run = next(r for r in c.a.runs()["runs"] if r["run"] == "hang-sleep")
    assert run["hang"]["state"] == "ended" and run["hang"]["stacks"][0]["ranks"] == [0, 1]
    page = c.a.get("/").decode()
    assert "Hang · hang-sleep: ended since" in page and "1 rank in load_batch, 3 not" in page
    print(json.dumps(run["hang"], indent=1)[:600])
