"""Slurm for real: ``sbatch -N2 -n4`` runs the example trainer on a two-node cluster (see
``slurm_lab.py``), as user ``nobody``, with the shipped unit's exporter command, prolog, epilog
and task prolog. The cluster's Prometheus (the shipped ``prometheus-cluster.yml``) scrapes both
exporters through the file_sd file ``trainmon_slurm_sd.py`` writes from ``sinfo``, evaluates the
shipped rules and alerts through the shipped Alertmanager configuration to a receiver on
loopback.

Asserted: one run ``slurm-<job id>`` across both nodes with all four ranks, each with the node
it ran on; the run-level recordings; the job map dcgm-exporter reads and the socket ACL the
prolog grants (and the epilog takes back); and that killing the trainers of one node pages a
crash naming that node.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..conftest import ROOT, short_tmpdir, wait_for
from ..helpers.training import SMALL
from .slurm_lab import NODES, SLURM_DIR, SlurmLab, job_python, slurm_lab
from .stack import RULE_FILES, Processes, Receiver, fast_timing, query, require_binaries, shipped

pytestmark = pytest.mark.slow

TRAINER = ROOT / "examples" / "train_char_transformer.py"
TRAIN_ARGS = shlex.join([*SMALL, "--steps", "0", "--eval-every", "0", "--checkpoint-every", "0"])
# DDP over gloo across the two nodes: ranks from Slurm's task variables, rank 0's node as the
# rendezvous. The same recipe works on a real cluster (with NCCL and the right interface).
JOB = """\
#!/bin/bash
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
export MASTER_PORT=29500 GLOO_SOCKET_IFNAME=eth0 HOME=/tmp OMP_NUM_THREADS=1 {env}
exec timeout 600 srun bash -c \\
  'RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS exec "$@"' trainer \\
  {python} {trainer} {args}
