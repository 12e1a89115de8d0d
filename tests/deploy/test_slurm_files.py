"""deploy/slurm without a cluster: the unit passes ``systemd-analyze verify``, the file_sd
generator turns real ``sinfo`` output into targets and never empties its file when Slurm cannot
answer, and the prolog and epilog, run as Slurm runs them (as scripts, with the job's
variables), keep dcgm-exporter's job map and the socket ACL right across overlapping jobs.
The same files run inside a real two-node cluster in tests/integration/test_slurm.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from trainmon_exporter.claims import OwnerClaims

from ..conftest import ROOT, require_tool

SLURM = ROOT / "deploy" / "slurm"


def sd() -> ModuleType:
    path = SLURM / "trainmon_slurm_sd.py"
    spec = importlib.util.spec_from_file_location("trainmon_slurm_sd", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def verify(text: str, name: str, tmp_path: Path) -> str:
    """Output of ``systemd-analyze verify`` for a unit file: a line per unknown directive or
    invalid value, nothing when the unit is right."""
    analyze = require_tool("systemd-analyze", "systemd")
    path = tmp_path / name
    path.write_text(text)
    out = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return (out.stdout + out.stderr).strip()


def installed(unit: str, program: str) -> str:
    """The shipped unit with its program replaced by one that exists here (verify checks)."""
    return (SLURM / unit).read_text().replace(program, sys.executable)


def test_exporter_unit_verifies(tmp_path: Path) -> None:
    unit = (SLURM / "trainmon-exporter.service").read_text()
    assert "\nExecStart=/opt/trainmon/bin/trainmon-exporter --socket /run/trainmon/" in unit
    for needed in ("RuntimeDirectory=trainmon", "ProtectSystem=strict", "NoNewPrivileges=yes"):
        assert f"\n{needed}\n" in unit
    # Started before slurmd, so the first job's prolog finds /run/trainmon (the
    # RuntimeDirectory, made before the exporter's process starts: Type=exec) to grant on.
    unit_section = unit.split("\n[Service]")[0]
    assert "\nBefore=slurmd.service\n" in unit_section
    assert "\nType=exec\n" in unit
    assert "\nPrivateDevices=yes" not in unit  # it would hide /dev/nvidia* from NVML
    text = installed("trainmon-exporter.service", "/opt/trainmon/bin/trainmon-exporter")
    assert verify(text, "trainmon-exporter.service", tmp_path) == ""
    typo = text.replace("ProtectSystem=strict", "ProtectSystem=strikt")
    assert "strikt" in verify(typo, "typo.service", tmp_path)  # the check can fail


def test_the_scrape_restriction_drop_in_verifies(tmp_path: Path) -> None:
    """The drop-in that admits only the Prometheus servers: its directives are valid in the
    exporter's unit (verified merged into it), and it denies every other address."""
    drop_in = (SLURM / "scrape-from-prometheus.conf").read_text()
    lines = [ln for ln in drop_in.splitlines() if ln and not ln.startswith("#")]
    assert lines[0] == "[Service]" and "IPAddressDeny=any" in lines
    assert any(ln.startswith("IPAddressAllow=") and "localhost" in ln for ln in lines)
    text = installed("trainmon-exporter.service", "/opt/trainmon/bin/trainmon-exporter")
    merged = text.replace("\n[Install]", "\n" + "\n".join(lines[1:]) + "\n\n[Install]")
    assert "IPAddressDeny=any" in merged
    assert verify(merged, "trainmon-exporter.service", tmp_path) == ""
    broken = merged.replace("IPAddressDeny=any", "IPAddressDeny=anything")
    assert "anything" in verify(broken, "broken.service", tmp_path)  # the check can fail


def test_file_sd_unit_verifies(tmp_path: Path) -> None:
    text = installed("trainmon-slurm-sd.service", "/usr/local/bin/trainmon_slurm_sd.py")
    assert verify(text, "trainmon-slurm-sd.service", tmp_path) == ""


