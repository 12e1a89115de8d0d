"""Tenancy on a shared node: one uid can neither erase, take over, squat nor starve another's run.

Store-level tests build the store by hand (ages are set on the states, no sleeping); the
behaviour that depends on who connects runs real processes of other uids against a real
exporter socket (the pattern of test_trust.py).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from trainmon_exporter.settings import Settings
from trainmon_exporter.state.admission import EVICTION_ORDER, MAX_REFUSED_TENANTS, SERIES_PER_RANK
from trainmon_exporter.state.rank import RankState, Tenant
from trainmon_exporter.state.store import Store

from ..conftest import InProcessExporter, sample, wait_for
from ..helpers.exporter import HELLO, invalid, store_of
from ..helpers.uids import (
    ATTACKER,
    ATTACKER_GID,
    OWNER,
    OWNER_GID,
    User,
    crash,
    logs_three,
    needs_root,
    owner_resumes,
    run_as,
    shared_exporter,
    start_victim,
    still_crashed,
)

REFUSED = "trainmon_ingest_hellos_refused_total"


def _h(run: str, rank: int = 0) -> dict[str, Any]:
    return HELLO | {"run": run, "rank": rank, "local_rank": rank, "world_size": 8}


def _age(store: Store, run: str, seconds: float, rank: int = 0) -> None:
    """Make ``(run, rank)`` look as if it left ``seconds`` ago."""
    s = store.ranks[(run, rank)]
    assert s.left_mono is not None and s.disconnected_mono is not None
    s.left_mono -= seconds
    s.disconnected_mono -= seconds


def _check_indexes(store: Store) -> None:
    """Every index the O(1) admission reads agrees with a full scan of the ranks."""
    runs: dict[str, set[int]] = {}
    per_tenant: dict[Tenant, int] = {}
    for (run, rank), s in store.ranks.items():
        runs.setdefault(run, set()).add(rank)
        per_tenant[s.tenant] = per_tenant.get(s.tenant, 0) + 1
    assert {r: set(m) for r, m in store._runs.items()} == runs
    assert store.admission.tenant_ranks == per_tenant
    gone = {k for k, s in store.ranks.items() if not s.connected}
    queued = [k for q in store.admission.gone.values() for k in q]
    assert sorted(queued) == sorted(gone)
    for tenant, queues in store.admission.gone_tenant.items():
        for bucket, q in queues.items():
            for k, s in q.items():
                assert s.tenant == tenant and k in store.admission.gone[bucket]
                times = [x.left_mono for x in q.values()]
                assert times == sorted(times)  # type: ignore[type-var]
    series = store.admission.series_used
    assert store.admission.recount_series() == series


# --------------------------------------------------------------------------- the store


def test_a_crashed_rank_stays_for_its_retention_whoever_connects() -> None:
    store = store_of(max_ranks=2, retention_s=60, ttl_s=600)
    victim = store.attach(_h("victim"), uid=1000)
    assert not isinstance(victim, str)
    victim.disconnect(finished=False)
    assert not isinstance(store.attach(_h("a0"), uid=2000), str)
    # At the cap, the only disconnected rank is within its retention: refused, not evicted.
    for i in range(1, 50):
        assert store.attach(_h(f"a{i}"), uid=2000) == "too_many_ranks"
    assert ("victim", 0) in store.ranks and store.admission.evicted["crashed"] == 0
    # Its own uid cannot evict it sooner either.
    assert store.attach(_h("mine2"), uid=1000) == "too_many_ranks"
    _age(store, "victim", 61)
    b = store.attach(_h("late"), uid=2000)
    assert not isinstance(b, str) and ("victim", 0) not in store.ranks
    assert store.admission.evicted["crashed"] == 1
    assert store.attach(_h("victim"), uid=2000) == "not_owner"  # its owner record holds
    _check_indexes(store)


def test_a_uid_at_its_quota_evicts_only_its_own_ranks() -> None:
    store = store_of(max_ranks=8, max_ranks_per_uid=2, retention_s=60)
    others = store.attach(_h("other"), uid=1000)
    assert not isinstance(others, str)
    others.disconnect(finished=True)
    _age(store, "other", 600)  # long past retention, and first in eviction order
    mine = [store.attach(_h(f"m{i}"), uid=2000) for i in range(2)]
    for s in mine:
        assert not isinstance(s, str)
    assert store.attach(_h("m2"), uid=2000) == "uid_rank_quota"  # all its own are connected
    mine[0].disconnect(finished=False)  # type: ignore[union-attr]
    assert store.attach(_h("m2"), uid=2000) == "uid_rank_quota"  # within retention
    _age(store, "m0", 61)
    assert not isinstance(store.attach(_h("m2"), uid=2000), str)
    assert ("m0", 0) not in store.ranks and ("other", 0) in store.ranks
    assert store.admission.tenant_ranks == {1000: 1, 2000: 2}
    # Another uid is not held back by the first one's quota.
    assert not isinstance(store.attach(_h("x"), uid=3000), str)
    _check_indexes(store)


def test_a_uid_cannot_take_the_series_budget_of_the_others() -> None:
    share = 4 * SERIES_PER_RANK
    store = store_of(max_ranks=64, max_series=20 * SERIES_PER_RANK, max_series_per_uid=share)
    idle = [store.attach(_h(f"idle{i}"), uid=2000) for i in range(10)]
    assert [isinstance(s, str) for s in idle] == [False] * 4 + [True] * 6
    assert set(idle[4:]) == {"uid_series_quota"}
    assert store.admission.tenant_series[2000] == share
    for uid in (1000, 1001, 1002):
        assert not isinstance(store.attach(_h(f"t{uid}"), uid=uid), str)
    # Values past the uid's share are dropped; other uids still have room.
    s = store.ranks[("idle0", 0)]
    drops: list[tuple[str, int]] = []
    s.custom["extra"] = 1.0
    store._charge(s, s.custom, 1, 1, lambda r, n: drops.append((r, n)))
    assert drops == [("series_budget", 1)] and "extra" not in s.custom
    _check_indexes(store)


def test_ownership_cannot_be_flushed_by_another_uids_churn() -> None:
    store = store_of(max_ranks=2, max_ranks_per_uid=2, retention_s=0, ttl_s=600)
    v = store.attach(_h("victim"), uid=1000)
    assert not isinstance(v, str)
    v.disconnect(finished=False)
    assert not isinstance(store.attach(_h("held"), uid=2000), str)  # stays connected
    first = store.attach(_h("churn0"), uid=2000)  # evicts the victim's rank (retention 0)
    assert not isinstance(first, str) and ("victim", 0) not in store.ranks
    first.disconnect(finished=False)
    for i in range(1, 5000):  # each evicts the attacker's previous one
        s = store.attach(_h(f"churn{i}"), uid=2000)
        assert not isinstance(s, str), (i, s)
        s.disconnect(finished=False)
    assert store.admission.evicted["crashed"] == 5000
    assert store.owners["victim"][0] == 1000
    assert store.attach(_h("victim"), uid=2000) == "not_owner"
    assert len(store._owner_runs[2000]) == store.max_owner_records == 8
    assert len(store.owners) == store.max_owner_records + 1
    back = store.attach(_h("victim"), uid=1000)
    assert not isinstance(back, str) and back.owner_uid == 1000
    _check_indexes(store)


def test_refused_hellos_are_counted_by_uid_with_a_bounded_label() -> None:
    store = store_of()
    for uid in range(MAX_REFUSED_TENANTS + 10):
        store.admission.count_refused_hello("not_owner", 5000 + uid)
    store.admission.count_refused_hello("not_owner", 5000)
    store.admission.count_refused_hello("too_many_ranks", 5000)
    store.admission.count_refused_hello("bad_hello", None)
    uids = {u for _, _, u in store.admission.hellos_refused}
    assert len(uids) == MAX_REFUSED_TENANTS + 2  # the first 64, other, unknown
    assert store.admission.hellos_refused[("not_owner", "", "5000")] == 2
    assert store.admission.hellos_refused[("too_many_ranks", "", "5000")] == 1
    assert store.admission.hellos_refused[("not_owner", "", "other")] == 10
    assert store.admission.hellos_refused[("bad_hello", "", "unknown")] == 1


def test_admission_indexes_stay_consistent() -> None:
    """Random attaches, disconnects, evictions and expiries; the indexes match a full scan."""
    rnd = random.Random(7)
    store = store_of(max_ranks=16, max_ranks_per_uid=6, retention_s=5, ttl_s=50)
    live: list[Any] = []
    outcomes: set[str] = set()
    for _ in range(3000):
        op = rnd.random()
        if op < 0.6:
            uid = rnd.choice((1, 2, 3, None))
            got = store.attach(_h(f"r{rnd.randrange(40)}", rnd.randrange(3)), uid=uid)
            outcomes.add(got if isinstance(got, str) else "ok")
            if not isinstance(got, str):
                live.append(got)
                if rnd.random() < 0.5:
                    _step(got)
        elif op < 0.75 and live:
            s = live.pop(rnd.randrange(len(live)))
            if rnd.random() < 0.2:
                s.closed_by_exporter(idle=True)
            else:
                s.disconnect(finished=rnd.random() < 0.5)
        elif op < 0.95:
            for s in list(store.ranks.values()):
                if not s.connected:  # time passes: every rank that left, left 3 s earlier
                    assert s.left_mono is not None and s.disconnected_mono is not None
                    s.left_mono -= 3
                    s.disconnected_mono -= 3
        else:
            store.expire()
        _check_indexes(store)
    assert {"ok", "not_owner", "uid_rank_quota", "too_many_ranks"} <= outcomes
    assert sum(store.admission.evicted[b] for b in EVICTION_ORDER) > 0
    assert store.admission.evicted["idle"] > 0 and store.admission.evicted["live"] > 0


def test_the_default_limits_agree() -> None:
    """max_ranks can be reached under max_series, a uid's quota under its share, four users
    fit at their quotas, and a crashed rank outlives two 15 s scrapes."""
    s = Settings()
    assert s.max_ranks * SERIES_PER_RANK <= s.max_series
    assert s.max_ranks_per_uid * SERIES_PER_RANK <= s.max_series_per_uid
    assert 4 * s.max_ranks_per_uid <= s.max_ranks
    assert 4 * s.max_series_per_uid <= s.max_series
    assert s.max_ranks <= s.ingest_max_connections
    assert 2 * 15 <= s.rank_retention_seconds <= s.series_ttl_seconds


# --------------------------------------------------------------------------- fair shares


def _squat(store: Store, uids: range | tuple[int, ...], each: int) -> dict[int, list[RankState]]:
    """``each`` HELLO-only ranks (connected, never stepping) of every uid in ``uids``."""
    held: dict[int, list[RankState]] = {}
    for uid in uids:
        for i in range(each):
            s = store.attach(_h(f"squat{uid}-{i}"), uid=uid)
            assert not isinstance(s, str), (uid, i, s)
            held.setdefault(uid, []).append(s)
    return held


def _step(state: RankState) -> None:
    """Make ``state`` a rank that has stepped since it connected."""
    state.last_step_mono = time.monotonic()


def test_a_tenant_holding_nothing_gets_in_when_four_uids_squat_every_slot() -> None:
    """Four uids at their quota (a quarter each) hold every slot with HELLO-only ranks: a
    fifth uid is admitted, up to its fair share, each time from the largest holder's ranks that
    never stepped; the squatters cannot take the slots back."""
    store = store_of(max_ranks=16, max_ranks_per_uid=4, retention_s=60)
    squat = _squat(store, range(2001, 2005), 4)
    assert len(store.ranks) == 16
    first = store.attach(_h("trainer0"), uid=1000)
    assert not isinstance(first, str)
    taken = [s for ranks in squat.values() for s in ranks if s.revoked]
    assert len(taken) == 1 and taken[0].revoked == "evicted" and taken[0].key not in store.ranks
    assert store.admission.evicted["idle"] == 1 and store.admission.evicted["live"] == 0
    # Five tenants share 16 slots: 3.2 each. The newcomer reaches 3, and no more.
    outcomes = [store.attach(_h(f"trainer{i}"), uid=1000) for i in range(1, 4)]
    assert [isinstance(o, str) for o in outcomes] == [False, False, True]
    assert outcomes[-1] == "too_many_ranks"
    assert store.admission.tenant_ranks[1000] == 3
    assert all(n >= 3 for n in store.admission.tenant_ranks.values())
    # A squatter above its fair share cannot take a slot back, from anyone.
    assert store.attach(_h("again"), uid=2001) in ("too_many_ranks", "uid_rank_quota")
    assert store.admission.tenant_ranks[1000] == 3
    # The reclaimed run id stays its owner's until the TTL.
    assert store.attach(_h(taken[0].run), uid=1000) == "not_owner"
    _check_indexes(store)


def test_ranks_that_never_stepped_go_before_live_ones_and_the_largest_holders_first() -> None:
    store = store_of(max_ranks=12, retention_s=60)
    big = _squat(store, (2001,), 7)[2001]
    small = _squat(store, (2002,), 5)[2002]
    for s in big:
        _step(s)  # the largest holder's ranks all step
    _step(small[0])
    # fair: 12 / 3 = 4. uid 2002 (5) is above it too, and has ranks that never stepped:
    # those go first, however large the live holder.
    assert not isinstance(store.attach(_h("new0"), uid=1000), str)
    assert [s.revoked for s in small] == [None, "evicted", None, None, None]
    assert store.admission.evicted == store.admission.evicted | {"idle": 1, "live": 0}
    for s in small[2:]:
        _step(s)
    # Nothing idle is left above the fair share: the largest holder's newest live rank goes.
    assert not isinstance(store.attach(_h("new1"), uid=1000), str)
    assert big[-1].revoked == "evicted" and all(s.revoked is None for s in big[:-1])
    assert store.admission.evicted["live"] == 1
    _check_indexes(store)


def test_a_crashed_rank_within_its_retention_is_never_taken_for_a_fair_share() -> None:
    store = store_of(max_ranks=4, retention_s=60, ttl_s=600)
    for s in _squat(store, (2001,), 4)[2001]:
        s.disconnect(finished=False)
    assert store.attach(_h("new"), uid=1000) == "too_many_ranks"
    assert len(store.ranks) == 4 and store.admission.evicted["crashed"] == 0
    _age(store, "squat2001-0", 61)
    assert not isinstance(store.attach(_h("new"), uid=1000), str)
    assert store.admission.evicted["crashed"] == 1


def test_a_tenant_below_its_share_of_the_series_budget_takes_series_from_the_largest() -> None:
    """Ranks are free but the series budget is spent by two uids' custom metrics: a third
    uid's rank is admitted by taking one of the largest series holder's ranks."""
    per_rank = SERIES_PER_RANK + 80
    store = store_of(max_ranks=64, max_series=10 * per_rank, max_custom_metrics=100)
    held = _squat(store, (2001, 2002), 5)
    for uid, ranks in held.items():
        for s in ranks:
            _step(s)
            s.custom.update({f"m{k}": 1.0 for k in range(80 if uid == 2001 else 60)})
            store._charge(s, s.custom, len(s.custom), 1, lambda r, n: None)
    assert store.admission.series_used == 5 * per_rank + 5 * (SERIES_PER_RANK + 60)
    # 2002 holds less than half the budget but the budget is nearly spent.
    assert not isinstance(store.attach(_h("new"), uid=1000), str)
    assert [s.revoked for s in held[2001]] == [None] * 4 + ["evicted"]
    assert all(s.revoked is None for s in held[2002])
    assert store.admission.tenant_series[1000] == SERIES_PER_RANK
    _check_indexes(store)


def test_holdings_are_labelled_by_tenant_the_largest_first_the_rest_summed() -> None:
    store = store_of(max_ranks=64, max_ranks_per_uid=64)
    _squat(store, (2001,), 5)
    _squat(store, (2002,), 3)
    _squat(store, (2003, 2004), 1)
    got = store.attach(_h("t") | {"namespace": "team-a"}, uid=0, peer_namespace="team-a")
    assert not isinstance(got, str) and got.tenant == "team-a"
    rows = list(store.admission.holdings(3))
    assert rows == [
        ("", "2001", 5, 5 * SERIES_PER_RANK),
        ("", "2002", 3, 3 * SERIES_PER_RANK),
        rows[2],
        ("", "other", 2, 2 * SERIES_PER_RANK),
    ]
    assert rows[2][2] == 1 and rows[2][:2] in (("", "2003"), ("", "2004"), ("team-a", ""))


# --------------------------------------------------------------------------- real uids

# Another uid opening short connections under fresh run ids as fast as it can, then trying
# the victim's run.
CHURN = """
import socket
def hello(run):
    return P.packet_header() + P.encode_hello({
        "run": run, "rank": 0, "local_rank": 0, "world_size": 1, "hostname": "evil",
        "pid": os.getpid(), "client_version": "x", "gpu_uuid": "GPU-evil", "started_at": 1.0,
        "flops_per_token": None, "dtype": "bf16"})
