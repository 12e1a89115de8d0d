"""Records become rank state through one dispatch, on hand-built stores (no socket, no sleep).

Every packet is counted: each record applied by type, refused by reason, or its values dropped
by reason; no reason can be missing from the counters.
"""

from __future__ import annotations

import struct

import pytest
from prometheus_client import CollectorRegistry

from trainmon_client import _protocol as P
from trainmon_exporter.apply import (
    FATAL,
    INTERNAL_ERROR,
    LABEL_CHARS,
    MAX_NAMES_PER_CONNECTION,
    REFUSALS,
    Applier,
    Link,
    Refused,
)
from trainmon_exporter.ingest import INVALID_REASONS, IngestMetrics
from trainmon_exporter.state.admission import SERIES_PER_RANK
from trainmon_exporter.state.rank import RankState
from trainmon_exporter.state.store import Store

from ..helpers.exporter import HELLO, hello, pkt, step, store_of


class Bench:
    """An applier on a fresh store and registry, and the counters it moves."""

    def __init__(self, store: Store | None = None) -> None:
        self.store = store or store_of()
        self.registry = CollectorRegistry()
        m = IngestMetrics(self.registry)
        self.applier = Applier(self.store, m.invalid, m.messages, m.dropped_values)

    def invalid(self, reason: str) -> float | None:
        return self.registry.get_sample_value(
            "trainmon_ingest_messages_invalid_total", {"reason": reason}
        )

    def applied(self, rtype: str) -> float | None:
        return self.registry.get_sample_value("trainmon_ingest_messages_total", {"type": rtype})

    def dropped(self, reason: str) -> float | None:
        return self.registry.get_sample_value(
            "trainmon_ingest_values_dropped_total", {"reason": reason}
        )

    def invalid_total(self) -> float:
        return sum(self.invalid(r) or 0.0 for r in INVALID_REASONS)


def test_every_reason_a_record_can_be_refused_for_is_counted_from_zero() -> None:
    """A reason missing from the counters would raise KeyError while counting it."""
    b = Bench()
    for reason in (*P.PROTOCOL_ERRORS, *REFUSALS, INTERNAL_ERROR):
        assert reason in INVALID_REASONS
        assert b.invalid(reason) == 0.0, reason
        assert reason in b.applier._invalid
    assert set(REFUSALS) >= FATAL
    with pytest.raises(ValueError, match="not a refusal reason"):
        Refused("made_up")
    with pytest.raises(ValueError, match="not a protocol error reason"):
        P.ProtocolError("made_up")


def test_the_stores_refusals_are_refusals() -> None:
    said: set[str | RankState] = set()
    store = store_of(max_series=2 * SERIES_PER_RANK, max_series_per_uid=SERIES_PER_RANK)
    first = store.attach(HELLO, uid=1)
    assert not isinstance(first, str)
    said |= {
        store.attach(HELLO, uid=2),  # not_owner
        store.attach(HELLO, uid=1),  # duplicate_rank
        store.attach(HELLO | {"run": "b"}, uid=1),  # uid_series_quota
    }
    assert not isinstance(store.attach(HELLO | {"run": "b"}, uid=2), str)
    said.add(store.attach(HELLO | {"run": "c"}, uid=3))  # series_budget
    store = store_of(max_ranks=2, max_ranks_per_uid=1)
    assert not isinstance(store.attach(HELLO, uid=1), str)
    said.add(store.attach(HELLO | {"run": "b"}, uid=1))  # uid_rank_quota
    assert not isinstance(store.attach(HELLO | {"run": "b"}, uid=2), str)
    said.add(store.attach(HELLO | {"run": "c"}, uid=3))  # too_many_ranks
    assert said == {
        "not_owner",
        "duplicate_rank",
        "uid_series_quota",
        "series_budget",
        "uid_rank_quota",
        "too_many_ranks",
    }
    for reason in said:
        assert isinstance(reason, str)
        assert Refused(reason).reason == reason
        assert reason in FATAL