# sinfo --all --noheader --Node --format='%N|%o|%n|%P|%G|%T' on a Slurm 22.05 cluster, with the
# states and flags sinfo(1) documents.
SINFO = """\
gpu001|10.0.0.1|gpu001|gpu*|gpu:8|mixed
gpu001|10.0.0.1|gpu001|debug|gpu:8|mixed
gpu002|10.0.0.2|gpu002.cluster|gpu*|gpu:h100:8(S:0-1)|idle+drain
gpu003|10.0.0.3|gpu003|gpu*|gpu:8|down*
gpu004|10.0.0.4|gpu004|gpu*|gpu:8|idle~
cpu001|10.0.1.1|cpu001|cpu|(null)|allocated
"""


def test_targets_from_sinfo() -> None:
    m = sd()
    nodes = m.parse_sinfo(SINFO)
    assert [(n["name"], n["partitions"], n["state"]) for n in nodes] == [
        ("gpu001", "gpu,debug", "mixed"),
        ("gpu002", "gpu", "idle+drain"),
        ("gpu003", "gpu", "down+not_responding"),
        ("gpu004", "gpu", "idle+powered_down"),
        ("cpu001", "cpu", "allocated"),
    ]
    # Down and powered-down nodes are left out; a drained node (running jobs) is kept.
    assert m.targets(nodes, 9478, gpu_nodes=True) == [
        {"targets": ["10.0.0.1:9478"], "labels": {"instance": "gpu001:9478", "node": "gpu001"}},
        {"targets": ["10.0.0.2:9478"], "labels": {"instance": "gpu002:9478", "node": "gpu002"}},
    ]
    by_host = m.targets(nodes, 9100, address="hostname", skip_states=())
    assert [g["targets"][0] for g in by_host] == [
        "cpu001:9100",
        "gpu001:9100",
        "gpu002.cluster:9100",
        "gpu003:9100",
        "gpu004:9100",
    ]
    with pytest.raises(m.SlurmError, match="unexpected sinfo line"):
        m.parse_sinfo("gpu001|10.0.0.1|gpu001\n")


def test_ipv6_node_addresses_are_bracketed() -> None:
    """Prometheus reads ``host:port`` with an IPv6 host only in brackets."""
    m = sd()
    nodes = m.parse_sinfo(
        "gpu005|fd00::11|gpu005|gpu*|gpu:8|mixed\ngpu006|::1|gpu006|gpu|gpu:8|idle\n"
    )
    assert [g["targets"] for g in m.targets(nodes, 9478)] == [["[fd00::11]:9478"], ["[::1]:9478"]]
    assert m.targets(nodes, 9478)[0]["labels"]["instance"] == "gpu005:9478"
    assert m.host_port("10.0.0.1", 9478) == "10.0.0.1:9478"
    assert m.host_port("[fd00::11]", 9478) == "[fd00::11]:9478"