for i in range(COUNT):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(SOCK)
    s.send(hello(f"churn{i}"))
    s.close()
print("done", flush=True)
"""

# Another uid holding connections that only sent HELLO.
HOG = """
import socket
socks = []
for i in range(COUNT):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(SOCK)
    s.send(P.packet_header() + P.encode_hello({"run": f"hog{i}", "rank": 0, "local_rank": 0,
        "world_size": 1}))
    socks.append(s)
print("holding", flush=True)
input()
"""

# The victim, live: three steps, then three more on its stdin.
LIVE = logs_three(then="for i in range(4, 7): r.log(i, loss=1.5, tokens=100)\nr.finish()")

PREEMPT = """
r = init("victim")
for i in range(1, 20):
    r.log(i, loss=float("nan"), grad_norm=float("inf"))
r.finish()
"""


def _refused(ex: InProcessExporter, reason: str, uid: int) -> float:
    return sample(ex.metrics(), REFUSED, reason=reason, uid=str(uid)) or 0.0


@needs_root
def test_another_uids_churn_neither_erases_nor_takes_over_a_crash(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    """At the rank cap, 300 short connections of another uid: the victim's crashed rank stays
    exported (retention), the attacker is refused at its own quota, counted by its uid, and
    the victim's restarted trainer resumes its run."""
    ex = shared_exporter(make_exporter, socket_mode="0666", max_ranks=8, max_ranks_per_uid=4)
    crash(ex, start_victim(ex))
    out = run_as(ex.socket, ATTACKER, ATTACKER_GID, CHURN.replace("COUNT", "300"))
    assert out.strip() == "done"
    wait_for(lambda: _refused(ex, "uid_rank_quota", ATTACKER) == 300 - 4, timeout=30)
    run_as(ex.socket, ATTACKER, ATTACKER_GID, 'r = init("victim"); r.log(9, loss=0.0)')
    wait_for(lambda: _refused(ex, "not_owner", ATTACKER) == 1)
    still_crashed(ex)
    m = ex.metrics()
    assert sample(m, "trainmon_run_up", run="victim", rank="0") == 0
    evicted = "trainmon_exporter_ranks_evicted_total"
    assert sum(sample(m, evicted, status=b) or 0 for b in EVICTION_ORDER) == 0
    assert _refused(ex, "uid_rank_quota", OWNER) == 0
    owner_resumes(ex)


