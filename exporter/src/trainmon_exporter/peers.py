"""Who a trainer connection is on a Kubernetes node: its pod and namespace, from the kernel.

A HELLO names a namespace, but the sender chooses it. What the sender cannot choose is its
process's cgroup: the kubelet and the container runtime place every container of a pod in a
cgroup named after the pod's UID, and a process in a pod cannot move itself out. So for each
new connection the exporter reads the connecting process's ``/proc/PID/cgroup`` (the PID from
``SO_PEERCRED``: the exporter must share the host's PID namespace, as the DaemonSet does),
finds the pod's UID and the container's ID in it (:func:`pod_of_cgroup`), and looks the UID
up in the kubelet's pod log directory (:class:`PodDirectory`: ``/var/log/pods``, one entry
``NAMESPACE_NAME_UID`` per pod of the node, written by the kubelet as root). The result, a
:class:`Peer`, is the connection's verified namespace: its tenant, and the namespace its
HELLO must name (:mod:`trainmon_exporter.apply`).

The layouts read (docs/scaling.md#attribution-per-team):

- cgroup v2 (one line ``0::PATH``) and v1 (one line per hierarchy; every line that names a pod
  must name the same one);
- the kubelet's systemd driver (``/kubepods.slice/kubepods-burstable.slice/
  kubepods-burstable-pod<UID with _>.slice/cri-containerd-<ID>.scope``, ``crio-<ID>.scope``,
  ``docker-<ID>.scope``) and its cgroupfs driver (``/kubepods/burstable/pod<UID>/<ID>``);
  Guaranteed pods have no QoS level; kind's nodes nest it all under ``/kubelet``;
- paths as seen from a cgroup namespace (the exporter's container has its own on cgroup v2):
  ``/../../kubepods-besteffort.slice/...``.

Only a cgroup the kubelet made counts: the path must start at the kubelet's root
(``kubepods``, ``kubepods.slice``, or kind's ``kubelet``), or, seen from a cgroup namespace, go
up no higher than the exporter's own ancestors (fewer ``..`` than host PID 1's path has), so a
cgroup a user made in a delegated subtree (``/user.slice/.../kubepods.slice/...``) names no
pod. The first pod in the path is the process's: a container that may create cgroups below
its own cannot pass for another pod.

A PID can be reused once its process has exited. Where the kernel has ``SO_PEERPIDFD`` (Linux
6.5), the exporter holds a descriptor of the very process that connected and checks that it
still lives after reading its cgroup, so the file read was that process's; on older kernels
the cgroup is read at ``accept()``, while a trainer that has just connected is still there.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from trainmon_client import _names as N
from trainmon_exporter.safedir import TrustedDirectory, UnsafeDirectory

__all__ = [
    "IDENTITIES",
    "Peer",
    "PeerResolver",
    "PodDirectory",
    "PodRef",
    "pod_of_cgroup",
]

log = logging.getLogger("trainmon_exporter.peers")

IDENTITIES: Final = ("pod", "host", "unknown_pod", "unverifiable")
"""How a connection's process was identified (``trainmon_ingest_peer_identities_total``):
``pod`` (its pod is on the node's list: the namespace is verified), ``host`` (not in a pod's
cgroup: a process on the node itself), ``unknown_pod`` (a pod's cgroup whose pod the node's
list does not name), ``unverifiable`` (no PID in this PID namespace, its ``/proc`` entry
unreadable, or the process gone before it could be read)."""

_UUID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD_SEGMENT = re.compile(rf"(?:[a-z0-9-]+-)?pod({_UUID})(?:\.slice)?")
"""A pod's cgroup: ``pod<UID>`` (cgroupfs) or ``kubepods[-<qos>]-pod<UID with _>.slice``."""
_CONTAINER_SEGMENT = re.compile(
    r"(?:cri-containerd-|crio-|docker-|cri-dockerd-)?([0-9a-f]{64})(?:\.scope)?"
)
"""A container's cgroup below its pod's: the runtime's prefix, its 64-hex ID, ``.scope``."""
_KUBELET_ROOTS = frozenset({"kubepods", "kubepods.slice", "kubelet", "kubelet.slice"})
"""First path components of the cgroups the kubelet makes (``kubelet``: kind's nodes)."""
_MAX_CGROUP_BYTES = 64 * 1024
_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux >= 6.5
_PIDFD_UNSUPPORTED = frozenset({errno.ENOPROTOOPT, errno.EINVAL, errno.EOPNOTSUPP})


