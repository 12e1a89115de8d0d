"""Exporter admission: the cost of one HELLO at 10 ranks and at the 1,024-rank cap.

A HELLO churn at the rank cap is what a hostile local uid can do for free: connect, send a
HELLO under a fresh run id, close, again. Each HELLO is admitted (making room by evicting a
disconnected rank) and then disconnects. This script applies such HELLOs in process through
``Applier.packet`` (decode, validation, ``Store.attach``) on a store filled to its cap with
crashed ranks of another uid, and prints microseconds per HELLO (admission plus disconnect) at
10 and 1,024 ranks, their ratio (1.0 means the cost does not grow with the ranks held), and, as
the same run's reference, what one full pass over the ranks costs at each size: a HELLO used
to pay two (the eviction scan and the run look-up). Then the same churn at 10 ranks with
owner claims on (``--owner-claims-dir``, a directory in ``/dev/shm`` holding no claim for the
churned ids, so every HELLO pays the full look-up) against the same churn without. Last, the
path a tenant below its fair share takes at a full node: four tenants' live, stepping ranks
fill the cap (none has an idle rank, so the choice scans every rank above the share), and each
HELLO comes from a new tenant that takes one of them, at 64 and 1,024 ranks. And what
identifying a connection's pod adds at accept on a Kubernetes node (``--kubelet-pod-logs-dir``):
reading the process's cgroup, checking it still lives (``SO_PEERPIDFD``) and looking its pod
up, for a process in a pod (a ``/proc`` laid out in a temporary directory) and one outside.

    python benchmarks/admission.py [--hellos 20000] [--smoke]

``--smoke`` runs briefly (the figures mean nothing) so CI keeps it working.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path

from prometheus_client import CollectorRegistry

from trainmon_client import _protocol as P
from trainmon_exporter.apply import Applier, Link
from trainmon_exporter.claims import OwnerClaims
from trainmon_exporter.ingest import IngestMetrics
from trainmon_exporter.peers import PeerResolver, PodDirectory
from trainmon_exporter.state.admission import EVICTION_ORDER
from trainmon_exporter.state.store import Store

HELLO = {
    "run": "x",
    "rank": 0,
    "local_rank": 0,
    "world_size": 1,
    "hostname": "h",
    "pid": 1,
    "client_version": "bench",
    "gpu_uuid": None,
    "started_at": 1.0,
    "flops_per_token": None,
    "dtype": "bf16",
}
VICTIM_UID, CHURN_UID = 1000, 2000


def _packet(run: str) -> bytes:
    return P.packet_header() + P.encode_hello(HELLO | {"run": run})


def _store(ranks: int) -> tuple[Store, Applier]:
    """A store at its cap of ``ranks``, every one a crashed rank of :data:`VICTIM_UID`."""
    store = Store(
        max_ranks=ranks,
        max_custom_metrics=8,
        buckets=(1.0,),
        window_s=30,
        ttl_s=3600,
        retention_s=0,  # every disconnected rank may be evicted: the worst case for the scan
    )
    m = IngestMetrics(CollectorRegistry())
    applier = Applier(store, m.invalid, m.messages, m.dropped_values)
    for i in range(ranks):
        link = Link(peer_pid=1, peer_uid=VICTIM_UID, peer_gid=VICTIM_UID)
        applier.packet(link, _packet(f"victim-{i}"))
        assert link.state is not None
        with store.lock:
            link.state.disconnect(finished=False)
    return store, applier


def hello_cost(ranks: int, hellos: int, claims: Path | None = None) -> float:
    """Microseconds per churned HELLO (admitted with an eviction, then disconnected); with
    ``claims``, each HELLO also looks its run up in that owner claims directory."""
    store, applier = _store(ranks)
    if claims is not None:
        store.claims = OwnerClaims(claims)
    packets = [_packet(f"churn-{i}") for i in range(hellos)]
    t0 = time.perf_counter()
    for data in packets:
        link = Link(peer_pid=2, peer_uid=CHURN_UID, peer_gid=CHURN_UID)
        applier.packet(link, data)
        state = link.state
        if state is None:
            raise RuntimeError("a churned HELLO was refused")
        with store.lock:
            state.disconnect(finished=False)
    took = time.perf_counter() - t0
    assert len(store.ranks) == ranks and sum(store.admission.evicted.values()) == hellos
    if store.claims is not None:  # every look-up went through the checks to the missing file
        assert not any(store.claims.invalid.values()), store.claims.invalid
    return took / hellos * 1e6


def reclaim_cost(ranks: int, hellos: int) -> float:
    """Microseconds per HELLO of a new tenant that takes a live rank at a full node."""
    store = Store(max_ranks=ranks, max_custom_metrics=8, buckets=(1.0,), window_s=30, ttl_s=3600)
    m = IngestMetrics(CollectorRegistry())
    applier = Applier(store, m.invalid, m.messages, m.dropped_values)
    for i in range(ranks):
        link = Link(peer_pid=1, peer_uid=VICTIM_UID + i % 4, peer_gid=VICTIM_UID)
        applier.packet(link, _packet(f"live-{i}"))
        assert link.state is not None
        link.state.last_step_mono = time.monotonic() + 1  # stepping: not idle
    packets = [_packet(f"new-{i}") for i in range(hellos)]
    t0 = time.perf_counter()
    for i, data in enumerate(packets):
        link = Link(peer_pid=2, peer_uid=CHURN_UID + i, peer_gid=CHURN_UID)
        applier.packet(link, data)
        if link.state is None:
            raise RuntimeError("a tenant below its fair share was refused")
    took = time.perf_counter() - t0
    assert store.admission.evicted["live"] == hellos
    return took / hellos * 1e6


def identify_cost(lookups: int) -> tuple[float, float]:
    """Microseconds per connection identified: a process in a pod, and one outside any."""
    tmp = Path(tempfile.mkdtemp(prefix="trainmon-pods-"))
    try:
        pods, proc = tmp / "pods", tmp / "proc"
        pods.mkdir()
        tmp.chmod(0o755)
        for i in range(100):  # a full node's pods
            (pods / f"team-{i}_train-0_{uuid.uuid4()}").mkdir()
        pod_uid = str(uuid.uuid4())
        (pods / f"team-a_train-0_{pod_uid}").mkdir()
        me = proc / str(os.getpid())
        me.mkdir(parents=True)
        (me / "cgroup").write_text(
            f"0::/kubepods.slice/kubepods-pod{pod_uid.replace('-', '_')}.slice/"
            f"cri-containerd-{'ab' * 32}.scope\n"
        )
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with a, b:
            costs = []
            for resolver, want in (
                (PeerResolver(PodDirectory(pods), proc), "pod"),
                (PeerResolver(PodDirectory(pods)), "host"),  # this process, in the real /proc
            ):
                if resolver.resolve(a, os.getpid()).identity != want:
                    raise RuntimeError(f"expected a {want} peer")
                t0 = time.perf_counter()
                for _ in range(lookups):
                    resolver.resolve(a, os.getpid())
                costs.append((time.perf_counter() - t0) / lookups * 1e6)
            return costs[0], costs[1]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def scan_cost(ranks: int, passes: int) -> float:
    """Microseconds of one pass over every rank choosing the oldest disconnected one."""
    store, _ = _store(ranks)
    states = store.ranks
    t0 = time.perf_counter()
    for _ in range(passes):
        best = None
        for s in states.values():
            if s.connected:
                continue
            order = EVICTION_ORDER.index(s.status) if s.status in EVICTION_ORDER else 3
            key = (order, s.disconnected_mono or 0.0)
            if best is None or key < best:
                best = key
    return (time.perf_counter() - t0) / passes * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--hellos", type=int, default=20_000, help="HELLOs per size")
    ap.add_argument("--smoke", action="store_true", help="seconds long; figures meaningless")
    args = ap.parse_args()
    hellos = 500 if args.smoke else args.hellos
    sizes = (10, 1024)
    cost = {n: min(hello_cost(n, hellos) for _ in range(3)) for n in sizes}
    scan = {n: min(scan_cost(n, max(50, hellos // 20)) for _ in range(3)) for n in sizes}
    print(f"{'ranks held':>10} {'us per HELLO':>13} {'one scan of the ranks (us)':>27}")
    for n in sizes:
        print(f"{n:>10,} {cost[n]:>13.1f} {scan[n]:>27.1f}")
    print(f"HELLO at 1,024 ranks / at 10 ranks: {cost[1024] / cost[10]:.2f}")
    print(
        f"two scans at 1,024 ranks would add {2 * scan[1024]:.0f} us per HELLO, "
        f"{2 * scan[1024] / cost[1024]:.1f} x the HELLO's whole cost now"
    )
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    owners = Path(tempfile.mkdtemp(prefix="trainmon-owners-", dir=shm))
    try:
        owners.chmod(0o755)
        pairs = [(hello_cost(10, hellos), hello_cost(10, hellos, owners)) for _ in range(5)]
        plain, claimed = min(p for p, _ in pairs), min(c for _, c in pairs)
    finally:
        shutil.rmtree(owners, ignore_errors=True)
    print(
        f"owner claims at 10 ranks ({owners.parent}): {claimed:.1f} us per HELLO against "
        f"{plain:.1f} without, +{claimed - plain:.1f} us for the look-up"
    )
    n = 10 if args.smoke else 60  # new tenants per size: the shares stay above one rank
    reclaim = {r: min(reclaim_cost(r, n) for _ in range(3)) for r in (64, 1024)}
    print(
        f"a tenant below its fair share at a full node of live ranks: {reclaim[64]:.1f} us per "
        f"HELLO at 64 ranks, {reclaim[1024]:.1f} at 1,024 (one scan of 1,024 ranks: "
        f"{scan[1024]:.0f} us)"
    )
    pod, host = (min(c) for c in zip(*(identify_cost(n * 50) for _ in range(3)), strict=True))
    print(
        f"identifying a connection's pod at accept: {pod:.1f} us for a process in a pod, "
        f"{host:.1f} us for one outside any (a HELLO costs {cost[10]:.0f} us)"
    )


if __name__ == "__main__":
    main()
