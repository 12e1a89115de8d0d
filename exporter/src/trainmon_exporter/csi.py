"""trainmon-csi-node: a CSI node plugin that publishes the exporter's socket into training pods.

Why this module is one module of about 530 lines: it is one program, separate from the
exporter (its own process, its own optional dependencies), whose parts (the messages of the
CSI specification, the mount logic, the gRPC services and the command line) are each short
and only make sense together.

Pod Security's ``baseline`` level forbids ``hostPath`` volumes, and has no allowlist for one
harmless host directory, so a training pod in a ``baseline`` or ``restricted`` namespace cannot
mount ``/run/trainmon``. It may mount a CSI *inline ephemeral* volume, which both levels allow:

.. code-block:: yaml

    volumes:
      - name: trainmon
        csi: {driver: csi.trainmon.io, readOnly: true}

The kubelet then calls this plugin's ``NodePublishVolume`` with a target path under the pod's
directory (``/var/lib/kubelet/pods/<uid>/volumes/kubernetes.io~csi/trainmon/mount``), and the
plugin bind-mounts the exporter's socket directory there, read-only, with ``nosuid``,
``nodev`` and ``noexec``. ``connect(2)`` to a Unix socket needs no write access to the file
system it is on, so trainers connect as they would through the ``hostPath``; they cannot
create, rename or remove anything in the directory. ``NodeUnpublishVolume`` unmounts it and
removes the target. The directory, not the socket file, is bound: a socket the exporter
re-creates after a restart appears in every pod at once. Who may connect is unchanged: the
socket's mode and group (``supplementalGroups: [9478]``), and the exporter's own per-peer checks.

The same pattern as SPIFFE's CSI driver for the SPIRE agent's socket: only the node service
(``Identity`` and ``Node``), no controller, no staging (no ``STAGE_UNSTAGE_VOLUME``
capability), ephemeral volumes only (the kubelet's ``csi.storage.k8s.io/ephemeral: "true"``),
registered with the kubelet by ``node-driver-registrar`` and declared by a ``CSIDriver`` object
with ``volumeLifecycleModes: [Ephemeral]`` (``deploy/kubernetes/base/exporter``). The messages
are those of the CSI specification's ``csi.proto`` (package ``csi.v1``), built at start from
the field numbers below; fields this plugin does not read are left out, which protobuf's wire
format allows (unknown fields are skipped).

Limits, for a caller that is not the kubelet (the gRPC socket is root's, in a root-only
directory): a target path must be absolute, normalised, inside ``--pods-dir``, and reach it
without a symbolic link, so no request can bind the socket over ``/etc`` or another pod's
volume; at most ``--max-volumes`` published at once; RPCs are served one at a time.

Needs ``grpcio`` and ``protobuf`` (``pip install 'trainmon-exporter[csi]'``); the exporter itself
does not import this module. Runs as root with ``CAP_SYS_ADMIN`` (``mount(2)``), in a container
whose ``/var/lib/kubelet/pods`` is mounted with ``mountPropagation: Bidirectional``.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

from ._version import __version__

log = logging.getLogger("trainmon.csi")

DRIVER_NAME = "csi.trainmon.io"
"""The driver's name: the ``CSIDriver`` object's name and every pod's ``csi.driver``."""
EPHEMERAL = "csi.storage.k8s.io/ephemeral"
"""The key the kubelet sets to ``"true"`` in an inline ephemeral volume's volume context."""
POD_KEYS = ("csi.storage.k8s.io/pod.namespace", "csi.storage.k8s.io/pod.name")
"""Keys the kubelet adds with ``podInfoOnMount: true``: logged with each publish."""

# linux/mount.h
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND = 32, 4096

