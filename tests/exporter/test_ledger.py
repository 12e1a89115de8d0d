"""What outlives a rank's live state: the ledger of departed ranks and the state file.

On hand-built stores with real clocks (the accounting maps the client's wall clock onto the
exporter's monotonic clock): a rank whose state expired comes back and adopts its accounting;
another uid never does; the ledger is bounded; the state file written by one store is read
back by another, and a corrupt, foreign, future or unsafe file is refused with its reason.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from trainmon_client import _protocol as P
from trainmon_exporter.analytics.goodput import KINDS
from trainmon_exporter.apply import checked_hello
from trainmon_exporter.collectors import CollectorContext
from trainmon_exporter.collectors.health import HealthCollector
from trainmon_exporter.settings import Settings
from trainmon_exporter.state import statefile
from trainmon_exporter.state.ledger import Ledger
from trainmon_exporter.state.rank import RankState
from trainmon_exporter.state.statefile import Keeper, StateFileError
from trainmon_exporter.state.store import Store

from ..helpers.exporter import HELLO, store_of


def ignore(reason: str, n: int) -> None:
    pass


def attach(store: Store, uid: int = 1000, **hello: Any) -> RankState:
    state = store.attach(HELLO | {"started_at": time.time()} | hello, uid=uid, pid=4242)
    assert isinstance(state, RankState), state
    return state


def log(store: Store, state: RankState, step: int, steps: int, data: float = 0.001) -> None:
    head = P.StepHeader(step, steps, time.time(), 0.01, 0.0, 0.0, 0.0, 0, 0, 0)
    store.observe_step(state, P.Step(head, (P.FIELD_DATA_TIME,), (data,)), {}, ignore)


def run_steps(store: Store, state: RankState, first: int, last: int) -> None:
    for n in range(first, last + 1):
        time.sleep(0.005)
        log(store, state, n, n - first + 1)


def counters(g: Any) -> dict[str, float]:
    return {"productive": g.productive, **g.badput}


def test_a_rank_back_after_its_ttl_adopts_its_accounting_and_places_the_recovery() -> None:
    store = store_of(ttl_s=1)
    s = attach(store)
    run_steps(store, s, 1, 20)
    s.observe_checkpoint(P.Checkpoint(10, time.time(), 0.001))
    s.disconnect(finished=False)  # killed
    g = s.goodput
    assert g.at_risk > 0 and g.uncheckpointed == 0
    before = counters(g)
    assert store.expire(time.monotonic() + 2) == 1 and not store.ranks
    (departed,) = list(store.ledger)
    assert departed.goodput is g and g.at_risk == 0  # settled: what it held is wasted
    assert g.badput["wasted_progress"] > before["wasted_progress"]
    # its goodput series are still exported, with nothing else of the rank
    collector = HealthCollector(CollectorContext(Settings(), store))
    fams = {f.name: f for f in collector.collect()}
    assert [s.labels["rank"] for s in fams["trainmon_train_productive_seconds"].samples] == ["0"]
    assert len(fams["trainmon_train_badput_seconds"].samples) == len(KINDS)
    assert not fams["trainmon_train_loss_ema"].samples
    time.sleep(0.05)
    back = attach(store, pid=5, started_at=time.time())  # a new process, long after
    assert back.goodput is g and not store.ledger.records
    assert g.badput["recovery"] >= 0.04
    assert all(v >= before[k] for k, v in counters(g).items())
    run_steps(store, back, 11, 15)
    assert back.steps_total == 5 and g.phase == "running"


def test_another_uid_never_adopts_a_departed_rank() -> None:
    store = store_of(ttl_s=1)
    s = attach(store)
    run_steps(store, s, 1, 5)
    s.disconnect(finished=False)
    store.expire(time.monotonic() + 2)
    store.expire(time.monotonic() + 2)  # the owner record lapses with the TTL too
    assert len(store.ledger) == 1
    other = attach(store, uid=2000)
    assert other.goodput.productive == 0 and other.goodput.badput["recovery"] == 0
    assert not store.ledger.records  # the old run's accounting is not this run's


def test_a_finished_rank_is_not_kept_and_the_ledger_is_bounded() -> None:
    store = store_of(ttl_s=1)
    s = attach(store)
    run_steps(store, s, 1, 3)
    s.finish(P.FINISH_OK)
    s.disconnect(finished=True)
    store.expire(time.monotonic() + 2)
    assert not store.ledger.records
    ledger = Ledger(max_records=2, retention_s=10.0)
    for rank in range(3):
        r = attach(store_of(), rank=rank, world_size=3)
        r.disconnect(finished=False)
        ledger.keep(r, now=100.0 + rank)
    assert [d.rank for d in ledger] == [1, 2] and ledger.evicted == 1
    assert ledger.expire(now=111.5) == 1 and [d.rank for d in ledger] == [2]


def keeper(store: Store, path: Path) -> Keeper:
    return Keeper(store, path, checked_hello, "test")


def test_the_state_file_carries_the_accounting_across_an_exporter_restart(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.json"
    old = store_of(ttl_s=60)
    s = attach(old)
    run_steps(old, s, 1, 10)
    s.observe_checkpoint(P.Checkpoint(5, time.time(), 0.001))
    crashed = attach(old, rank=1, world_size=2)
    run_steps(old, crashed, 1, 4)
    crashed.disconnect(finished=False)
    assert keeper(old, path).save()
    assert path.stat().st_mode & 0o777 == 0o600
    want = {k: counters(r.goodput) for k, r in old.ranks.items()}
    held = s.goodput.uncheckpointed

    new = store_of(ttl_s=60)
    keeper(new, path).load()
    assert new.file_stats.restored_ranks == 2 and not new.file_stats.refused
    for key, r in new.ranks.items():
        assert not r.connected
        assert counters(r.goodput) == pytest.approx(want[key])
    r0 = new.ranks[s.key]
    assert r0.goodput.phase == "detached" and r0.goodput.uncheckpointed == pytest.approx(held)
    assert new.ranks[crashed.key].goodput.at_risk > 0
    # The same process reconnects: the time since its last step is its steps' time.
    time.sleep(0.05)
    again = new.attach(HELLO | {"started_at": s.started_at}, uid=1000, pid=4242)
    assert again is r0 and r0.goodput.phase == "running"
    log(new, r0, 12, 12)
    assert r0.goodput.badput["recovery"] == 0 and r0.goodput.badput["other"] == 0
    assert r0.goodput.uncheckpointed >= held + 0.04
    # Another uid cannot take the run over after the restart.
    assert new.attach(HELLO | {"rank": 1, "world_size": 2}, uid=2000, pid=1) == "not_owner"


@pytest.mark.parametrize(
    ("content", "mode", "reason"),
    [
        (b"{not json", 0o600, "corrupt"),
        (json.dumps({"hello": 1}).encode(), 0o600, "foreign"),
        (json.dumps({"format": statefile.FORMAT, "version": 99}).encode(), 0o600, "future_version"),
        (json.dumps({"format": statefile.FORMAT, "version": 1}).encode(), 0o666, "unsafe"),
    ],
)
def test_a_state_file_that_is_not_ours_is_refused_and_set_aside(
    tmp_path: Path, content: bytes, mode: int, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(content)
    path.chmod(mode)
    with pytest.raises(StateFileError) as err:
        statefile.read(path)
    assert err.value.reason == reason
    store = store_of()
    keeper(store, path).load()  # never raises
    assert store.file_stats.refused == {reason: 1} and not store.ranks
    assert reason in caplog.text or str(path) in caplog.text
    # The evidence is kept: a refused file is moved aside (one another user may write stays).
    assert (tmp_path / "state.json.refused").exists() == (reason != "unsafe")
    if reason != "unsafe":
        assert keeper(store, path).save() and statefile.read(path) is not None


def test_a_symbolic_link_is_never_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    (tmp_path / "state.json").symlink_to(target)
    with pytest.raises(StateFileError) as err:
        statefile.read(tmp_path / "state.json")
    assert err.value.reason == "unsafe"


def test_a_forged_row_is_refused_and_the_others_restored(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    old = store_of()
    for rank in (0, 1):
        run_steps(old, attach(old, rank=rank, world_size=2), 1, 3)
    assert keeper(old, path).save()
    doc = json.loads(path.read_text())
    doc["ranks"][0]["hello"]["run"] = "bad run id\n"
    doc["ranks"].append({"hello": {}})
    path.write_text(json.dumps(doc))
    os.chmod(path, 0o600)
    new = store_of()
    keeper(new, path).load()
    assert new.file_stats.refused == {"bad_row": 2}
    assert [r.rank for r in new.ranks.values()] == [1]


def test_a_rank_is_restored_once_whatever_the_file_says(tmp_path: Path) -> None:
    """A forged file with the same rank live and departed (or twice) restores it once, so its
    series are exported once."""
    path = tmp_path / "state.json"
    old = store_of()
    run_steps(old, attach(old), 1, 3)
    assert keeper(old, path).save()
    doc = json.loads(path.read_text())
    row = doc["ranks"][0]
    doc["ranks"].append(row)
    doc["departed"].append({**row, "departed_ago": 5.0})
    path.write_text(json.dumps(doc))
    new = store_of()
    keeper(new, path).load()
    assert len(new.ranks) == 1 and len(new.ledger) == 0


def test_a_state_file_is_read_no_further_than_the_store_holds(tmp_path: Path) -> None:
    """Rows past max_ranks (of live ranks, and of departed ones) are refused unread."""
    path = tmp_path / "state.json"
    old = store_of()
    run_steps(old, attach(old), 1, 3)
    assert keeper(old, path).save()
    doc = json.loads(path.read_text())
    row = doc["ranks"][0]
    rows = []
    for rank in range(12):
        r = json.loads(json.dumps(row))
        r["hello"].update(rank=rank, world_size=12)
        rows.append(r)
    doc["ranks"] = rows
    path.write_text(json.dumps(doc))
    new = store_of()  # max_ranks 8
    keeper(new, path).load()
    assert new.file_stats.refused == {"bad_row": 4}
    assert len(new.ranks) == 8