"""


def api(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/api/v1/runs", timeout=5) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


class Cluster:
    """The lab, its Prometheus and Alertmanager, and one running job."""

    def __init__(self, lab: SlurmLab, procs: Processes, receiver: Receiver) -> None:
        self.lab, self.receiver = lab, receiver
        sd = lab.dir / "file_sd"
        sd.mkdir()
        t0 = time.monotonic()
        out = subprocess.run(
            [
                sys.executable,
                str(SLURM_DIR / "trainmon_slurm_sd.py"),
                "--gpu-nodes",
                f"--output={sd / 'trainmon.json'}",
            ],
            env=lab.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        print(f"\nfile_sd from sinfo in {time.monotonic() - t0:.2f} s: {out.stderr.strip()}")
        self.targets = json.loads((sd / "trainmon.json").read_text())
        self.am_url = procs.alertmanager(receiver)
        prom = shipped("prometheus-cluster.yml")
        fast_timing(prom)
        prom["global"]["external_labels"] = {"cluster": "tmlab"}
        prom["rule_files"] = [str(f) for f in RULE_FILES]
        prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [
            self.am_url.removeprefix("http://")
        ]
        prom["scrape_configs"][0]["file_sd_configs"][0]["files"] = [str(sd / "*.json")]
        del prom["remote_write"]  # the fleet store is the other tests' subject
        self.prom_url = procs.prometheus(prom, "prometheus")
        wait_for(
            lambda: len(query(self.prom_url, 'up{job="trainmon"} == 1')) == 2,
            timeout=60,
            interval=0.5,
        )
        python, env = job_python()
        script = lab.dir / "job.sh"
        script.write_text(
            JOB.format(
                env=" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()),
                python=python,
                trainer=TRAINER,
                args=TRAIN_ARGS,
            )
        )
        script.chmod(0o755)
        self.submitted = time.time()
        self.job = lab.slurm(
            "sbatch", "--parsable", "-N2", "-n4", "--gres=gpu:2", "--uid=nobody",
            f"--chdir={ROOT}", f"--output={lab.dir}/out/%j.out", str(script),
        ).stdout.strip()  # fmt: skip
        self.run = f"slurm-{self.job}"

    def output(self) -> str:
        f = self.lab.dir / "out" / f"{self.job}.out"
        return f.read_text(errors="replace") if f.exists() else "(no job output yet)"

    def ranks(self) -> list[dict[str, str]]:
        return [
            r["metric"] for r in query(self.prom_url, f'trainmon_rank_info{{run="{self.run}"}}')
        ]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    require_binaries("prometheus", package="prometheus")
    require_binaries("prometheus-alertmanager", package="prometheus-alertmanager")
    tmp = short_tmpdir()
    procs, receiver = Processes(tmp), Receiver()
    try:
        with slurm_lab() as lab:
            try:
                c = Cluster(lab, procs, receiver)
                try:
                    wait_for(lambda: len(c.ranks()) == 4, timeout=180, interval=0.5)
                except AssertionError:
                    raise AssertionError(f"job {c.job}:\n{c.output()}") from None
                print(f"4 ranks in Prometheus {time.time() - c.submitted:.1f} s after sbatch")
                yield c
            except BaseException:
                print(procs.log("prometheus.log")[-3000:])
                raise
            finally:
                procs.stop()
    finally:
        receiver.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_file_sd_from_sinfo_names_every_node(cluster: Cluster) -> None:
    lab = cluster.lab
    assert cluster.targets == [
        {
            "targets": [f"{lab.net}.1{i}:9478"],
            "labels": {"instance": f"{node}:9478", "node": node},
        }
        for i, node in enumerate(NODES, 1)
    ]


def test_one_run_across_both_nodes_with_all_four_ranks(cluster: Cluster) -> None:
    ranks = sorted(cluster.ranks(), key=lambda m: int(m["rank"]))
    seen = [(m["rank"], m["local_rank"], m["hostname"], m["node"], m["instance"]) for m in ranks]
    assert seen == [
        ("0", "0", "tmn1", "tmn1", "tmn1:9478"),
        ("1", "1", "tmn1", "tmn1", "tmn1:9478"),
        ("2", "0", "tmn2", "tmn2", "tmn2:9478"),
        ("3", "1", "tmn2", "tmn2", "tmn2:9478"),
    ], cluster.output()
    assert {m["world_size"] for m in ranks} == {"4"}
    prom, run = cluster.prom_url, cluster.run

    def value(expr: str) -> float | None:
        res = query(prom, expr)
        return float(res[0]["value"][1]) if len(res) == 1 else None

    wait_for(lambda: value(f'run:trainmon_run_up:sum{{run="{run}"}}') == 4, timeout=30)
    assert value(f'run:trainmon_run_world_size:max{{run="{run}"}}') == 4
    wait_for(lambda: (value(f'run:trainmon_train_tokens_per_second:sum{{run="{run}"}}') or 0) > 0)
    slowest = wait_for(
        lambda: query(
            prom, f'run:trainmon_train_step_time_median_seconds:slowest_rank{{run="{run}"}}'
        ),
        timeout=60,
    )
    assert len(slowest) == 1 and slowest[0]["metric"]["hostname"] in NODES
    print(f"slowest rank: {slowest[0]['metric']['rank']} on {slowest[0]['metric']['hostname']}")
    # Each node's exporter holds its own two ranks, opened by the job's user (nobody).
    for i, node in enumerate(NODES):
        runs = api(cluster.lab.node_url(node))["runs"]
        assert [(r["run"], r["owner_uid"]) for r in runs] == [(run, 65534)]
        assert [k["rank"] for k in runs[0]["ranks"]] == [2 * i, 2 * i + 1]


def test_prolog_writes_the_job_map_and_grants_the_socket(cluster: Cluster) -> None:
    lab, job = cluster.lab, cluster.job
    for node in NODES:
        # dcgm-exporter's --hpc-job-mapping-dir format: a file per GPU index, job ids in it.
        listing = lab.on_node(node, "sh", "-c", "cd /run/trainmon-jobs && grep -H . [0-9]*")
        assert sorted(listing.stdout.split()) == [f"0:{job}", f"1:{job}"]
        acl = lab.on_node(node, "getfacl", "-cn", "/run/trainmon/trainmon.sock").stdout
        assert "user:65534:rw-" in acl and "mask::rw-" in acl, acl
        # The run's owner claim, root's and writable by root only, as the exporter requires.
        owners = lab.on_node(node, "stat", "-c", "%u %a", "/run/trainmon-owners").stdout.split()
        claim = lab.on_node(node, "stat", "-c", "%u %a", f"/run/trainmon-owners/slurm-{job}")
        assert (owners, claim.stdout.split()) == (["0", "755"], ["0", "644"])
        assert lab.on_node(node, "cat", f"/run/trainmon-owners/slurm-{job}").stdout == "65534\n"


# A root process on a node opens a run; prints the exporter's refusal, or None.
OPEN_RUN = """
import sys, time, trainmon_client
r = trainmon_client.init(run=sys.argv[1], rank=0, world_size=1, local_rank=0,
                         socket_path="/run/trainmon/trainmon.sock", flush_interval=0.0)
for i in range(1, 60):
    r.log(i, loss=1.0)
    time.sleep(0.05)
    if r.refused_reason:
        break