@dataclass(frozen=True, slots=True)
class PodRef:
    """A pod's UID (with dashes) and a container's 64-hex ID (``""``: none in the path)."""

    uid: str
    container: str = ""


@dataclass(frozen=True, slots=True)
class Peer:
    """What the node says about a connection's process.

    Attributes:
        identity: one of :data:`IDENTITIES`.
        namespace, pod: the pod's namespace and name (``pod`` identity only, else ``""``).
        pod_uid, container: from the cgroup (``pod`` and ``unknown_pod``, else ``""``).
    """

    identity: str
    namespace: str = ""
    pod: str = ""
    pod_uid: str = ""
    container: str = ""


def pod_of_cgroup(text: str, ups: dict[str, int] | None = None) -> PodRef | None:
    """The pod (and container) a ``/proc/PID/cgroup`` text places its process in, or None.

    ``ups``: for each hierarchy ID (``0`` for cgroup v2), how many ``..`` lead from the
    reader's cgroup namespace up to the hierarchy's root (:func:`root_ups`); a path that goes up
    that far or further is outside the reader's ancestors and names no pod. None: paths with
    ``..`` name none. A path without ``..`` must start at a kubelet root. Lines that name
    different pods name none (None). Never raises.
    """
    found: PodRef | None = None
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        _, _, path = rest.partition(":")
        ref = _pod_of_path(path, (ups or {}).get(hierarchy, 0))
        if ref is None:
            continue
        if found is not None and found.uid != ref.uid:
            return None
        if found is None or not found.container:
            found = ref
    return found


def _pod_of_path(path: str, ups_allowed: int) -> PodRef | None:
    parts = path.split("/")[1:]
    up = 0
    while up < len(parts) and parts[up] == "..":
        up += 1
    if up:
        if up >= ups_allowed:
            return None
    elif not parts or parts[0] not in _KUBELET_ROOTS:
        return None
    for i in range(up, len(parts)):
        m = _POD_SEGMENT.fullmatch(parts[i])
        if m is None:
            continue
        uid = m.group(1).replace("_", "-")
        c = _CONTAINER_SEGMENT.fullmatch(parts[i + 1]) if i + 1 < len(parts) else None
        return PodRef(uid, c.group(1) if c is not None else "")
    return None


def root_ups(text: str) -> dict[str, int]:
    """For each hierarchy of a ``/proc/PID/cgroup`` text, the ``..`` its path starts with.

    Read from host PID 1 (in the hierarchy's root, or in ``/init.scope`` just below it), this
    is how far the reader's cgroup namespace sits below each hierarchy's root: 0 without a
    cgroup namespace.
    """
    out = {}
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        _, _, path = rest.partition(":")
        parts = path.split("/")[1:]
        out[hierarchy] = next((i for i, p in enumerate(parts) if p != ".."), len(parts))
    return out


