"""A tenant that holds nothing always gets in, however many uids one process squats under.

One root process switches its effective uid (``seteuid``, as root in a container without user
namespaces can, or a tenant given several ``runAsUser`` values) and holds idle connections,
each quota's worth under each of four uids: every rank slot, or every connection slot, is
taken. A real trainer of a fifth uid must still be admitted and deliver every step; the slot
comes from the squatters (counted), and the holdings are labelled by uid.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..conftest import InProcessExporter, child_env, sample, wait_for
from ..helpers.uids import OWNER, OWNER_GID, User, needs_root, shared_exporter

SQUATTERS = (43301, 43302, 43303, 43304)
OPEN = "trainmon_ingest_open_connections"

# One root process: each quota's worth of connections under each uid in turn (seteuid: the
# kernel records the effective uid at connect), a HELLO on each or none; then, on stdin, what
# each connection was told (a REFUSED reason, "open", or "closed").
SQUAT = """
import os, socket, sys, time
from trainmon_client import _protocol as P
sock, uids = sys.argv[1], [int(u) for u in sys.argv[2].split(",")]
each, hellos = int(sys.argv[3]), sys.argv[4] == "1"
conns = []
for uid in uids:
    os.setegid(uid); os.seteuid(uid)
    for i in range(each):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(sock)
        if hellos:
            s.send(P.packet_header() + P.encode_hello({k: None for k in P.HELLO_FIELDS} | {
                "run": f"squat{uid}-{i}", "rank": 0, "local_rank": 0, "world_size": 1,
                "hostname": "h", "pid": os.getpid(), "client_version": "t", "started_at": 1.0,
                "dtype": "bf16"}))
        conns.append(s)
    os.seteuid(0); os.setegid(0)
print("holding", flush=True)
input()
told = []
for s in conns:
    s.setblocking(False)
    try:
        data = s.recv(P.MAX_PACKET_BYTES)
    except BlockingIOError:
        told.append("open")
        continue
    except OSError:
        told.append("closed")
        continue
    refusal = P.decode_refused(data) if data else None
    told.append(refusal.reason if refusal else "closed")
print(",".join(told), flush=True)
"""

TRAIN = """
r = init("fair")
for i in range(1, 41):
    r.log(i, loss=1.0, tokens=100)
r.finish()
print(sum(r.dropped.values()))
"""


@contextmanager
def _squatting(ex: InProcessExporter, hellos: bool, full: Callable[[], bool]) -> Iterator[None]:
    """Two connections under each of :data:`SQUATTERS` held, until ``full`` holds, for the
    block; then exactly one of them was told ``evicted`` and the others are still open."""
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(SQUAT),
            ex.socket,
            ",".join(map(str, SQUATTERS)),
            "2",
            "1" if hellos else "0",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "holding", p.stderr.read() if p.stderr else ""
        wait_for(full)
        yield
    finally:
        out, err = p.communicate("\n", timeout=30)
    assert p.returncode == 0, err
    assert sorted(out.strip().split(",")) == ["evicted"] + ["open"] * 7


def _train(ex: InProcessExporter) -> None:
    """A trainer of another uid logs 40 steps and finishes: every one arrives, none dropped."""
    trainer = User(ex.socket, OWNER, OWNER_GID, TRAIN)
    rc, out, err = trainer.wait()
    assert rc == 0, err
    assert out.split()[0] == "0", out  # nothing dropped by the client
    r = wait_for(lambda: (k := ex.rank("fair", 0)) and k["status"] == "finished" and k)
    assert r["step"] == 40
    steps = sample(ex.metrics(), "trainmon_train_steps_total", run="fair", rank="0")
    assert steps == 40


@needs_root
def test_idle_hellos_under_four_uids_do_not_keep_a_fifth_out(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    """Four uids, two HELLO-only ranks each, fill the 8 rank slots (quota 2 = a quarter): the
    fifth uid's trainer gets a squatter's slot and all its 40 steps arrive; the squatter is
    told ``evicted`` and the holdings are labelled by uid."""
    ex = shared_exporter(make_exporter, socket_mode="0666", max_ranks=8, max_ranks_per_uid=2)
    with _squatting(ex, True, lambda: sample(ex.metrics(), "trainmon_exporter_ranks") == 8):
        _train(ex)
        m = ex.metrics()
        assert sample(m, "trainmon_exporter_ranks_evicted_total", status="idle") == 1
        assert sample(m, "trainmon_exporter_tenant_ranks", uid=str(OWNER)) == 1
        held = [sample(m, "trainmon_exporter_tenant_ranks", uid=str(u)) or 0 for u in SQUATTERS]
        assert sorted(held) == [1, 2, 2, 2]
        refused = "trainmon_ingest_connections_refused_total"
        wait_for(lambda: sample(ex.metrics(), refused, reason="fair_share") == 1)


@needs_root
def test_connections_without_a_hello_under_four_uids_do_not_keep_a_fifth_out(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    """Four uids hold every connection slot (two each of 8, without a HELLO, which they may
    for 60 s): the fifth uid's trainer is owed a slot, a squatter's connection closes for it."""
    ex = shared_exporter(
        make_exporter,
        socket_mode="0666",
        ingest_max_connections=8,
        ingest_max_connections_per_uid=2,
        ingest_hello_timeout_seconds=60,
    )
    with _squatting(ex, False, lambda: sample(ex.metrics(), OPEN) == 8):
        _train(ex)
        m = ex.metrics()
        assert sample(m, "trainmon_ingest_connections_refused_total", reason="fair_share") == 1
        assert sample(m, "trainmon_ingest_connections_refused_total", reason="max_connections") == 0