def test_the_file_is_kept_when_slurm_cannot_answer(tmp_path: Path) -> None:
    out = tmp_path / "trainmon.json"
    old = [{"targets": ["10.0.0.1:9478"], "labels": {"instance": "a:9478", "node": "a"}}]
    out.write_text(json.dumps(old))
    env = {**os.environ, "PATH": str(tmp_path / "no-slurm-here")}
    run = subprocess.run(
        [sys.executable, str(SLURM / "trainmon_slurm_sd.py"), f"--output={out}"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1 and "sinfo not found" in run.stderr
    assert json.loads(out.read_text()) == old


def test_write_if_changed_is_atomic_and_lazy(tmp_path: Path) -> None:
    m = sd()
    out = tmp_path / "trainmon.json"
    groups = [{"targets": ["h:9478"], "labels": {"instance": "h:9478", "node": "h"}}]
    assert m.write_if_changed(out, groups) is True
    inode = out.stat().st_ino
    assert m.write_if_changed(out, groups) is False and out.stat().st_ino == inode
    assert m.write_if_changed(out, []) is True and json.loads(out.read_text()) == []
    assert out.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trainmon.json"]  # no temp left


class Node:
    """A node's directories and the exporter's socket, for the prolog and epilog."""

    def __init__(self, tmp: Path, mode: int = 0o660) -> None:
        self.run = tmp / "run-trainmon"
        self.run.mkdir(mode=0o755)
        self.sock_path = self.run / "trainmon.sock"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(str(self.sock_path))
        os.chmod(self.sock_path, mode)
        self.map = tmp / "jobs"
        self.state = tmp / "state"
        self.claims = tmp / "owners"
        self.defaults = tmp / "defaults"
        self.defaults.write_text(
            f"TRAINMON_SOCKET={self.sock_path}\nTRAINMON_JOB_MAP_DIR={self.map}\n"
            f"TRAINMON_SLURM_STATE={self.state}\nTRAINMON_OWNER_CLAIMS={self.claims}\n"
        )

    def script(self, name: str, job: int, uid: int = 65534, **env: str) -> str:
        out = subprocess.run(
            ["sh", str(SLURM / name)],
            env={
                "PATH": os.environ["PATH"],
                "TRAINMON_SLURM_DEFAULTS": str(self.defaults),
                "SLURM_JOB_ID": str(job),
                "SLURM_JOB_UID": str(uid),
                **env,
            },
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr  # a failing prolog would drain the node
        return out.stderr

    def job_map(self) -> dict[str, list[str]]:
        return {
            f.name: f.read_text().splitlines()
            for f in sorted(self.map.iterdir())
            if not f.name.startswith(".")
        }

    def owners(self) -> dict[str, int | None]:
        """Every claim in the directory, as the exporter reads it."""
        reader = OwnerClaims(self.claims)
        found = {f.name: reader.lookup(f.name) for f in sorted(self.claims.iterdir())}
        assert not any(reader.invalid.values()), reader.invalid
        return found

    def acl(self, path: Path) -> str:
        return subprocess.run(
            ["getfacl", "-cn", str(path)], capture_output=True, text=True, check=True
        ).stdout


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    require_tool("setfacl", "acl")
    if os.geteuid() != 0:
        pytest.skip("the prolog's ACLs name other users: run as root, as slurmd does")
    n = Node(tmp_path)
    probe = subprocess.run(["setfacl", "-m", "u:65534:r", str(tmp_path)], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no POSIX ACLs on {tmp_path}: {probe.stderr.decode().strip()}")
    yield n
    n.sock.close()


def test_prolog_and_epilog_over_overlapping_jobs(node: Node) -> None:
    node.script("trainmon-prolog.sh", 41, SLURM_JOB_GPUS="0,1")
    node.script("trainmon-prolog.sh", 42, CUDA_VISIBLE_DEVICES="1,3.1")  # MIG instance 3.1
    node.script("trainmon-prolog.sh", 42, CUDA_VISIBLE_DEVICES="1")  # run twice: no duplicate
    # dcgm-exporter's --hpc-job-mapping-dir: a file per GPU index, a job id per line.
    assert node.job_map() == {"0": ["41"], "1": ["41", "42"], "3.1": ["42"]}
    assert all(f.stat().st_mode & 0o777 == 0o644 for f in node.map.iterdir())
    # The job's user may connect; the mask is the socket's group bits, as the exporter set them.
    assert "user:65534:rw-" in node.acl(node.sock_path) and "mask::rw-" in node.acl(node.sock_path)
    assert "default:user:65534:rw-" in node.acl(node.run)
    node.script("trainmon-epilog.sh", 41)
    assert node.job_map() == {"1": ["42"], "3.1": ["42"]}
    assert "user:65534:rw-" in node.acl(node.sock_path)  # job 42 of the same user still runs
    node.script("trainmon-epilog.sh", 42)
    assert node.job_map() == {}
    assert "65534" not in node.acl(node.sock_path) + node.acl(node.run)


def fake_slurm_clients(tmp: Path) -> tuple[str, Path]:
    """A PATH whose ``squeue``, ``scontrol`` and ``sinfo`` only record that they were called
    (a call would reach slurmctld on a real cluster); returns it and the record file."""
    bin_dir, calls = tmp / "slurm-clients", tmp / "slurmctld-calls"
    bin_dir.mkdir()
    for name in ("squeue", "scontrol", "sinfo", "sacct"):
        f = bin_dir / name
        f.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\nexit 1\n')
        f.chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}", calls


def test_a_prolog_drops_a_job_displaced_from_its_gpus_without_asking_slurmctld(
    node: Node, tmp_path: Path
) -> None:
    """Job 41's epilog never ran (slurmd killed, an epilog that timed out). Slurm gives its
    GPU 1 to job 42, which it does only once 41 has ended on this node: 42's prolog drops
    every entry of 41 (the job map's files of both its GPUs, its user's grant, its owner
    claim) from what the node itself recorded, and no Slurm client is called, the default:
    a 1,000-node job's prologs send slurmctld nothing. A GPU shared between live jobs (only
    CUDA_VISIBLE_DEVICES, e.g. shards) displaces nobody."""
    path, calls = fake_slurm_clients(tmp_path)
    run = {"PATH": path, "SLURMD_NODENAME": "n1"}
    node.script("trainmon-prolog.sh", 41, SLURM_JOB_GPUS="0,1", **run)
    node.script("trainmon-prolog.sh", 43, uid=65532, CUDA_VISIBLE_DEVICES="1", **run)
    assert node.job_map() == {"0": ["41"], "1": ["41", "43"]}  # a shard of GPU 1: kept
    for f in node.claims.iterdir():  # written a while ago (a claim as old as the listing stays)
        os.utime(f, (f.stat().st_atime - 60, f.stat().st_mtime - 60))
    err = node.script("trainmon-prolog.sh", 42, uid=65533, SLURM_JOB_GPUS="1", **run)
    assert node.job_map() == {"1": ["43", "42"]}, err
    acl = node.acl(node.sock_path) + node.acl(node.run)
    assert "65534" not in acl, acl  # 41's user had no other job here
    assert "user:65533:rw-" in acl and "user:65532:rw-" in acl
    assert set(node.owners()) == {"slurm-42", "slurm-43"}
    assert sorted((node.state / "gpus").iterdir()) == [node.state / "gpus" / "1"]
    assert not calls.exists(), calls.read_text()
    # Its epilog frees the GPU; the next job on it displaces nobody.
    node.script("trainmon-epilog.sh", 42, uid=65533, **run)
    assert list((node.state / "gpus").iterdir()) == []
    node.script("trainmon-prolog.sh", 44, SLURM_JOB_GPUS="1", **run)
    assert node.job_map() == {"1": ["43", "44"]}
    assert not calls.exists(), calls.read_text()


def test_a_requeued_job_is_not_displaced_for_gpus_it_no_longer_holds(node: Node) -> None:
    """Job 41 held GPU 0 and was requeued (its epilog never ran) onto GPU 2 of the same node:
    when job 50 later gets GPU 0, the running 41 keeps its grant and its claim."""
    node.script("trainmon-prolog.sh", 41, SLURM_JOB_GPUS="0")
    node.script("trainmon-prolog.sh", 41, SLURM_JOB_GPUS="2")
    node.script("trainmon-prolog.sh", 50, uid=65533, SLURM_JOB_GPUS="0")
    assert "user:65534:rw-" in node.acl(node.sock_path)
    assert "slurm-41" in node.owners()
    assert node.job_map() == {"0": ["50"], "2": ["41"]}


def test_a_prolog_drops_the_jobs_whose_epilog_never_ran(node: Node) -> None:
    """Jobs without GPUs: job 41 ends without its epilog. Where the site sets
    TRAINMON_RUNNING_JOBS (here a command that answers as ``squeue`` would), the next prolog
    asks Slurm which jobs run on the node and drops 41 from the job map and its user's grant,
    keeping job 42's."""
    node.script("trainmon-prolog.sh", 41, CUDA_VISIBLE_DEVICES="0,1")
    node.script("trainmon-prolog.sh", 42, uid=65533, CUDA_VISIBLE_DEVICES="1")
    assert node.job_map() == {"0": ["41"], "1": ["41", "42"]}
    # Slurm cannot tell (command fails, or prints something else than job ids): nothing dropped.
    for answer in ("exit 1", "echo 42; echo oops"):
        node.script(
            "trainmon-prolog.sh",
            43,
            uid=65532,
            CUDA_VISIBLE_DEVICES="2",
            SLURMD_NODENAME="n1",
            TRAINMON_RUNNING_JOBS=answer,
        )
    assert node.job_map() == {"0": ["41"], "1": ["41", "42"], "2": ["43"]}
    assert "user:65534:rw-" in node.acl(node.sock_path)
    node.script(
        "trainmon-prolog.sh",
        44,
        uid=65532,
        CUDA_VISIBLE_DEVICES="0",
        SLURMD_NODENAME="n1",
        TRAINMON_RUNNING_JOBS='test "$SLURMD_NODENAME" = n1 && printf "42\\n43\\n"',
    )
    assert node.job_map() == {"0": ["44"], "1": ["42"], "2": ["43"]}
    acl = node.acl(node.sock_path) + node.acl(node.run)
    assert "65534" not in acl, acl  # 41's user had no other job here
    assert "user:65533:rw-" in node.acl(node.sock_path)  # 42 still runs
    assert "user:65532:rw-" in node.acl(node.sock_path)  # 43 and 44
    assert sorted(p.name for p in (node.state / "users").iterdir()) == ["65532", "65533"]
    # The epilogs of the live jobs still undo exactly their own entries.
    for job, uid in ((42, 65533), (43, 65532), (44, 65532)):
        node.script("trainmon-epilog.sh", job, uid=uid)
    assert node.job_map() == {}
    assert not any(f"{u}" in node.acl(node.sock_path) for u in (65532, 65533, 65534))


def test_the_prolog_claims_the_run_for_the_jobs_uid_and_the_epilog_frees_it(node: Node) -> None:
    """The claim is what the exporter accepts: a directory and file of root's, writable by
    root only, holding the job's uid; the exporter's own reader reads it back."""
    node.script("trainmon-prolog.sh", 41)
    node.script("trainmon-prolog.sh", 42, uid=65533)
    node.script("trainmon-prolog.sh", 42, uid=65533)  # run twice: the same claim
    assert node.owners() == {"slurm-41": 65534, "slurm-42": 65533}
    st = node.claims.stat()
    assert (st.st_uid, st.st_mode & 0o7777) == (0, 0o755)
    for f in node.claims.iterdir():
        assert (f.stat().st_uid, f.stat().st_mode & 0o777) == (0, 0o644)
        assert f.read_text() == f"{node.owners()[f.name]}\n"
    node.script("trainmon-epilog.sh", 41)
    assert node.owners() == {"slurm-42": 65533}
    node.script("trainmon-epilog.sh", 42, uid=65533)
    assert node.owners() == {}


def test_a_prolog_drops_the_claims_of_jobs_that_no_longer_run(node: Node) -> None:
    """Job 41's epilog never ran: the next prolog drops its claim, keeps the live job 42's,
    and keeps job 50's, written by a prolog running at the same moment after Slurm was asked
    (here by the command that answers as squeue would)."""
    node.script("trainmon-prolog.sh", 41)
    node.script("trainmon-prolog.sh", 42, uid=65533)
    (node.claims / "other-run").write_text("7\n")  # not a job's claim: left alone
    for f in node.claims.iterdir():  # written a while ago (a claim as old as the listing stays)
        os.utime(f, (f.stat().st_atime - 60, f.stat().st_mtime - 60))
    later = f"echo 65531 > {node.claims}/slurm-50; printf '42\\n'"
    node.script(
        "trainmon-prolog.sh", 43, uid=65532, SLURMD_NODENAME="n1", TRAINMON_RUNNING_JOBS=later
    )
    assert node.owners() == {
        "other-run": 7,
        "slurm-42": 65533,
        "slurm-43": 65532,
        "slurm-50": 65531,
    }
    # Slurm cannot tell: nothing dropped.
    node.script("trainmon-prolog.sh", 44, SLURMD_NODENAME="n1", TRAINMON_RUNNING_JOBS="exit 1")
    assert set(node.owners()) == {"other-run", "slurm-42", "slurm-43", "slurm-44", "slurm-50"}


def test_a_claims_directory_that_is_a_link_is_left_alone(tmp_path: Path, node: Node) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o777)
    os.chmod(elsewhere, 0o777)
    node.claims.symlink_to(elsewhere)
    err = node.script("trainmon-prolog.sh", 41)
    assert "symbolic link" in err or not err  # logged (to syslog when logger works)
    node.script("trainmon-epilog.sh", 41)
    assert list(elsewhere.iterdir()) == []
    assert elsewhere.stat().st_mode & 0o777 == 0o777  # not made root's through the link
    node.claims.unlink()
    node.script("trainmon-prolog.sh", 42, SLURM_JOB_UID="")  # no uid: no claim, no failure
    node.script("trainmon-prolog.sh", 43, SLURM_JOB_ID="43x")
    assert node.owners() == {}


def test_a_users_next_job_keeps_access_when_the_last_one_ends_at_that_moment(node: Node) -> None:
    """The epilog of a user's job and the prolog of the same user's next job, started at the
    same moment, many times, with real setfacl: the new job's grant is always there after
    both (grants and revocations are serialised by the node's lock)."""
    procs_env = {
        "PATH": os.environ["PATH"],
        "TRAINMON_SLURM_DEFAULTS": str(node.defaults),
        "SLURM_JOB_UID": "65534",
        "TRAINMON_RUNNING_JOBS": "",
    }
    lost = []
    trials = 60
    for trial in range(trials):
        old, new = 1000 + 2 * trial, 1001 + 2 * trial
        node.script("trainmon-prolog.sh", old, SLURM_JOB_GPUS="0")
        both = [
            subprocess.Popen(
                ["sh", str(SLURM / name)],
                env={**procs_env, "SLURM_JOB_ID": str(job), "SLURM_JOB_GPUS": "0"},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for name, job in (("trainmon-epilog.sh", old), ("trainmon-prolog.sh", new))
        ]
        for p in both:
            _, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
        acl = node.acl(node.sock_path)
        if "user:65534:rw-" not in acl or "default:user:65534:rw-" not in node.acl(node.run):
            lost.append(trial)
        assert node.job_map() == {"0": [str(new)]}
        node.script("trainmon-epilog.sh", new)
        assert "65534" not in node.acl(node.sock_path)
    assert not lost, f"the new job lost its access in {len(lost)} of {trials} trials"


def test_a_new_socket_inherits_the_grant(node: Node) -> None:
    """After an exporter restart the new socket carries the running job's grant."""
    node.script("trainmon-prolog.sh", 7, SLURM_JOB_GPUS="0")
    node.sock.close()
    node.sock_path.unlink()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as again:
        os.fchmod(again.fileno(), 0o600)  # as the exporter binds: owner-only, then its mode
        again.bind(str(node.sock_path))
        assert "user:65534:rw-\t#effective:---" in node.acl(node.sock_path)
        os.chmod(node.sock_path, 0o660)
        acl = node.acl(node.sock_path)
        assert "user:65534:rw-" in acl and "mask::rw-" in acl, acl


def test_the_grant_never_widens_an_owner_only_socket(tmp_path: Path, node: Node) -> None:
    os.chmod(node.sock_path, 0o600)
    node.script("trainmon-prolog.sh", 8)
    assert "user:65534:rw-\t#effective:---" in node.acl(node.sock_path)


def test_prolog_never_fails(node: Node) -> None:
    """Missing pieces are logged, never an exit status that would drain the node."""
    node.script("trainmon-prolog.sh", 9, SLURM_JOB_GPUS="GPU-0a1b,2")
    assert node.job_map() == {"2": ["9"]}
    shutil.rmtree(node.run)
    node.script("trainmon-prolog.sh", 10, SLURM_JOB_GPUS="0")
    node.script("trainmon-epilog.sh", 10)
    node.script("trainmon-prolog.sh", 11, SLURM_JOB_UID="")
    assert node.job_map() == {"2": ["9"]}


def test_task_prolog_exports_the_socket(tmp_path: Path) -> None:
    defaults = tmp_path / "defaults"
    defaults.write_text("TRAINMON_SOCKET=/run/site/trainmon.sock\n")
    base = {"PATH": os.environ["PATH"], "TRAINMON_SLURM_DEFAULTS": str(defaults)}

    def lines(**env: str) -> str:
        args = ["sh", str(SLURM / "trainmon-task-prolog.sh")]
        return subprocess.run(args, env={**base, **env}, capture_output=True, text=True).stdout

    assert lines() == "export TRAINMON_SOCKET=/run/site/trainmon.sock\n"
    assert lines(TRAINMON_SLURM_DEFAULTS="/nonexistent") == (
        "export TRAINMON_SOCKET=/run/trainmon/trainmon.sock\n"
    )
    assert lines(TRAINMON_SOCKET="/home/me/t.sock") == ""  # the job's own choice stays