def test_every_record_type_is_applied_and_counted() -> None:
    b = Bench()
    link = Link(peer_pid=77, peer_uid=1000, peer_gid=1000)
    names = [P.encode_name(64 + i, n) for i, n in enumerate(("acc", "val", "l0", "l1"))]
    layers = P.encode_layers(2, 3.0, 1, 0.1, [66, 67], [P.STAT_GRAD_NORM], [2.0, 1.0])
    evaluation = P.encode_fields(P.EVAL, P.EVAL_HEADER.pack(2, 3.0), [6, 64], [1.5, 0.9])
    data = pkt(
        hello(),
        *names,
        step(1),
        step(2),
        evaluation,
        P.encode_track(65, True, 2.0, 3),
        P.encode_checkpoint(2, 3.0, 0.5),
        layers,
        P.encode_totals(P.Totals(6, 6, 0, 0, 0, 0, 0)),
    )
    assert not b.applier.packet(link, data)
    s = link.state
    assert s is not None and s.peer_pid == 77 and s.owner_uid == 1000
    assert link.names == {64: "acc", 65: "val", 66: "l0", 67: "l1"}
    assert s.step == 2 and s.eval_values == {"acc": 0.9, "val_loss": 1.5}
    assert s.ops["val"].active and s.ops["watch"].runs_total == 1
    assert s.checkpoint == P.Checkpoint(2, 3.0, 0.5) and set(s.layers) == {"l0", "l1"}
    assert link.applied == 6 and link.gap == 0 and s.unapplied_total == 0
    for rtype, n in [("hello", 1), ("name", 4), ("step", 2), ("eval", 1), ("track", 1)]:
        assert b.applied(rtype) == n, rtype
    for rtype in ("checkpoint", "layers", "totals"):
        assert b.applied(rtype) == 1, rtype
    assert b.invalid_total() == 0
    assert not b.applier.packet(link, pkt(P.encode_finish(P.FINISH_OK, 4.0)))
    assert link.finished and s.status == "finished" and b.applied("finish") == 1


def test_records_before_a_hello_are_refused_before_they_are_decoded() -> None:
    b = Bench()
    link = Link()
    cut_short = struct.pack("<BH", P.STEP, 3) + b"abc"
    assert not b.applier.packet(link, pkt(step(1), cut_short, P.encode_name(64, "x")))
    assert b.invalid("no_hello") == 3 and b.invalid("truncated") == 0
    assert link.state is None and link.names == {}


def test_a_second_hello_is_refused_whatever_it_holds() -> None:
    b = Bench()
    link = Link()
    not_json = struct.pack("<BH", P.HELLO, 5) + b"{oops"
    assert not b.applier.packet(link, pkt(hello(), not_json, hello(), step(1)))
    assert b.invalid("duplicate_hello") == 2 and b.invalid("malformed") == 0
    assert link.state is not None and link.state.step == 1


def test_a_refused_hello_closes_the_connection_and_nothing_after_it_applies() -> None:
    for data, reason in [
        (pkt(hello(rank="zero"), step(1), step(2)), "bad_hello"),
        (pkt(struct.pack("<BH", P.HELLO, 5) + b"{oops", step(1), step(2)), "malformed"),
    ]:
        b = Bench()
        link = Link()
        assert b.applier.packet(link, data)
        assert b.invalid(reason) == 1 and b.invalid("no_hello") == 2
        assert link.state is None and b.store.ranks == {}


def test_a_peer_the_allow_lists_refuse_sends_no_hello() -> None:
    b = Bench()
    link = Link(peer_uid=666)
    link.admitted = False
    assert b.applier.packet(link, pkt(hello(), step(1)))
    assert b.invalid("peer_not_allowed") == 1 and b.invalid("no_hello") == 1
    assert b.store.ranks == {}


def test_unknown_hello_keys_and_unknown_records_are_counted_the_rest_applies() -> None:
    b = Bench()
    link = Link()
    unknown = struct.pack("<BH", 99, 0)
    assert not b.applier.packet(link, pkt(hello(future=1, other=2), unknown, step(1)))
    assert b.dropped("unknown_hello_key") == 2 and b.invalid("unknown_type") == 1
    assert b.applied("step") == 1 and link.applied == 1


def test_names_need_a_valid_name_and_room_under_the_cap() -> None:
    b = Bench()
    link = Link()
    b.applier.packet(link, pkt(hello(), P.encode_name(64, 'bad"name')))
    assert b.invalid("invalid_name") == 1 and link.names == {}
    link.names = {1000 + i: f"n{i}" for i in range(MAX_NAMES_PER_CONNECTION)}
    b.applier.packet(link, pkt(P.encode_name(64, "one_more"), P.encode_name(1000, "rebound")))
    assert b.invalid("name_cap") == 1 and link.names[1000] == "rebound" and 64 not in link.names


