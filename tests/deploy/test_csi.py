"""trainmon-csi-node, the CSI node plugin, over its real gRPC Unix socket.

- Its messages carry the CSI specification's field numbers and types (``csi.proto`` of the
  specification, vendored under tests/deploy/schemas/), so the kubelet's requests decode.
- Identity and node RPCs answer as the kubelet and node-driver-registrar expect.
- What is not an inline ephemeral mount volume of a target under the pods directory is
  refused with the status the CSI specification names, before anything is mounted, and
  counted.

The mount itself, the trainer connecting through it and the unpublish are re-enacted as root
with the DaemonSet's own arguments in tests/deploy/test_kubernetes.py
(``test_a_non_root_trainer_reaches_the_socket_with_the_manifests_permissions[daemonset]``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..conftest import short_tmpdir

grpc = pytest.importorskip("grpc", reason="pip install 'trainmon-exporter[csi]'")
csi = pytest.importorskip("trainmon_exporter.csi")

PROTO = Path(__file__).with_name("schemas") / "csi-spec-v1.13.0" / "csi.proto"
SCALARS = {"string": 9, "bool": 8, "int64": 3}


def spec_messages() -> dict[str, dict[str, tuple[int, str, bool]]]:
    """``{message: {field: (number, type, repeated)}}`` from the specification's csi.proto;
    nested messages as ``Outer.Inner``, a map field as ``repeated <Field>Entry``."""
    text = re.sub(r"//[^\n]*", "", PROTO.read_text())
    out: dict[str, dict[str, tuple[int, str, bool]]] = {}
    stack: list[tuple[str, str]] = []  # (kind, name)
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if m := re.match(r"(message|enum|oneof)\s+(\w+)\s*\{", line):
            stack.append((m.group(1), m.group(2)))
            if m.group(1) == "message":
                out[".".join(n for k, n in stack if k == "message")] = {}
            if line.endswith("}"):
                stack.pop()
            continue
        opened, closed = line.count("{"), line.count("}")
        if opened or closed:
            for _ in range(opened):
                stack.append(("other", ""))
            for _ in range(closed):
                stack.pop()
            continue
        if not stack or stack[-1][0] not in ("message", "oneof"):
            continue
        msg = ".".join(n for k, n in stack if k == "message")
        if f := re.match(r"map<\s*\w+\s*,\s*\w+\s*>\s+(\w+)\s*=\s*(\d+)", line):
            entry = "".join(w.capitalize() for w in f.group(1).split("_")) + "Entry"
            out[msg][f.group(1)] = (int(f.group(2)), f"{msg}.{entry}", True)
        elif f := re.match(r"(repeated\s+)?([\w.]+)\s+(\w+)\s*=\s*(\d+)", line):
            out[msg][f.group(3)] = (int(f.group(4)), f.group(2), bool(f.group(1)))
    return out


def test_the_messages_are_the_specifications() -> None:
    """Every field the plugin reads or writes has the specification's number and a type with
    the same wire encoding (an enum is a varint, as the plugin's int64)."""
    spec = spec_messages()
    assert "NodePublishVolumeRequest" in spec and "VolumeCapability.MountVolume" in spec
    ours = [*csi._MESSAGES, *[(f"{o}.{n}", f) for o, ns in csi._NESTED.items() for n, f in ns]]
    checked = 0
    for name, fields in ours:
        if name.endswith("Entry"):
            continue  # map entries: key 1, value 2 by protobuf's definition
        assert name in spec, name
        for field, number, ftype, label, type_name in fields:
            assert field in spec[name], (name, field)
            n, stype, repeated = spec[name][field]
            assert n == number, (name, field, n, number)
            assert repeated == (label == csi._REP), (name, field)
            if ftype == csi._MSG:
                assert type_name.removeprefix(".csi.v1.") in (stype, f"{name}.{stype}"), (
                    name,
                    field,
                )
            elif stype in SCALARS:
                assert SCALARS[stype] == ftype, (name, field)
            else:  # an enum of the specification, a varint
                assert ftype == csi._I64 and (f"{name}.{stype}" in spec or stype == "Mode"), (
                    name,
                    field,
                    stype,
                )
            checked += 1
    assert checked >= 15, checked


class Plugin:
    """The plugin's gRPC server in this process, on a real Unix socket, and a client."""

    def __init__(self, base: Path) -> None:
        self.socket_dir = base / "run-trainmon"
        self.pods = base / "pods"
        self.pods.mkdir()
        self.volumes = csi.SocketVolumes(self.socket_dir, self.pods, "node-7")
        self.endpoint = base / "plugin" / "csi.sock"
        self.server = csi.serve(self.volumes, self.endpoint)
        self.channel = grpc.insecure_channel(f"unix://{self.endpoint}")
        self.m = csi.messages()

    def call(self, service: str, method: str, request: Any = None) -> Any:
        stub = self.channel.unary_unary(
            f"/csi.v1.{service}/{method}",
            request_serializer=self.m[f"{method}Request"].SerializeToString,
            response_deserializer=self.m[f"{method}Response"].FromString,
        )
        return stub(request or self.m[f"{method}Request"](), timeout=10)

    def publish_request(self, target: Path | str, **context: str) -> Any:
        req = self.m["NodePublishVolumeRequest"](
            volume_id="csi-0123", target_path=str(target), readonly=True
        )
        req.volume_capability.mount.SetInParent()
        req.volume_capability.access_mode.mode = 1
        req.volume_context.update({csi.EPHEMERAL: "true", **context})
        return req

    def refused(self, req: Any) -> tuple[Any, str]:
        with pytest.raises(grpc.RpcError) as e:
            self.call("Node", "NodePublishVolume", req)
        return e.value.code(), e.value.details()


@pytest.fixture
def plugin() -> Iterator[Plugin]:
    import shutil

    base = short_tmpdir()
    p = Plugin(base)
    yield p
    p.channel.close()
    p.server.stop(grace=None)
    shutil.rmtree(base, ignore_errors=True)


def test_identity_and_node_info_answer_as_the_kubelet_expects(plugin: Plugin) -> None:
    from trainmon_exporter import __version__

    info = plugin.call("Identity", "GetPluginInfo")
    assert (info.name, info.vendor_version) == ("csi.trainmon.io", __version__)
    plugin.call("Identity", "Probe")
    caps = plugin.call("Identity", "GetPluginCapabilities")
    assert caps.ByteSize() == 0  # no controller service: a node-only plugin
    node_caps = plugin.call("Node", "NodeGetCapabilities")
    assert node_caps.ByteSize() == 0  # no STAGE_UNSTAGE_VOLUME: the kubelet publishes directly
    assert plugin.call("Node", "NodeGetInfo").node_id == "node-7"
    assert plugin.endpoint.stat().st_mode & 0o777 == 0o600  # root's only


def test_what_is_not_an_inline_volume_of_a_pod_is_refused(plugin: Plugin, tmp_path: Path) -> None:
    """Each request the kubelet never sends for an inline volume is refused before anything
    is created or mounted; each refusal is counted by status."""
    plugin.socket_dir.mkdir()
    pod = plugin.pods / "uid-1" / "volumes" / "kubernetes.io~csi" / "trainmon"
    pod.mkdir(parents=True)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    target = pod / "mount"
    persistent = plugin.publish_request(target)
    persistent.volume_context[csi.EPHEMERAL] = "false"
    block = plugin.publish_request(target)
    block.volume_capability.block.SetInParent()
    ext4 = plugin.publish_request(target)
    ext4.volume_capability.mount.fs_type = "ext4"
    elsewhere = tmp_path / "etc"
    elsewhere.mkdir()
    link = plugin.pods / "uid-2"
    link.symlink_to(elsewhere)
    (elsewhere / "volumes").mkdir()
    cases = {
        "persistent": (persistent, invalid, "only inline ephemeral volumes"),
        "block": (block, invalid, "no block volume"),
        "fs type": (ext4, invalid, "fsType"),
        "no volume id": (plugin.m["NodePublishVolumeRequest"](), invalid, "volume_id"),
        "relative": (plugin.publish_request("pods/uid-1/mount"), invalid, "absolute"),
        "dot-dot": (plugin.publish_request(f"{pod}/../../x"), invalid, "normalised"),
        "outside": (plugin.publish_request(elsewhere / "mount"), invalid, "outside"),
        "through a link": (plugin.publish_request(link / "volumes" / "mount"), invalid, "link"),
        "no parent": (
            plugin.publish_request(plugin.pods / "uid-3" / "v" / "mount"),
            grpc.StatusCode.FAILED_PRECONDITION,
            "parent",
        ),
    }
    for name, (req, code, words) in cases.items():
        got, details = plugin.refused(req)
        assert (got, words in details) == (code, True), (name, got, details)
    assert not target.exists() and list(elsewhere.iterdir()) == [elsewhere / "volumes"]
    assert plugin.volumes.refused == {"INVALID_ARGUMENT": 8, "FAILED_PRECONDITION": 1}


def test_no_socket_directory_yet_is_a_retryable_refusal(plugin: Plugin) -> None:
    """Before the exporter's init container made the directory: FAILED_PRECONDITION, which
    the kubelet retries, and no target left behind."""
    pod = plugin.pods / "uid-1" / "volumes" / "kubernetes.io~csi" / "trainmon"
    pod.mkdir(parents=True)
    code, details = plugin.refused(plugin.publish_request(pod / "mount"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "does not exist yet" in details
    assert not (pod / "mount").exists()


def test_unpublish_of_what_is_not_there_succeeds(plugin: Plugin) -> None:
    """The kubelet retries an unpublish, and sends one after a node restart for a pod whose
    directory is gone: both succeed, and nothing outside the pods directory is touched."""
    req = plugin.m["NodeUnpublishVolumeRequest"]
    gone = plugin.pods / "uid-9" / "volumes" / "kubernetes.io~csi" / "trainmon" / "mount"
    plugin.call("Node", "NodeUnpublishVolume", req(volume_id="csi-9", target_path=str(gone)))
    here = gone.parent
    here.mkdir(parents=True)
    (here / "mount").mkdir()
    plugin.call("Node", "NodeUnpublishVolume", req(volume_id="csi-9", target_path=str(gone)))
    assert not gone.exists() and here.exists()
    with pytest.raises(grpc.RpcError) as e:
        plugin.call("Node", "NodeUnpublishVolume", req(volume_id="csi-9", target_path="/etc"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_mount_points_reads_escaped_paths(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "36 35 98:0 /mnt1 /mnt/with\\040space rw,noatime master:1 - ext3 /dev/root rw\n"
        "37 35 0:5 / /var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/trainmon/mount ro "
        "- tmpfs t rw\n"
    )
    assert csi.mount_points(str(info)) == {
        "/mnt/with space",
        "/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/trainmon/mount",
    }
