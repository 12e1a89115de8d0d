"""A two-node Slurm cluster on one machine, for real: Debian's slurmctld, two slurmd and munge.

Each node is a network namespace on a private bridge with its own address, hostname (UTS
namespace) and ``/run`` (mount namespace, so each has its own ``/run/trainmon``), running one
trainmon exporter started as ``deploy/slurm/trainmon-exporter.service`` starts it, and the
shipped prolog, epilog and task prolog. slurmctld runs in the root network namespace (on the
bridge's address) under its own hostname. Two fake GPU device nodes per node give Slurm a
``gpu`` GRES, so jobs see ``SLURM_JOB_GPUS``.

Pitfalls found by trying (Slurm 22.05, Debian 12):

- ``ip netns exec`` remounts ``/sys`` and hides ``/sys/fs/cgroup``: slurmd then refuses to
  start. The nodes are entered with ``nsenter --net=/run/netns/NAME unshare -mu`` instead.
- slurmctld only runs on a host whose short hostname is its ``SlurmctldHost``: it gets a UTS
  namespace of its own.
- With ``CommunicationParameters=NoInAddrAny`` every daemon must resolve its own name: each
  namespace bind-mounts a private ``/etc/hosts``.
- ``srun`` from the root namespace hangs ("Slurmd could not connect IO"): the nodes cannot
  reach its address. Jobs go through ``sbatch``; the batch step's ``srun`` runs on node 1.
- The batch script itself sees ``SLURM_PROCID=0`` and ``SLURM_NTASKS=4``: only ``srun`` tasks
  are ranks (the client checks ``SLURM_STEP_ID``).

Everything started is stopped by process id, and the namespaces and links are removed.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..conftest import ROOT, free_port, short_tmpdir, wait_for
from .stack import require_binaries

SLURM_DIR = ROOT / "deploy" / "slurm"
UNIT = SLURM_DIR / "trainmon-exporter.service"
NODES = ("tmn1", "tmn2")
EXPORTER_PORT = 9478  # each node has its own network namespace: the same port on both


def exporter_argv() -> list[str]:
    """The unit's ExecStart, with this checkout's ``trainmon-exporter`` as the program."""
    line = next(
        ln for ln in UNIT.read_text().splitlines() if ln.startswith("ExecStart=")
    ).removeprefix("ExecStart=")
    argv = shlex.split(line)
    return [str(Path(sys.executable).parent / "trainmon-exporter"), *argv[1:]]


def _run(*cmd: str, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False, **kw)
    if check and out.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def require_lab() -> None:
    """Skip unless this machine can run the lab: root, the binaries, namespaces."""
    if os.geteuid() != 0:
        pytest.skip("the Slurm lab needs root (network namespaces, munge, slurmd)")
    require_binaries("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", package="slurm-wlm")
    require_binaries("munged", "munge", package="munge")
    require_binaries("setfacl", package="acl")
    require_binaries("ip", "nsenter", "unshare", package="iproute2 util-linux")
    probe = _run("unshare", "-mu", "true", check=False)
    if probe.returncode != 0:
        pytest.skip(f"mount/UTS namespaces not permitted here: {probe.stderr.strip()}")
    name = f"tmprobe{os.getpid() % 100000}"
    probe = _run("ip", "netns", "add", name, check=False)
    if probe.returncode != 0:
        pytest.skip(f"network namespaces not permitted here: {probe.stderr.strip()}")
    _run("ip", "netns", "delete", name, check=False)


def _free_subnet() -> str:
    """``10.A.B`` with no address of this machine in it."""
    used = _run("ip", "-4", "-o", "addr").stdout
    for i in range(200):
        n = (os.getpid() + i * 7919) % 40000
        net = f"10.{100 + n // 250 % 150}.{n % 250}"
        if f" {net}." not in used:
            return net
    raise RuntimeError("no free 10.x.y.0/24 for the lab")


def job_python() -> tuple[str, dict[str, str]]:
    """An interpreter and environment that user ``nobody`` can run this checkout's code with.

    The virtual environment's interpreter when ``nobody`` may execute it; otherwise (it lives
    under ``/root``, e.g. pyenv) the system interpreter of the same version, with the
    environment's site-packages and the client's sources on ``PYTHONPATH``.
    """
    probe = ["-c", "import trainmon_client, torch"]
    if _run("runuser", "-u", "nobody", "--", sys.executable, *probe, check=False).returncode == 0:
        return sys.executable, {}
    system = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    path = f"{sysconfig.get_paths()['purelib']}:{ROOT / 'client' / 'src'}"
    env = {"PYTHONPATH": path}
    ok = _run(
        "runuser", "-u", "nobody", "--", "env", f"PYTHONPATH={path}", system, *probe, check=False
    )
    if ok.returncode == 0:
        return system, env
    pytest.skip(f"user nobody can run neither {sys.executable} nor {system} with torch")


SLURM_CONF = """\
ClusterName=tmlab
SlurmctldHost={ctl}({net}.1)
SlurmUser=root
SlurmctldPort={ctl_port}
SlurmdPort=6818
AuthType=auth/munge
AuthInfo=socket={lab}/munge/sock
CredType=cred/munge
CommunicationParameters=NoInAddrAny
StateSaveLocation={lab}/state
SlurmdSpoolDir={lab}/spool/%n
SlurmctldPidFile={lab}/slurmctld.pid
SlurmdPidFile={lab}/slurmd-%n.pid
SlurmctldLogFile={lab}/log/slurmctld.log
SlurmdLogFile={lab}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
KillWait=5
GresTypes=gpu
Prolog={slurm_dir}/trainmon-prolog.sh
Epilog={slurm_dir}/trainmon-epilog.sh
TaskProlog={slurm_dir}/trainmon-task-prolog.sh
PrologFlags=Alloc
NodeName=tmn1 NodeHostname=tmn1 NodeAddr={net}.11 CPUs=2 RealMemory=1000 Gres=gpu:2
NodeName=tmn2 NodeHostname=tmn2 NodeAddr={net}.12 CPUs=2 RealMemory=1000 Gres=gpu:2
PartitionName=lab Nodes=tmn1,tmn2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""

