"""Rank state applies records under the store's limits, on hand-built stores (no socket, no sleep).

Every value a record carries is either kept or reported to the drop callable with a reason of
``trainmon_ingest_values_dropped_total``.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest

from trainmon_client import _protocol as P
from trainmon_exporter.ingest import DROP_REASONS
from trainmon_exporter.state.admission import (
    SERIES_PER_LAYER,
    SERIES_PER_OPERATION,
    SERIES_PER_RANK,
)
from trainmon_exporter.state.rank import WATCH_OPERATION, Operation, RankState
from trainmon_exporter.state.store import Store

from ..helpers.exporter import HELLO, store_of


class Drops(Counter[str]):
    """A drop callable that counts what it is told, by reason."""

    def __call__(self, reason: str, n: int) -> None:
        assert reason in DROP_REASONS, reason
        assert n > 0
        self[reason] += n


def attached(store: Store, **hello: Any) -> RankState:
    state = store.attach(HELLO | hello, uid=1000, pid=4242)
    assert isinstance(state, RankState), state
    return state


def head(step: int, **kw: Any) -> P.StepHeader:
    base = P.StepHeader(step, step, 100.0 + step, 0.5, 10.0 * step, 1.0 * step, 0.0, 0, 0, 0)
    return base._replace(**kw)


def step(n: int, fields: dict[int, float] | None = None, **kw: Any) -> P.Step:
    fields = fields or {}
    return P.Step(head(n, **kw), tuple(fields), tuple(fields.values()))


def test_attach_keeps_the_peer_pid_and_a_reconnect_runs_no_operation() -> None:
    store = store_of()
    s = attached(store)
    assert s.peer_pid == 4242 and s.owner_uid == 1000
    drops = Drops()
    assert store.observe_track(s, P.Track(64, True, 1.0, 2), {64: "validation"}, drops)
    assert s.ops == {"validation": Operation(1.0, 2, True)} and s.busy()
    s.disconnect(finished=False)
    again = store.attach(HELLO, uid=1000, pid=7)
    assert again is s and s.peer_pid == 7
    assert s.ops["validation"] == Operation(1.0, 2, False) and not s.busy()


def test_a_step_keeps_standard_and_custom_values_and_reports_the_rest() -> None:
    store = store_of(max_custom_metrics=2)
    s = attached(store)
    drops = Drops()
    names = {64: "a", 65: "b", 66: "c"}
    store.observe_step(
        s, step(1, {P.FIELD_LOSS: 2.0, 64: 1.0, 65: 2.0, 66: 3.0, 99: 4.0}), names, drops
    )
    assert s.values == {"loss": 2.0} and s.custom == {"a": 1.0, "b": 2.0}
    assert drops == {"custom_cap": 1, "unknown_field": 1}
    assert s.step == 1 and s.steps_total == 1 and s.tokens_total == 10.0


def test_new_custom_names_are_charged_to_the_series_budget() -> None:
    store = store_of(max_series=SERIES_PER_RANK + 1)
    s = attached(store)
    drops = Drops()
    store.observe_step(s, step(1, {64: 1.0, 65: 2.0}), {64: "a", 65: "b"}, drops)
    assert list(s.custom) == ["a"] and drops == {"series_budget": 1}
    assert store.admission.series_used == SERIES_PER_RANK + 1 == store.admission.recount_series()


def test_a_poisoned_cumulative_total_keeps_its_previous_value() -> None:
    store = store_of()
    s = attached(store)
    drops = Drops()
    store.observe_step(s, step(1), {}, drops)
    store.observe_step(s, step(2, tokens_total=math.nan, samples_total=-1.0), {}, drops)
    assert s.tokens_total == 10.0 and s.samples_total == 1.0 and s.step == 2
    assert drops == {"bad_counter": 2}
    store.observe_step(s, step(3, tokens_total=5.0, overhead_seconds_total=math.inf), {}, drops)
    assert s.tokens_total == 10.0 and s.overhead_total == 0.0  # lower without a restart: kept
    assert drops == {"bad_counter": 4}
    store.observe_step(s, step(1, steps_total=1, tokens_total=5.0), {}, drops)  # a new process
    assert s.tokens_total == 5.0 and s.steps_total == 1 and drops == {"bad_counter": 4}


def test_a_nonfinite_value_is_counted_and_becomes_an_event_at_its_step() -> None:
    store = store_of()
    s = attached(store)
    store.observe_step(s, step(7, {P.FIELD_LOSS: math.nan, 64: math.inf}), {64: "q"}, Drops())
    assert s.nonfinite == {"loss": 1, "grad_norm": 0, "lr": 0, "custom": 1}
    assert [(e.kind, e.step) for e in s.analytics.events] == [
        ("nonfinite_loss", 7),
        ("nonfinite_custom", 7),
    ]


def test_layers_are_kept_on_layer_ranks_under_the_cap_and_the_budget() -> None:
    store = store_of(max_layers=2)
    s = attached(store)
    drops = Drops()
    codes = (P.STAT_GRAD_NORM, P.STAT_UPDATE_RATIO)
    record = P.Layers(P.LayersHeader(10, 110.0, 3, 0.25), codes, (64, 65, 66, 99), (1.0, 1e-3) * 4)
    store.observe_layers(s, record, {64: "l0", 65: "l1", 66: "l2"}, drops)
    row = {P.STAT_GRAD_NORM: 1.0, P.STAT_UPDATE_RATIO: 1e-3}
    assert s.layers == {"l0": row, "l1": row}
    assert drops == {"layer_cap": 1, "unknown_field": 1}
    assert s.ops == {WATCH_OPERATION: Operation(0.25, 3, False)}
    assert (
        store.admission.series_used == SERIES_PER_RANK + 2 * SERIES_PER_LAYER + SERIES_PER_OPERATION
    )


def test_layers_of_other_ranks_are_analysed_not_kept() -> None:
    store = store_of()
    s = attached(store, rank=1, local_rank=1, world_size=2)
    drops = Drops()
    record = P.Layers(P.LayersHeader(10, 110.0, 1, 0.1), (P.STAT_GRAD_NORM,), (64, 65), (4.0, 2.0))
    store.observe_layers(s, record, {64: "l0", 65: "l1"}, drops)
    assert s.layers == {} and drops == {"layer_rank": 2}
    assert s.analytics.gain_mean == pytest.approx(2.0)


def test_an_evaluation_keeps_its_loss_and_capped_named_values() -> None:
    store = store_of(max_custom_metrics=1)
    s = attached(store)
    drops = Drops()
    record = P.Eval(30, 130.0, (P.FIELD_VAL_LOSS, 64, 65, 99), (2.5, 0.4, 0.5, 1.0))
    store.observe_eval(s, record, {64: "accuracy", 65: "f1"}, drops)
    assert s.eval_values == {"accuracy": 0.4, "val_loss": 2.5} and s.eval_step == 30
    assert drops == {"custom_cap": 1, "unknown_field": 1}
    assert s.analytics.eval_loss == 2.5 and s.analytics.eval_total == 1
    store.observe_eval(s, P.Eval(40, 140.0, (P.FIELD_LOSS,), (2.0,)), {}, drops)
    assert s.eval_values["val_loss"] == 2.0 and s.analytics.eval_total == 2


def test_evaluation_values_need_room_in_the_series_budget() -> None:
    store = store_of(max_series=SERIES_PER_RANK)
    s = attached(store)
    drops = Drops()
    store.observe_eval(s, P.Eval(1, 101.0, (64,), (0.5,)), {64: "accuracy"}, drops)
    assert s.eval_values == {} and drops == {"series_budget": 1}


def test_operations_need_a_name_room_under_the_cap_and_in_the_budget() -> None:
    store = store_of(max_operations=1, max_series=SERIES_PER_RANK + SERIES_PER_OPERATION)
    s = attached(store)
    drops = Drops()
    names = {64: "validation", 65: "profile"}
    assert not store.observe_track(s, P.Track(99, False, 1.0, 1), names, drops)
    assert store.observe_track(s, P.Track(64, False, 1.0, 1), names, drops)
    assert store.observe_track(s, P.Track(64, True, 3.0, 2), names, drops)  # the same one
    assert store.observe_track(s, P.Track(65, False, 1.0, 1), names, drops)  # applied, dropped
    assert s.ops == {"validation": Operation(3.0, 2, True)}
    assert s.ops_seconds() == 3.0
    assert drops == {"unknown_field": 1, "operation_cap": 1}
    store.max_operations = 2
    assert store.observe_track(s, P.Track(65, False, 1.0, 1), names, drops)
    assert "profile" not in s.ops and drops["series_budget"] == 1


def test_a_checkpoint_and_a_finish() -> None:
    s = attached(store_of())
    s.observe_checkpoint(P.Checkpoint(40, 140.0, 2.5))
    s.observe_checkpoint(P.Checkpoint(80, 180.0, math.nan))
    assert s.checkpoint is not None and s.checkpoint[:2] == (80, 180.0)
    assert math.isnan(s.checkpoint.seconds)
    assert s.checkpoints_total == 2
    s.finish(P.FINISH_FAILED)
    assert s.status == "failed" and s.crashes == 1
    assert [e.kind for e in s.analytics.events] == ["failed"]


def test_totals_count_what_a_connection_sent_and_this_exporter_never_applied() -> None:
    s = attached(store_of())
    gap = s.observe_totals(P.Totals(5, 50, 1, 2, 3, 4, 6), applied=5, gap=0)
    assert gap == 0 and s.unapplied_total == 0
    assert (s.sent_total, s.dropped_disconnected, s.dropped_backpressure) == (50, 1, 2)
    assert (s.dropped_encode_error, s.dropped_in_flight, s.refused_values) == (3, 4, 6)
    gap = s.observe_totals(P.Totals(9, 54, 1, 2, 3, 4, 6), applied=7, gap=gap)
    assert gap == 2 and s.unapplied_total == 2
    gap = s.observe_totals(P.Totals(10, 55, 1, 2, 3, 4, 6), applied=8, gap=gap)
    assert gap == 2 and s.unapplied_total == 2  # the same two, not counted again


def test_how_a_connection_ends() -> None:
    store = store_of()
    crashed, finished, idle, shutdown = (
        attached(store, rank=r, local_rank=r, world_size=4) for r in range(4)
    )
    crashed.disconnect(finished=False)
    finished.finish(P.FINISH_OK)
    finished.disconnect(finished=True)
    idle.closed_by_exporter(idle=True)
    shutdown.closed_by_exporter(idle=False)
    assert [s.connected for s in (crashed, finished, idle, shutdown)] == [False] * 4
    assert [s.status for s in (crashed, finished, idle, shutdown)] == [
        "crashed",
        "finished",
        "running",
        "running",
    ]
    assert [s.crashes for s in (crashed, finished, idle, shutdown)] == [1, 0, 0, 0]
    assert idle.disconnected_mono is not None and shutdown.disconnected_mono is None


def test_a_step_that_goes_back_is_a_rollback_and_a_restart() -> None:
    """A rank that steps back every 10 steps: each time counted, as a rollback and a restart;
    a new process resuming the rank (its totals start over) is a restart only."""
    store = store_of()
    s = attached(store)
    n = 0
    for cycle in range(5):
        for i in range(10):
            n += 1
            s.observe_step(step(100 + i, steps_total=n, tokens_total=10.0 * n), {}, 30.0)
        assert s.rollbacks == cycle and s.analytics.restarts == cycle
    s.observe_step(step(200, steps_total=1), {}, 30.0)  # a new process: its totals start over
    assert s.rollbacks == 4 and s.analytics.restarts == 5


def test_values_under_an_unknown_stat_code_are_dropped_not_stored() -> None:
    store = store_of()
    s = attached(store)
    drops = Drops()
    codes = (P.STAT_GRAD_NORM, 200, P.QUANTILE_CODE0 + 6, 9)
    record = P.Layers(
        P.LayersHeader(10, 110.0, 1, 0.1), codes, (64, 65, 99), (1.0, 7.0, 3.0, 8.0) * 3
    )
    store.observe_layers(s, record, {64: "l0", 65: "l1"}, drops)
    row = {P.STAT_GRAD_NORM: 1.0, P.QUANTILE_CODE0 + 6: 3.0}
    assert s.layers == {"l0": row, "l1": row}
    assert drops == {"unknown_stat": 4, "unknown_field": 1}  # 2 codes x 2 named rows
