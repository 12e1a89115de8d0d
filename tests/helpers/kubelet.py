"""A Kubernetes node on this machine, as the kubelet lays it out: pods' cgroups and pod list.

:class:`Node` makes, under a fresh cgroup of its own in this machine's cgroup hierarchies, the
cgroups the kubelet and the container runtime make for a pod's container (the systemd
driver's ``kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<UID>.slice/
cri-containerd-<ID>.scope`` or the cgroupfs driver's ``kubepods/burstable/pod<UID>/<ID>``,
in cgroup v2 or, where this machine has one, a v1 hierarchy), and the kubelet's pod log
directory (``NAMESPACE_NAME_UID`` entries). Processes are moved into a pod's cgroup by
writing their PID to its ``cgroup.procs``, as the runtime does.

The exporter runs in a cgroup namespace rooted at the node's own ``exporter`` cgroup
(``unshare --cgroup``), as a DaemonSet's container does on cgroup v2: it sees the pods'
cgroups as ``/../kubepods.slice/...``, and the machine's other cgroups (this test's) above its
own ancestors. Nothing is made at the top of a hierarchy, so a real kubelet's cgroups, if any,
are never touched; everything is removed at :meth:`Node.close`.

Needs root and a writable cgroup file system; :func:`node_or_skip` skips otherwise.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Pod:
    """A pod of the :class:`Node`: its identity and its container's cgroup directory."""

    namespace: str
    name: str
    uid: str
    container: str
    cgroup: Path
    """The container's cgroup directory; a PID written to its ``cgroup.procs`` moves there."""


def _mounts() -> tuple[Path | None, Path | None]:
    """The cgroup v2 mount, and a v1 hierarchy (``pids``, else ``name=systemd``), if any."""
    v2 = v1 = None
    v1_name = ""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _, options = right.split(" ", 2)
        mount = Path(left.split()[4])
        if fstype == "cgroup2" and v2 is None:
            v2 = mount
        elif fstype == "cgroup":
            names = options.split(",")
            for want in ("pids", "name=systemd"):
                if want in names and (v1 is None or (want == "pids" and v1_name != "pids")):
                    v1, v1_name = mount, want
    return v2, v1


class Node:
    """See the module. ``root``: where the pod log directory is made (a private temp dir)."""

    def __init__(self) -> None:
        v2, v1 = _mounts()
        if os.geteuid() != 0 or v2 is None or shutil.which("unshare") is None:
            raise PermissionError("needs root, cgroup v2 and unshare")
        name = f"tm-node-{secrets.token_hex(4)}"
        self.v2 = v2 / name
        self.v2.mkdir()  # PermissionError on a read-only cgroup file system
        self.v1: Path | None = None
        if v1 is not None:
            try:
                (v1 / name).mkdir()
                self.v1 = v1 / name
            except OSError:
                pass
        self._made: list[Path] = [self.v2, *([self.v1] if self.v1 else [])]
        self.exporter_cgroups = [self._mkdir(self.v2 / "exporter")]
        if self.v1 is not None:
            self.exporter_cgroups.append(self._mkdir(self.v1 / "exporter"))
        self._tmp = Path(tempfile.mkdtemp(prefix="tm-kubelet-"))
        self.pod_logs = self._tmp / "pods"
        self.pod_logs.mkdir(mode=0o755)
        os.chmod(self.pod_logs, 0o755)

    def _mkdir(self, path: Path) -> Path:
        for parent in reversed([path, *path.parents]):
            if parent not in self._made and any(parent.is_relative_to(m) for m in self._made):
                parent.mkdir(exist_ok=True)
                self._made.append(parent)
        return path

    def pod(self, namespace: str, name: str, *, driver: str = "systemd") -> Pod:
        """A pod with one container, its cgroup made and its log directory listed.

        ``driver``: ``systemd`` (cgroup v2, containerd's ``cri-containerd-<ID>.scope``) or
        ``cgroupfs`` (the v1 hierarchy where there is one, else v2; CRI-O's ``crio-<ID>``).
        """
        pod_uid = str(uuid.uuid4())
        container = secrets.token_hex(32)
        if driver == "systemd":
            under = pod_uid.replace("-", "_")
            cgroup = (
                self.v2
                / "kubepods.slice"
                / "kubepods-besteffort.slice"
                / f"kubepods-besteffort-pod{under}.slice"
                / f"cri-containerd-{container}.scope"
            )
        else:
            base = self.v1 if self.v1 is not None else self.v2
            cgroup = base / "kubepods" / "burstable" / f"pod{pod_uid}" / f"crio-{container}"
        self._mkdir(cgroup)
        entry = self.pod_logs / f"{namespace}_{name}_{pod_uid}"
        entry.mkdir(mode=0o755)
        (entry / "trainer").mkdir(mode=0o755)
        return Pod(namespace, name, pod_uid, container, cgroup)

    def place(self, pid: int, pod: Pod) -> None:
        """Move process ``pid`` into ``pod``'s container cgroup."""
        (pod.cgroup / "cgroup.procs").write_text(f"{pid}\n")

    def launcher(self) -> list[str]:
        """Words that start a command in the node's ``exporter`` cgroups and its own cgroup
        namespace (for :class:`~trainmon_exporter.local.LocalExporter`'s ``launcher``)."""
        procs = " ".join(f"'{c / 'cgroup.procs'}'" for c in self.exporter_cgroups)
        script = f'for p in {procs}; do echo $$ > "$p"; done; exec unshare --cgroup "$@"'
        return ["sh", "-c", script, "sh"]

    def close(self) -> None:
        """Remove the cgroups (once their processes have exited) and the pod directory."""
        shutil.rmtree(self._tmp, ignore_errors=True)
        deadline = time.monotonic() + 10
        for path in sorted(self._made, key=lambda p: len(p.parts), reverse=True):
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY: a process is still exiting
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.05)


def node_or_skip() -> Node:
    """A :class:`Node`, or skip the test where this machine cannot make one."""
    try:
        return Node()
    except OSError as exc:
        pytest.skip(f"cannot make pods' cgroups here: {exc}")