# A node: private /etc/hosts, hostname, /run (so /run/trainmon is the node's own, as systemd's
# RuntimeDirectory=trainmon would make it), the exporter as the unit runs it, then slurmd. The
# unit's state file (/var/lib/trainmon, each node's own disk) is the lab's, one per node: on
# the host's it would be shared by both nodes and outlive the lab, so that a later lab's
# exporters restore the ranks of an earlier job 1.
NODE_SH = """\
#!/bin/bash
set -e
mount --bind {lab}/hosts /etc/hosts
hostname "$1"
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -m 0755 /run/trainmon
{exporter} --state-file {lab}/state-"$1".json > {lab}/log/exporter-$1.log 2>&1 &
echo $! > {lab}/exporter-$1.pid
exec slurmd -D -f {lab}/slurm.conf -N "$1"
"""

CTL_SH = """\
#!/bin/bash
set -e
mount --bind {lab}/hosts /etc/hosts
hostname {ctl}
exec slurmctld -D -i -f {lab}/slurm.conf
"""


class SlurmLab:
    """The running lab; use :func:`slurm_lab` to get one."""

    def __init__(self) -> None:
        self.dir = short_tmpdir()
        os.chmod(self.dir, 0o755)  # the job's user reads nothing here but passes through
        self.prefix = f"tm{os.getpid() % 100000:05d}"
        self.net = _free_subnet()
        self.ctl = f"{self.prefix}ctl"
        # A user's shell: sbatch exports it to the job, and the suite's own TRAINMON_SOCKET
        # (where nobody listens) would win over the task prolog's node socket.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMON_")}
        self.env["SLURM_CONF"] = str(self.dir / "slurm.conf")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.links: list[str] = []
        self.netns: list[str] = []
        self.logs: list[Any] = []

    # --- set-up -------------------------------------------------------------------------
    def start(self) -> None:
        for sub in ("log", "state", "spool", "out", "dev", "munge"):
            (self.dir / sub).mkdir()
        os.chmod(self.dir / "out", 0o1777)
        self._network()
        self._munge()
        (self.dir / "hosts").write_text(
            f"127.0.0.1 localhost\n{self.net}.1 {self.ctl}\n"
            + "".join(f"{self.net}.1{i} {n}\n" for i, n in enumerate(NODES, 1))
        )
        for i in range(2):  # two fake GPUs per node (character devices, NVIDIA's major 195)
            os.mknod(self.dir / "dev" / f"nvidia{i}", 0o600 | 0o020000, os.makedev(195, i))
        fmt = {
            "lab": self.dir,
            "net": self.net,
            "ctl": self.ctl,
            "ctl_port": free_port(),
            "slurm_dir": SLURM_DIR,
            "exporter": shlex.join(exporter_argv()),
        }
        (self.dir / "slurm.conf").write_text(SLURM_CONF.format(**fmt))
        (self.dir / "gres.conf").write_text(f"Name=gpu File={self.dir}/dev/nvidia[0-1]\n")
        for name, text in (("node.sh", NODE_SH), ("ctl.sh", CTL_SH)):
            (self.dir / name).write_text(text.format(**fmt))
            os.chmod(self.dir / name, 0o755)
        self._spawn(["unshare", "-mu", "--propagation", "private", str(self.dir / "ctl.sh")], "ctl")
        for i, node in enumerate(NODES, 1):
            ns = f"/run/netns/{self.prefix}n{i}"
            cmd = ["nsenter", f"--net={ns}", "unshare", "-mu", "--propagation", "private"]
            self._spawn([*cmd, str(self.dir / "node.sh"), node], node)

        def idle() -> bool:
            out = self.slurm("sinfo", "--noheader", "--Node", "--format=%N %T", check=False)
            return out.stdout.split() == ["tmn1", "idle", "tmn2", "idle"]

        wait_for(idle, timeout=60, interval=0.3)

    def _network(self) -> None:
        br = f"{self.prefix}br"
        _run("ip", "link", "add", br, "type", "bridge")
        self.links.append(br)
        _run("ip", "addr", "add", f"{self.net}.1/24", "dev", br)
        _run("ip", "link", "set", br, "up")
        for i in (1, 2):
            ns, veth = f"{self.prefix}n{i}", f"{self.prefix}v{i}"
            _run("ip", "netns", "add", ns)
            self.netns.append(ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self.links.append(veth)
            _run("ip", "link", "set", veth, "master", br)
            _run("ip", "link", "set", veth, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.net}.1{i}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def _munge(self) -> None:
        """A private munged (its own key and socket) for this lab only."""
        m = self.dir / "munge"
        (m / "key").write_bytes(os.urandom(1024))
        shutil.chown(m, "munge", "munge")
        shutil.chown(m / "key", "munge", "munge")
        os.chmod(m / "key", 0o400)
        _run(
            "runuser", "-u", "munge", "--", shutil.which("munged") or "munged",
            f"--socket={m}/sock", f"--key-file={m}/key", f"--pid-file={m}/pid",
            f"--seed-file={m}/seed", f"--log-file={m}/log",
        )  # fmt: skip
        wait_for(lambda: (m / "pid").exists(), timeout=10)

    def _spawn(self, cmd: list[str], log: str) -> None:
        out = (self.dir / "log" / f"{log}.out").open("wb")
        self.logs.append(out)
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)

    # --- use ------------------------------------------------------------------------------
    def slurm(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this lab (from the root namespace)."""
        return _run(*cmd, check=check, env=self.env)

    def node_pid(self, node: str) -> int:
        """The pid of a node's slurmd: its namespaces are the node's."""
        return int((self.dir / f"slurmd-{node}.pid").read_text())

    def on_node(self, node: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` inside a node's namespaces (network, mount, UTS)."""
        pid = str(self.node_pid(node))
        return _run("nsenter", "-t", pid, "-n", "-m", "-u", *cmd, check=check)

    def node_url(self, node: str) -> str:
        return f"http://{self.net}.1{NODES.index(node) + 1}:{EXPORTER_PORT}"

    def pids_in(self, node: str) -> list[int]:
        """Processes in a node's network namespace (its slurmd, exporter, steps, tasks)."""
        target = os.stat(f"/run/netns/{self.prefix}n{NODES.index(node) + 1}").st_ino
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    if os.stat(f"/proc/{entry}/ns/net").st_ino == target:
                        pids.append(int(entry))
        return pids

    def log(self) -> str:
        """The daemons' logs, for assertion messages."""
        parts = []
        for f in sorted((self.dir / "log").iterdir()):
            parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    # --- tear-down ------------------------------------------------------------------------
    def stop(self) -> None:
        self.slurm("scancel", "--full", "--signal=KILL", "--user=root", check=False)
        self.slurm("scancel", "--full", "--signal=KILL", "--user=nobody", check=False)
        for node in NODES:  # exporters, steps and tasks first, then the daemons
            with contextlib.suppress(OSError, ValueError):
                os.kill(int((self.dir / f"exporter-{node}.pid").read_text()), signal.SIGTERM)
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        deadline = time.monotonic() + 10
        for i in range(len(self.netns)):
            for pid in self.pids_in(NODES[i]):  # whatever is left in the node's namespace
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            while self.pids_in(NODES[i]) and time.monotonic() < deadline:
                time.sleep(0.1)
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((self.dir / "munge" / "pid").read_text()), signal.SIGTERM)
        for ns in self.netns:
            _run("ip", "netns", "delete", ns, check=False)
        for link in self.links:
            _run("ip", "link", "delete", link, check=False)
        for out in self.logs:
            out.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def slurm_lab() -> Iterator[SlurmLab]:
    """A started lab, torn down on exit (skips where the machine cannot run one)."""
    require_lab()
    lab = SlurmLab()
    try:
        lab.start()
        yield lab
    except Exception:
        print(lab.log())
        raise
    finally:
        lab.stop()