# csi.v1 messages: (name, [(field name, number, type, label, type name)]). Types and labels
# are descriptor_pb2's numbers: 9 string, 8 bool, 3 int64, 14 enum, 11 message; 1 optional,
# 3 repeated. Field numbers as in the CSI specification's csi.proto.
_STR, _BOOL, _I64, _ENUM, _MSG = 9, 8, 3, 14, 11
_OPT, _REP = 1, 3
_MESSAGES: list[tuple[str, list[tuple[str, int, int, int, str]]]] = [
    ("GetPluginInfoRequest", []),
    (
        "GetPluginInfoResponse",
        [("name", 1, _STR, _OPT, ""), ("vendor_version", 2, _STR, _OPT, "")],
    ),
    ("GetPluginCapabilitiesRequest", []),
    ("GetPluginCapabilitiesResponse", []),  # no capability: a node-only plugin
    ("ProbeRequest", []),
    ("ProbeResponse", []),  # no `ready` field: ready
    ("NodeGetCapabilitiesRequest", []),
    ("NodeGetCapabilitiesResponse", []),  # no STAGE_UNSTAGE_VOLUME: no staging
    ("NodeGetInfoRequest", []),
    (
        "NodeGetInfoResponse",
        [("node_id", 1, _STR, _OPT, ""), ("max_volumes_per_node", 2, _I64, _OPT, "")],
    ),
    (
        "NodePublishVolumeRequest",
        [
            ("volume_id", 1, _STR, _OPT, ""),
            ("staging_target_path", 3, _STR, _OPT, ""),
            ("target_path", 4, _STR, _OPT, ""),
            ("volume_capability", 5, _MSG, _OPT, ".csi.v1.VolumeCapability"),
            ("readonly", 6, _BOOL, _OPT, ""),
            (
                "volume_context",
                8,
                _MSG,
                _REP,
                ".csi.v1.NodePublishVolumeRequest.VolumeContextEntry",
            ),
        ],
    ),
    ("NodePublishVolumeResponse", []),
    (
        "NodeUnpublishVolumeRequest",
        [("volume_id", 1, _STR, _OPT, ""), ("target_path", 2, _STR, _OPT, "")],
    ),
    ("NodeUnpublishVolumeResponse", []),
    (
        "VolumeCapability",
        [
            ("block", 1, _MSG, _OPT, ".csi.v1.VolumeCapability.BlockVolume"),
            ("mount", 2, _MSG, _OPT, ".csi.v1.VolumeCapability.MountVolume"),
            ("access_mode", 3, _MSG, _OPT, ".csi.v1.VolumeCapability.AccessMode"),
        ],
    ),
]
_NESTED: dict[str, list[tuple[str, list[tuple[str, int, int, int, str]]]]] = {
    "VolumeCapability": [
        ("BlockVolume", []),
        (
            "MountVolume",
            [("fs_type", 1, _STR, _OPT, ""), ("mount_flags", 2, _STR, _REP, "")],
        ),
        ("AccessMode", [("mode", 1, _I64, _OPT, "")]),  # an enum on the wire: a varint
    ],
    "NodePublishVolumeRequest": [
        ("VolumeContextEntry", [("key", 1, _STR, _OPT, ""), ("value", 2, _STR, _OPT, "")]),
    ],
}
_ONEOF = {"VolumeCapability": ("access_type", ("block", "mount"))}