@needs_root
def test_idle_hellos_of_one_uid_do_not_starve_another(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    """One uid holds idle HELLO-only connections: past its quota it is refused and counted
    by uid; a trainer of another uid is admitted and every step applied."""
    ex = shared_exporter(make_exporter, socket_mode="0666", max_ranks=8, max_ranks_per_uid=4)
    hog = User(ex.socket, ATTACKER, ATTACKER_GID, HOG.replace("COUNT", "12"))
    try:
        assert hog.proc.stdout is not None and hog.proc.stdout.readline().strip() == "holding"
        wait_for(lambda: _refused(ex, "uid_rank_quota", ATTACKER) == 8)
        run_as(
            ex.socket,
            OWNER,
            OWNER_GID,
            'r = init("fair")\nfor i in range(1, 11): r.log(i, loss=1.0)\nr.finish()',
        )
        r = wait_for(lambda: (k := ex.rank("fair", 0)) and k["status"] == "finished" and k)
        assert r["step"] == 10
        assert invalid(ex, "uid_rank_quota") == 8 and invalid(ex, "too_many_ranks") == 0
        assert sample(ex.metrics(), REFUSED, reason="uid_rank_quota", uid=str(OWNER)) is None
    finally:
        hog.say()
        hog.wait()


@needs_root
def test_another_uid_cannot_preempt_a_live_rank(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    """A HELLO of another uid for a connected (run, rank) is refused and counted by uid;
    the live trainer keeps its connection and every step."""
    ex = shared_exporter(make_exporter, socket_mode="0666")
    victim = User(ex.socket, OWNER, OWNER_GID, LIVE)
    assert victim.proc.stdout is not None and victim.proc.stdout.readline().strip() == "logged"
    wait_for(lambda: (k := ex.rank("victim", 0)) and k["step"] == 3)
    run_as(ex.socket, ATTACKER, ATTACKER_GID, PREEMPT)
    wait_for(lambda: _refused(ex, "not_owner", ATTACKER) == 1)
    victim.say()
    rc, _, err = victim.wait()
    assert rc == 0, err
    r = wait_for(lambda: (k := ex.rank("victim", 0)) and k["status"] == "finished" and k)
    assert (r["step"], r["values"]["loss"]) == (6, 1.5)
    m = ex.metrics()
    for field in ("loss", "grad_norm"):
        nonfinite = "trainmon_train_nonfinite_values_total"
        assert sample(m, nonfinite, run="victim", rank="0", field=field) == 0
    assert sample(m, "trainmon_ingest_messages_unapplied_total", run="victim", rank="0") == 0
    assert ex.runs()["runs"][0]["owner_uid"] == OWNER


@needs_root
def test_a_namespace_claimed_by_another_uid_gives_it_no_way_into_that_namespaces_run(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    """Real processes of two uids on a node DaemonSet's exporter: each team's run "shared" is
    its own; the other uid claiming team-a's namespace is refused, counted by its uid, and
    team-a's crashed rank stays as it was."""
    ex = shared_exporter(make_exporter, socket_mode="0666", default_namespace="trainmon-system")
    in_team_a = 'os.environ.update(POD_NAMESPACE="team-a", POD_NAME="train-0")'
    victim = User(ex.socket, OWNER, OWNER_GID, in_team_a + logs_three("shared"))
    assert victim.proc.stdout is not None and victim.proc.stdout.readline().strip() == "logged"
    team_a = {"namespace": "team-a", "run": "shared", "rank": "0"}
    wait_for(lambda: sample(ex.metrics(), "trainmon_train_step", **team_a) == 3)
    victim.say()  # crashes without finishing
    victim.wait()
    wait_for(lambda: sample(ex.metrics(), "trainmon_run_up", **team_a) == 0)
    for namespace in ("team-b", "team-a", ""):
        run_as(
            ex.socket,
            ATTACKER,
            ATTACKER_GID,
            f'os.environ["POD_NAMESPACE"] = "{namespace}"\n'
            'r = init("shared"); r.log(9, loss=0.0); r.finish()',
        )
    m = wait_for(lambda: _refused(ex, "not_owner", ATTACKER) == 1 and ex.metrics())
    # team-b's run and the default namespace's are the attacker's own; team-a's was refused.
    for ns in ("team-b", "trainmon-system"):
        assert sample(m, "trainmon_train_step", namespace=ns, run="shared", rank="0") == 9
    assert sample(m, "trainmon_train_step", **team_a) == 3
    assert sample(m, "trainmon_run_crashes_total", **team_a) == 1


# --------------------------------------------------------------------------- verified namespaces


def test_a_namespace_is_one_tenant_whatever_uids_its_pods_run_as() -> None:
    """Four runAsUser values in one namespace share its quota; another namespace of the same
    uids has its own, and neither can write into the other's runs."""
    store = store_of(max_ranks=16, max_ranks_per_uid=4)
    a = [
        store.attach(_h(f"a{uid}") | {"namespace": "team-a"}, uid=uid, peer_namespace="team-a")
        for uid in (1000, 1001, 1002, 1003, 1004)
    ]
    assert [isinstance(s, str) for s in a] == [False] * 4 + [True]
    assert a[-1] == "uid_rank_quota"
    b = store.attach(_h("a1000") | {"namespace": "team-b"}, uid=1000, peer_namespace="team-b")
    assert not isinstance(b, str) and b.tenant == "team-b" and b.run_key == "team-b/a1000"
    assert store.admission.tenant_ranks == {"team-a": 4, "team-b": 1}
    # Another uid of team-a resumes team-a's crashed rank: the run is the namespace's.
    first = a[0]
    assert not isinstance(first, str)
    first.disconnect(finished=False)
    again = store.attach(_h("a1000") | {"namespace": "team-a"}, uid=1004, peer_namespace="team-a")
    assert again is first
    _check_indexes(store)


def test_a_namespaces_pods_take_back_a_run_a_process_only_claiming_it_opened() -> None:
    """A process outside the namespace's pods (a host process, keyed by its uid) opened
    team-a/llama first, and is first to its owner record after: team-a's pod gets both."""
    store = store_of(max_ranks=16, ttl_s=600)
    squat = store.attach(_h("llama") | {"namespace": "team-a"}, uid=0)
    assert not isinstance(squat, str) and squat.tenant == 0
    mine = store.attach(_h("llama") | {"namespace": "team-a"}, uid=0, peer_namespace="team-a")
    assert not isinstance(mine, str) and mine.tenant == "team-a"
    assert squat.revoked == "not_owner" and store.ranks[("team-a/llama", 0)] is mine
    assert store.admission.hellos_refused == {("not_owner", "", "0"): 1}
    # The process claiming the namespace cannot take it back.
    assert store.attach(_h("llama", 1) | {"namespace": "team-a"}, uid=0) == "not_owner"
    # An evicted run's owner record does not hold against the namespace's pods either.
    store.attach(_h("gpt") | {"namespace": "team-a"}, uid=5)
    store._remove(store.ranks[("team-a/gpt", 0)])
    assert store.owners["team-a/gpt"][0] == 5
    back = store.attach(_h("gpt") | {"namespace": "team-a"}, uid=5, peer_namespace="team-a")
    assert not isinstance(back, str) and back.tenant == "team-a"
    _check_indexes(store)
