"""Two nodes simulated on one machine: two exporters, two torchrun agents, four ranks.

Each "node" is a torchrun agent (static rendezvous, ``--node-rank`` 0 or 1, one shared
``--rdzv-id``) whose two ranks report to that node's own exporter, as a sidecar per node
would. The run id comes from torchrun's ``TORCHELASTIC_RUN_ID`` on every rank of both nodes.
"""

from __future__ import annotations

from collections.abc import Callable

from tests.conftest import ExporterProcess, free_port, trainmon_status
from tests.helpers.training import ranks_of, torchrun


def test_two_nodes_two_exporters_one_run(
    exporter_process: Callable[..., ExporterProcess],
) -> None:
    nodes = [exporter_process().start(), exporter_process().start()]
    port = free_port()
    agents = [
        torchrun(
            ex.socket,
            [
                "--nnodes=2",
                f"--node-rank={i}",
                "--nproc-per-node=2",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "--rdzv-id=two-node-job",
            ],
            "--steps",
            "20",
        )
        for i, ex in enumerate(nodes)
    ]
    for p in agents:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out
    for node, ex in enumerate(nodes):
        runs = ex.runs()["runs"]
        assert [r["run"] for r in runs] == ["two-node-job"], runs
        ranks = ranks_of(ex, "two-node-job")
        # Global ranks 0,1 on node 0 and 2,3 on node 1; local ranks 0,1 on each.
        assert [(r["rank"], r["local_rank"], r["world_size"]) for r in ranks] == [
            (2 * node, 0, 4),
            (2 * node + 1, 1, 4),
        ]
        assert all(r["status"] == "finished" and r["steps_total"] == 20 for r in ranks)
        once = trainmon_status("--url", ex.url, "--once")
        assert once.returncode == 0, once.stderr
        rows = [
            line.split()[:2]
            for line in once.stdout.splitlines()
            if line.startswith("two-node-job ")  # the ranks table, not the goodput line
        ]
        assert rows == [["two-node-job", f"{2 * node}/4"], ["two-node-job", f"{2 * node + 1}/4"]]