def test_a_track_of_an_unbound_name_is_not_applied_and_shows_in_the_gap() -> None:
    b = Bench()
    link = Link()
    totals = P.encode_totals(P.Totals(2, 2, 0, 0, 0, 0, 0))
    b.applier.packet(link, pkt(hello(), step(1), P.encode_track(99, False, 1.0, 1), totals))
    assert b.dropped("unknown_field") == 1 and b.applied("track") == 0
    assert b.invalid_total() == 0
    assert link.applied == 1 and link.gap == 1 and link.state is not None
    assert link.state.unapplied_total == 1


def test_a_record_whose_application_raises_is_counted_and_the_rest_applies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    b = Bench()
    link = Link()
    b.applier.packet(link, pkt(hello()))
    real = Store.observe_step

    def flaky(self: Store, state: object, record: P.Step, *args: object) -> None:
        if record.header.step == 2:
            raise RuntimeError("a bug")
        real(self, state, record, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Store, "observe_step", flaky)
    assert not b.applier.packet(link, pkt(step(1), step(2), step(3)))
    assert b.invalid(INTERNAL_ERROR) == 1 and b.applied("step") == 2
    assert link.state is not None and link.state.step == 3 and link.state.connected


@pytest.mark.parametrize(
    ("sent", "kept"),
    [
        ("gpu-node-07.cluster.local", "gpu-node-07.cluster.local"),
        ("gpu-nоde-07", "gpu-n_de-07"),  # a Cyrillic o: a homoglyph
        ("n\u0336o\u0336d\u0336e\u0489", "node"),  # zalgo: combining marks
        ("ｎｏｄｅ１", "node1"),  # full-width forms
        ("café-node", "cafe-node"),
        ("node 🔥🔥 x", "node_x"),
    ],
)
def test_label_values_are_normalised_and_counted(sent: str, kept: str) -> None:
    b = Bench()
    link = Link(peer_pid=7, peer_uid=1000, peer_gid=1000)
    assert not b.applier.packet(link, pkt(hello(hostname=sent, client_version=sent)))
    assert link.state is not None
    assert link.state.hostname == kept and link.state.client_version == kept
    assert set(link.state.hostname) <= LABEL_CHARS
    assert b.dropped("label_rewritten") == (0 if kept == sent else 2)
    assert b.applied("hello") == 1


def test_a_control_character_in_a_label_still_refuses_the_hello() -> None:
    b = Bench()
    link = Link(peer_uid=1000)
    assert b.applier.packet(link, pkt(hello(hostname="node\n1")))
    assert b.invalid("bad_hello") == 1 and link.state is None
    assert b.store.admission.hellos_refused == {("bad_hello", "", "1000"): 1}


def test_a_hello_is_held_to_the_namespace_and_pod_the_node_names_for_its_sender() -> None:
    """A HELLO naming no namespace gets its pod's; one naming another is refused and counted
    under the pod's own namespace (never the claimed one); the pod's name is the node's."""
    b = Bench(store_of(default_namespace="trainmon-system"))
    plain = Link(peer_pid=7, peer_uid=0, peer_namespace="team-a", peer_pod="train-0")
    assert not b.applier.packet(plain, pkt(hello(run="r"), step(1)))
    assert plain.state is not None
    assert (plain.state.namespace, plain.state.pod, plain.state.tenant) == (
        "team-a",
        "train-0",
        "team-a",
    )
    assert b.dropped("pod_rewritten") == 0
    named = Link(peer_pid=8, peer_uid=0, peer_namespace="team-a", peer_pod="train-1")
    assert not b.applier.packet(named, pkt(hello(run="r2", namespace="team-a", pod="evil")))
    assert named.state is not None and named.state.pod == "train-1"
    assert b.dropped("pod_rewritten") == 1
    liar = Link(peer_pid=9, peer_uid=0, peer_namespace="team-b", peer_pod="train-b")
    assert b.applier.packet(liar, pkt(hello(run="r", namespace="team-a"), step(2)))
    assert liar.state is None and liar.refusal == "namespace_mismatch"
    assert b.invalid("namespace_mismatch") == 1 and b.invalid("no_hello") == 1
    assert b.store.admission.hellos_refused == {("namespace_mismatch", "team-b", "0"): 1}
    assert b.store.ranks[("team-a/r", 0)].step == 1
    # Without a pod (off Kubernetes, or not found): the HELLO's namespace, keyed by uid.
    host = Link(peer_pid=10, peer_uid=0)
    assert not b.applier.packet(host, pkt(hello(run="r3", namespace="team-b")))
    assert host.state is not None and host.state.tenant == 0