class PodDirectory:
    """The pods of this node, from the kubelet's pod log directory (``/var/log/pods``).

    The kubelet makes one directory ``NAMESPACE_NAME_UID`` per pod there before the pod's
    first container starts, and removes it when the pod is gone. Neither a namespace nor a pod
    name nor a UID may hold ``_``, so the name splits one way. The directory is opened as a
    :class:`~trainmon_exporter.safedir.TrustedDirectory` (root's, writable by nobody else) and
    only its entries' names are read: the logs below them belong to root and are ``0640``, so
    the non-root exporter could not read them anyway.

    The names are listed again when a look-up misses and the directory changed since (its
    modification time) or was listed over :data:`RELIST_S` seconds ago. Not thread-safe: the
    ingest server's event loop is its one caller.
    """

    RELIST_S: Final = 1.0

    def __init__(self, path: Path) -> None:
        self.path = path
        self._dir = TrustedDirectory(path)
        self._pods: dict[str, tuple[str, str]] = {}  # pod UID -> (namespace, name)
        self._mtime = -1
        self._listed = -float("inf")
        self._problem = ""  # the last problem logged (each new one is logged once)

    def lookup(self, uid: str) -> tuple[str, str] | None:
        """``(namespace, name)`` of the pod with this UID on this node, or None. Never raises."""
        found = self._pods.get(uid)
        if found is not None:
            return found
        try:
            fd = self._dir.open()
            if fd is None:
                self._report(f"{self.path} does not exist")
                return None
            mtime = os.fstat(fd).st_mtime_ns
            now = time.monotonic()
            if mtime == self._mtime and now - self._listed < self.RELIST_S:
                return None
            self._pods = _parse(os.listdir(fd))
            self._mtime, self._listed = mtime, now
            self._problem = ""
        except (UnsafeDirectory, OSError) as exc:
            self._report(str(exc))
            return None
        return self._pods.get(uid)

    def _report(self, problem: str) -> None:
        if problem != self._problem:
            self._problem = problem
            log.warning(
                "the kubelet's pod directory cannot be read (%s): trainers' namespaces are not "
                "verified, each is keyed by its uid",
                problem,
            )


def _parse(names: list[str]) -> dict[str, tuple[str, str]]:
    pods = {}
    for name in names:
        parts = name.split("_")
        if len(parts) != 3:
            continue
        namespace, pod, uid = parts
        if N.valid_namespace(namespace) and N.valid_pod(pod) and re.fullmatch(_UUID, uid):
            pods[uid] = (namespace, pod)
    return pods


class PeerResolver:
    """Identifies the process behind each new trainer connection (see the module).

    Args:
        pods: the node's pods.
        proc: where ``/proc`` is (the host's, through ``hostPID``).
    """

    def __init__(self, pods: PodDirectory, proc: Path = Path("/proc")) -> None:
        self.pods = pods
        self.proc = proc
        try:
            self._ups = root_ups(_read_cgroup(proc / "1" / "cgroup"))
        except OSError:
            self._ups = {}

    def resolve(self, sock: socket.socket, pid: int | None) -> Peer:
        """The :class:`Peer` of ``sock``'s process, ``pid`` from ``SO_PEERCRED``. Never raises."""
        if not pid:
            return Peer("unverifiable")
        pidfd = _peer_pidfd(sock)
        if pidfd == -2:
            return Peer("unverifiable")  # the process that connected is gone already
        try:
            text: str | None = _read_cgroup(self.proc / str(pid) / "cgroup")
        except OSError:
            text = None
        # Read first, then checked: if the process still lives, the PID was still its own.
        alive = pidfd < 0 or _alive(pidfd)
        if text is None or not alive:
            return Peer("unverifiable")
        ref = pod_of_cgroup(text, self._ups)
        if ref is None:
            return Peer("host")
        found = self.pods.lookup(ref.uid)
        if found is None:
            return Peer("unknown_pod", pod_uid=ref.uid, container=ref.container)
        return Peer("pod", found[0], found[1], ref.uid, ref.container)


def _read_cgroup(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, _MAX_CGROUP_BYTES).decode("utf-8", "replace")
    finally:
        os.close(fd)


def _peer_pidfd(sock: socket.socket) -> int:
    """A pidfd of the process that connected ``sock``; -1 unsupported, -2 gone already."""
    try:
        return sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
    except OSError as exc:
        return -1 if exc.errno in _PIDFD_UNSUPPORTED else -2


def _alive(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` still lives (or is a zombie); closes ``pidfd``."""
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except PermissionError:
        return True  # another user's process: it exists
    except OSError:
        return False
    finally:
        os.close(pidfd)
    return True
