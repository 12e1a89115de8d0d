"""Property-based tests (hypothesis): no byte string can make the decoder raise anything but
``ProtocolError``, and no packet can make ingest raise, crash a rank or break a scrape.

Bounded to a few seconds; ``benchmarks/fuzz.py`` runs the same properties with many more
examples.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainmon_client import _protocol as P
from trainmon_exporter import derive

from ..helpers.fuzzing import (
    Target,
    decode_all,
    floats,
    layer_rows,
    new_state,
    packets,
    raw_packets,
    step_heads_and_fields,
)

BOUNDED = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,  # the same examples every run: the suite never flakes on a new find
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    yield Target()


@BOUNDED
@given(raw_packets)
def test_the_decoder_raises_only_protocol_errors(packet: bytes) -> None:
    decode_all(packet)


@BOUNDED
@given(st.data())
def test_no_packet_raises_in_ingest_or_scrape(target: Target, data: st.DataObject) -> None:
    pkts = data.draw(packets(target.next_run()))
    target.apply(pkts)  # handle_packet, close, scrape: any exception fails the example
    assert target.internal_errors() == 0


@BOUNDED
@given(st.lists(raw_packets, min_size=1, max_size=4))
def test_no_raw_packet_raises_in_ingest(target: Target, pkts: list[bytes]) -> None:
    target.apply(pkts)
    assert target.internal_errors() == 0


@BOUNDED
@given(st.lists(st.one_of(step_heads_and_fields, layer_rows, floats), min_size=1, max_size=60))
def test_record_application_never_raises(events: list[Any]) -> None:
    """Steps, watch checks and evaluations in any order, straight into a rank's state."""
    state = new_state()
    for ev in events:
        if isinstance(ev, float):
            state.analytics.observe_eval(ev)
        elif isinstance(ev, list):
            rows = [(f"l{i}", row) for i, row in enumerate(ev)]
            state.analytics.observe_layers(rows)
        else:
            head, fields = ev
            ids = tuple(f for f, _ in fields)
            values = tuple(v for _, v in fields)
            state.observe_step(P.Step(P.StepHeader(*head), ids, values), {}, 60.0)
    derive.rates(state, 1e9, 60.0)
    a = state.analytics
    a.ema_slope(), a.plateau(), a.throughput_ratio(), a.eval_gap(), a.eval_improvement()
    a.check_memory(), a.check_throughput(), a.check_hang(1e308, False)