def messages() -> dict[str, Any]:
    """The ``csi.v1`` message classes this plugin speaks, by name.

    A nested one is ``"VolumeCapability.MountVolume"``. Built once from :data:`_MESSAGES`;
    needs ``protobuf``.
    """
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    from google.protobuf import (  # type: ignore[import-untyped,unused-ignore]
        descriptor_pb2,
        descriptor_pool,
        message_factory,
    )

    fd = descriptor_pb2.FileDescriptorProto(
        name="trainmon/csi_v1_subset.proto", package="csi.v1", syntax="proto3"
    )

    def fill(msg: Any, fields: list[tuple[str, int, int, int, str]], oneof: Any = None) -> None:
        if oneof is not None:
            msg.oneof_decl.add(name=oneof[0])
        for name, number, ftype, label, type_name in fields:
            f = msg.field.add(name=name, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = type_name
            if oneof is not None and name in oneof[1]:
                f.oneof_index = 0

    for name, fields in _MESSAGES:
        msg = fd.message_type.add(name=name)
        fill(msg, fields, _ONEOF.get(name))
        for nested, nfields in _NESTED.get(name, []):
            sub = msg.nested_type.add(name=nested)
            fill(sub, nfields)
            if nested.endswith("Entry"):
                sub.options.map_entry = True
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    out: dict[str, Any] = {}
    for name, _ in _MESSAGES:
        desc = pool.FindMessageTypeByName(f"csi.v1.{name}")
        out[name] = message_factory.GetMessageClass(desc)
        for nested, _nfields in _NESTED.get(name, []):
            out[f"{name}.{nested}"] = message_factory.GetMessageClass(
                desc.nested_types_by_name[nested]
            )
    _CLASSES = out
    return out


_CLASSES: dict[str, Any] | None = None


class CsiError(Exception):
    """A request refused, with the gRPC status code name (``INVALID_ARGUMENT``, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _unescape(field: str) -> str:
    """A mountinfo path field, unescaped (proc(5) writes a space as backslash 040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_points(mountinfo: str = "/proc/self/mountinfo") -> set[str]:
    """Every mount point of this process's mount namespace (field 5 of proc(5)'s mountinfo)."""
    with open(mountinfo, encoding="utf-8", errors="surrogateescape") as f:
        return {_unescape(line.split()[4]) for line in f if len(line.split()) > 4}


class _Libc:
    """``mount(2)`` and ``umount2(2)`` through ctypes (the standard library has neither)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"{what}: {os.strerror(e)}")

    def bind(self, source: str, target: str) -> None:
        self._check(self.lib.mount(source.encode(), target.encode(), None, MS_BIND, None), "bind")

    def remount_read_only(self, target: str) -> None:
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
        self._check(self.lib.mount(None, target.encode(), None, flags, None), "remount ro")

    def unmount(self, target: str) -> None:
        self._check(self.lib.umount2(target.encode(), 0), "umount")


class SocketVolumes:
    """The node service's logic: publish and unpublish the socket directory.

    ``socket_dir``: the exporter's socket directory as this process sees it (the DaemonSet's
    hostPath). ``pods_dir``: the only place targets may be (the kubelet's pods directory).
    ``max_volumes``: most targets published at once (each pod on the node has one).
    """

    def __init__(
        self,
        socket_dir: Path,
        pods_dir: Path,
        node_id: str,
        *,
        name: str = DRIVER_NAME,
        max_volumes: int = 1024,
        mountinfo: str = "/proc/self/mountinfo",
    ) -> None:
        self.socket_dir = socket_dir
        self.pods_dir = pods_dir
        self.node_id = node_id
        self.name = name
        self.max_volumes = max_volumes
        self.mountinfo = mountinfo
        self.libc = _Libc()
        self.lock = threading.Lock()
        self.refused: dict[str, int] = {}
        """Requests refused, by gRPC status code name (logged with the reason)."""

    # ----------------------------------------------------------------------- checks

    def _target(self, raw: str) -> Path:
        """``raw``, checked.

        It must be a normalised absolute path inside ``pods_dir`` whose parent is reached
        without a symbolic link; :class:`CsiError` otherwise.
        """
        if not raw:
            raise CsiError("INVALID_ARGUMENT", "target_path is required")
        if not os.path.isabs(raw) or os.path.normpath(raw) != raw:
            raise CsiError(
                "INVALID_ARGUMENT", f"target_path {raw!r} is not a normalised absolute path"
            )
        target = Path(raw)
        root = self.pods_dir
        if root not in target.parents:
            raise CsiError("INVALID_ARGUMENT", f"target_path {raw!r} is outside {root}")
        parent = target.parent
        try:
            real = Path(os.path.realpath(parent, strict=True))
        except OSError as e:
            raise CsiError("FAILED_PRECONDITION", f"the parent of {raw!r}: {e.strerror}") from e
        if real != parent:
            raise CsiError("INVALID_ARGUMENT", f"target_path {raw!r} passes a symbolic link")
        if target.is_symlink():
            raise CsiError("INVALID_ARGUMENT", f"target_path {raw!r} is a symbolic link")
        return target

    def _mounted(self) -> set[str]:
        return mount_points(self.mountinfo)

    def published(self) -> int:
        """Targets under ``pods_dir`` that are mount points now."""
        root = str(self.pods_dir) + "/"
        return sum(1 for p in self._mounted() if p.startswith(root))

    # ----------------------------------------------------------------------- RPCs

    def publish(self, req: Any) -> None:
        """``NodePublishVolume``: bind the socket directory read-only at the target.

        Raises :class:`CsiError`: ``INVALID_ARGUMENT`` for a request that is not an inline
        ephemeral mount volume of this driver, ``FAILED_PRECONDITION`` when the socket
        directory is missing, ``RESOURCE_EXHAUSTED`` past ``max_volumes``, ``INTERNAL`` when
        the kernel refuses the mount. Idempotent: a target already mounted is success.
        """
        if not req.volume_id:
            raise CsiError("INVALID_ARGUMENT", "volume_id is required")
        context = dict(req.volume_context)
        if context.get(EPHEMERAL) != "true":
            raise CsiError(
                "INVALID_ARGUMENT",
                f"only inline ephemeral volumes (pod.spec.volumes[].csi) are served: "
                f"{EPHEMERAL} is {context.get(EPHEMERAL)!r}",
            )
        cap = req.volume_capability
        if not req.HasField("volume_capability") or not cap.HasField("mount"):
            raise CsiError("INVALID_ARGUMENT", "only a mount volume is served (no block volume)")
        if cap.mount.fs_type or list(cap.mount.mount_flags):
            raise CsiError("INVALID_ARGUMENT", "fsType and mount flags are not supported")
        target = self._target(req.target_path)
        if not self.socket_dir.is_dir():
            raise CsiError(
                "FAILED_PRECONDITION", f"the socket directory {self.socket_dir} does not exist yet"
            )
        who = "/".join(context.get(k, "?") for k in POD_KEYS)
        with self.lock:
            mounted = self._mounted()
            if str(target) in mounted:
                log.info("volume %s already published at %s (%s)", req.volume_id, target, who)
                return
            root = str(self.pods_dir) + "/"
            if sum(1 for p in mounted if p.startswith(root)) >= self.max_volumes:
                raise CsiError("RESOURCE_EXHAUSTED", f"{self.max_volumes} volumes published")
            try:
                target.mkdir(mode=0o750)
            except FileExistsError:
                if not target.is_dir() or target.is_symlink():
                    raise CsiError(
                        "INVALID_ARGUMENT", f"{target} exists and is not a directory"
                    ) from None
            except OSError as e:
                raise CsiError("INTERNAL", f"cannot create {target}: {e.strerror}") from e
            try:
                self.libc.bind(str(self.socket_dir), str(target))
            except OSError as e:
                raise CsiError("INTERNAL", f"cannot bind {self.socket_dir} at {target}: {e}") from e
            try:
                self.libc.remount_read_only(str(target))
            except OSError as e:
                self.libc.unmount(str(target))
                raise CsiError("INTERNAL", f"cannot make {target} read-only: {e}") from e
        log.info("volume %s published at %s (%s)", req.volume_id, target, who)

    def unpublish(self, req: Any) -> None:
        """``NodeUnpublishVolume``: unmount the target and remove it.

        Idempotent: a target that is not mounted, or gone, is success. Raises
        :class:`CsiError`.
        """
        if not req.volume_id:
            raise CsiError("INVALID_ARGUMENT", "volume_id is required")
        target = self._target_for_unpublish(req.target_path)
        with self.lock:
            if str(target) in self._mounted():
                try:
                    self.libc.unmount(str(target))
                except OSError as e:
                    raise CsiError("INTERNAL", f"cannot unmount {target}: {e}") from e
            try:
                target.rmdir()
            except FileNotFoundError:
                pass
            except OSError as e:
                raise CsiError("INTERNAL", f"cannot remove {target}: {e.strerror}") from e
        log.info("volume %s unpublished from %s", req.volume_id, target)

    def _target_for_unpublish(self, raw: str) -> Path:
        try:
            return self._target(raw)
        except CsiError as e:
            if e.code == "FAILED_PRECONDITION":  # the pod's directory is gone: nothing to undo
                return Path(raw)
            raise


def _handlers(volumes: SocketVolumes) -> list[Any]:
    """The gRPC services ``csi.v1.Identity`` and ``csi.v1.Node`` over ``volumes``."""
    import grpc  # type: ignore[import-untyped,unused-ignore]

    m = messages()

    def unary(fn: Callable[[Any], Any], request: str, response: str) -> Any:
        def handle(req: Any, ctx: Any) -> Any:
            try:
                return fn(req) or m[response]()
            except CsiError as e:
                volumes.refused[e.code] = volumes.refused.get(e.code, 0) + 1
                log.warning("%s refused (%s): %s", request.removesuffix("Request"), e.code, e)
                ctx.abort(getattr(grpc.StatusCode, e.code), str(e))

        return grpc.unary_unary_rpc_method_handler(
            handle,
            request_deserializer=m[request].FromString,
            response_serializer=m[response].SerializeToString,
        )

    identity = {
        "GetPluginInfo": unary(
            lambda _: m["GetPluginInfoResponse"](name=volumes.name, vendor_version=__version__),
            "GetPluginInfoRequest",
            "GetPluginInfoResponse",
        ),
        "GetPluginCapabilities": unary(
            lambda _: None, "GetPluginCapabilitiesRequest", "GetPluginCapabilitiesResponse"
        ),
        "Probe": unary(lambda _: None, "ProbeRequest", "ProbeResponse"),
    }
    node = {
        "NodeGetCapabilities": unary(
            lambda _: None, "NodeGetCapabilitiesRequest", "NodeGetCapabilitiesResponse"
        ),
        "NodeGetInfo": unary(
            lambda _: m["NodeGetInfoResponse"](node_id=volumes.node_id),
            "NodeGetInfoRequest",
            "NodeGetInfoResponse",
        ),
        "NodePublishVolume": unary(
            volumes.publish, "NodePublishVolumeRequest", "NodePublishVolumeResponse"
        ),
        "NodeUnpublishVolume": unary(
            volumes.unpublish, "NodeUnpublishVolumeRequest", "NodeUnpublishVolumeResponse"
        ),
    }
    return [
        grpc.method_handlers_generic_handler("csi.v1.Identity", identity),
        grpc.method_handlers_generic_handler("csi.v1.Node", node),
    ]


def serve(volumes: SocketVolumes, endpoint: Path) -> Any:
    """Start the gRPC server on the Unix socket ``endpoint``; returns the ``grpc.Server``.

    A stale socket file there is removed first; the new one is made ``0600``.
    """
    import grpc  # type: ignore[import-untyped,unused-ignore]

    try:
        if endpoint.is_socket():
            endpoint.unlink()
    except FileNotFoundError:
        pass
    endpoint.parent.mkdir(parents=True, exist_ok=True)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1), maximum_concurrent_rpcs=16)
    server.add_generic_rpc_handlers(_handlers(volumes))
    old = os.umask(0o177)
    try:
        if server.add_insecure_port(f"unix://{endpoint}") == 0:
            raise OSError(errno.EADDRINUSE, f"cannot listen on {endpoint}")
        server.start()
    finally:
        os.umask(old)
    return server


def main(argv: list[str] | None = None) -> int:
    """``trainmon-csi-node``: serve until SIGTERM or SIGINT. Returns the exit status."""
    p = argparse.ArgumentParser(prog="trainmon-csi-node", description=__doc__.splitlines()[0])
    p.add_argument(
        "--endpoint",
        default=os.environ.get("CSI_ENDPOINT", "unix:///csi/csi.sock"),
        help="the plugin's gRPC socket, as node-driver-registrar is told (env CSI_ENDPOINT)",
    )
    p.add_argument(
        "--node-id",
        default=os.environ.get("NODE_NAME", ""),
        help="this node's name, from the downward API's spec.nodeName (env NODE_NAME)",
    )
    p.add_argument("--socket-dir", default="/run/trainmon", help="the exporter's socket directory")
    p.add_argument(
        "--pods-dir",
        default="/var/lib/kubelet/pods",
        help="the kubelet's pods directory: every target path must be inside it",
    )
    p.add_argument("--driver-name", default=DRIVER_NAME, help="the CSIDriver object's name")
    p.add_argument("--max-volumes", type=int, default=1024, help="most volumes published at once")
    args = p.parse_args(argv)
    try:
        import google.protobuf  # type: ignore[import-untyped,unused-ignore]  # noqa: F401
        import grpc  # type: ignore[import-untyped,unused-ignore]  # noqa: F401
    except ImportError as e:
        p.error(f"{e.name} is missing: pip install 'trainmon-exporter[csi]'")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if not args.node_id:
        p.error("--node-id (or NODE_NAME) is required")
    endpoint = Path(args.endpoint.removeprefix("unix://"))
    if not endpoint.is_absolute():
        p.error(f"--endpoint must be unix:///absolute/path, not {args.endpoint!r}")
    volumes = SocketVolumes(
        Path(args.socket_dir),
        Path(os.path.normpath(args.pods_dir)),
        args.node_id,
        name=args.driver_name,
        max_volumes=args.max_volumes,
    )
    server = serve(volumes, endpoint)
    log.info(
        "%s %s serving on %s: %s into pods under %s",
        args.driver_name,
        __version__,
        endpoint,
        args.socket_dir,
        args.pods_dir,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=5).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