print(r.refused_reason)
"""


def open_run(lab: SlurmLab, node: str, run: str) -> str:
    client = f"PYTHONPATH={ROOT / 'client' / 'src'}"
    return lab.on_node(node, "env", client, sys.executable, "-c", OPEN_RUN, run).stdout.strip()


def test_killing_one_nodes_trainers_pages_a_crash_naming_the_node(cluster: Cluster) -> None:
    lab = cluster.lab
    killed = [
        pid
        for pid in lab.pids_in("tmn2")
        if str(TRAINER).encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    ]
    assert len(killed) == 2, killed  # ranks 2 and 3
    t0 = time.time()
    for pid in killed:
        subprocess.run(["kill", "-9", str(pid)], check=True)

    body, arrived = wait_for(
        lambda: cluster.receiver.find(
            "/pagerduty", cluster.run, "TrainmonTrainerCrashed", "host: tmn2:9478"
        ),
        timeout=60,
        interval=0.2,
    )[0]
    details = json.dumps(body["payload"]["custom_details"])
    assert f"run: {cluster.run}" in details
    assert "rank: 2" in details or "rank: 3" in details, details
    print(f"kill -9 of tmn2's ranks -> PagerDuty page naming tmn2 after {arrived - t0:.2f} s")
    # The job ends (the other node's ranks lose their peers); the epilog undoes the prolog.
    wait_for(
        lambda: (
            not lab.slurm("squeue", "--noheader", "--jobs", cluster.job, check=False).stdout.strip()
        ),
        timeout=120,
        interval=0.5,
    )
    for node in NODES:
        left = lab.on_node(node, "ls", "-A", "/run/trainmon-jobs").stdout.split()
        assert left == [".lock"], left
        acl = lab.on_node(node, "getfacl", "-cn", "/run/trainmon", "/run/trainmon/trainmon.sock")
        assert "65534" not in acl.stdout, acl.stdout
        assert lab.on_node(node, "ls", "-A", "/run/trainmon-owners").stdout.split() == []
    print(f"job {cluster.job} ended; job map, socket ACL and owner claim cleared on both nodes")


def test_a_prolog_drops_a_job_whose_epilog_never_ran(cluster: Cluster) -> None:
    """A job whose epilog never ran (slurmd killed, an epilog that timed out) stays in the job
    map and holds its user's grant. The next job Slurm gives one of its GPUs displaces it: that
    job's prolog drops it from the node's own records (no call to slurmctld, the shipped
    default), and once that job has ended too, nothing of either is left."""
    lab, stale = cluster.lab, "999999"
    for node in NODES:
        # the prolog of a job Slurm never heard of, whose epilog will never run
        lab.on_node(
            node,
            "env",
            f"SLURM_JOB_ID={stale}",
            "SLURM_JOB_UID=65534",
            "SLURM_JOB_GPUS=0,1",
            "TRAINMON_RUNNING_JOBS=",
            "sh",
            str(SLURM_DIR / "trainmon-prolog.sh"),
        )
        left = lab.on_node(node, "cat", "/run/trainmon-jobs/0").stdout.split()
        assert left == [stale], left
        # The node's exporter reads the prolog's claim: the run is uid 65534's, though no
        # trainer of it ever connected, so root connecting first is refused.
        assert open_run(lab, node, f"slurm-{stale}") == "not_owner"
    job = lab.slurm(
        "sbatch", "--parsable", "-N2", "--gres=gpu:1", "--uid=nobody", f"--chdir={lab.dir}",
        f"--output={lab.dir}/out/%j.out", "--wrap", "sleep 1",
    ).stdout.strip()  # fmt: skip
    wait_for(
        lambda: not lab.slurm("squeue", "--noheader", "--jobs", job, check=False).stdout.strip(),
        timeout=120,
        interval=0.5,
    )
    for node in NODES:
        left = lab.on_node(node, "ls", "-A", "/run/trainmon-jobs").stdout.split()
        assert left == [".lock"], (node, left, lab.log()[-3000:])
        acl = lab.on_node(node, "getfacl", "-cn", "/run/trainmon", "/run/trainmon/trainmon.sock")
        assert "65534" not in acl.stdout, acl.stdout
        held = lab.on_node(node, "ls", "-A", "/run/trainmon-slurm/users").stdout.split()
        assert held == [], held
        claims = lab.on_node(node, "ls", "-A", "/run/trainmon-owners").stdout.split()
        assert claims == [], claims
    print(f"job {stale} (no epilog) dropped by the prolog of job {job} on both nodes")
