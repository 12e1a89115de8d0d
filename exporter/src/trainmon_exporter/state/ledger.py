"""The durable per-rank record: what outlives a rank's live state.

A rank's time accounting (:class:`~trainmon_exporter.analytics.goodput.Goodput`) must survive
what ends its live state: the TTL after its process went away (a restart that takes longer),
an eviction, and the exporter's own restart. Two things keep it:

- :class:`Ledger`, one per :class:`~trainmon_exporter.state.store.Store`: the accounting of
  ranks that left the store without a clean finish (:class:`Departed`), kept for
  ``retention_s`` and at most ``max_records`` of them (the oldest go first, counted in
  :attr:`Ledger.evicted`). Their goodput series stay exported, so the recording rules still
  see a run's time on this node when its rank restarted elsewhere, and a rank that comes back
  here adopts its record: its counters go on, its recovery and wasted progress are placed.
- the exporter's state file (:mod:`trainmon_exporter.state.statefile`, its rows
  :mod:`trainmon_exporter.state.records`), which keeps the live ranks' accounting and the
  ledger's across a restart of the exporter.

Not thread-safe: the store's lock guards it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from trainmon_client import _protocol as P
from trainmon_exporter.analytics.goodput import Goodput
from trainmon_exporter.state.rank import RankState, Tenant, run_key

__all__ = ["Departed", "FileStats", "Ledger", "hello_of"]


@dataclass(slots=True)
class Departed:
    """A rank that left the store without a clean finish: who it was, and its accounting."""

    hello: dict[str, Any]
    """Its last HELLO (:data:`~trainmon_client._protocol.HELLO_FIELDS`, checked)."""
    owner_uid: int | None
    tenant: Tenant
    """Whose it is (:data:`~trainmon_exporter.state.rank.Tenant`): only that tenant adopts it."""
    status: str
    step: int | None
    steps_total: int
    goodput: Goodput
    since: float
    """When it departed (exporter ``time.monotonic()``)."""

    @property
    def key(self) -> tuple[str, int]:
        """``(run_key, rank)``, as the store keys ranks."""
        return (run_key(self.hello["namespace"], self.hello["run"]), self.hello["rank"])

    @property
    def namespace(self) -> str:
        """The client's Kubernetes namespace (``""`` off Kubernetes)."""
        return str(self.hello["namespace"])

    @property
    def run(self) -> str:
        """The run id."""
        return str(self.hello["run"])

    @property
    def rank(self) -> int:
        """The rank."""
        return int(self.hello["rank"])


@dataclass(slots=True)
class FileStats:
    """What became of the state file (``trainmon_exporter_state_*``), kept by its keeper."""

    saves_ok: int = 0
    save_errors: int = 0
    last_save: float = 0.0
    """When it was last written (Unix s; 0: never)."""
    refused: dict[str, int] = field(default_factory=dict)
    """Files (and rows, ``bad_row``) refused at start, by reason."""
    restored_ranks: int = 0
    restored_departed: int = 0


class Ledger:
    """Departed ranks' accounting, by ``(run_key, rank)``, oldest first.

    ``max_records``: most records kept (past it, the oldest is dropped and counted in
    :attr:`evicted`); ``retention_s``: how long one is kept after it departed (0: not at all).
    """

    def __init__(self, max_records: int, retention_s: float) -> None:
        self.max_records = max_records
        self.retention_s = retention_s
        self.records: OrderedDict[tuple[str, int], Departed] = OrderedDict()
        self.evicted = 0
        """Records dropped before their retention ended, to keep ``max_records``."""
        self.expired = 0
        """Records dropped at the end of their retention."""

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Departed]:
        return iter(list(self.records.values()))

    def keep(self, state: RankState, now: float) -> None:
        """Keep the accounting of ``state``, which leaves the store (expiry or eviction).

        A finished rank's accounting is complete and is not kept (its id may be reused for a
        new run). What the rank still held is settled (:meth:`Goodput.settle`): nobody can
        resume it here any more without adopting the record, which places it again.
        """
        if state.status == "finished" or self.retention_s <= 0:
            return
        g = state.goodput
        g.settle()
        g.data_window.clear()
        self.put(
            Departed(
                hello=hello_of(state),
                owner_uid=state.owner_uid,
                tenant=state.tenant,
                status=state.status,
                step=state.step,
                steps_total=state.steps_total,
                goodput=g,
                since=now,
            )
        )

    def put(self, record: Departed) -> None:
        """Add ``record`` (the newest), dropping the oldest past ``max_records``."""
        self.records.pop(record.key, None)
        self.records[record.key] = record
        while len(self.records) > self.max_records:
            self.records.popitem(last=False)
            self.evicted += 1

    def sort(self) -> None:
        """Order the records oldest first again (after records of another age were put)."""
        self.records = OrderedDict(sorted(self.records.items(), key=lambda kv: kv[1].since))
        while len(self.records) > self.max_records:
            self.records.popitem(last=False)
            self.evicted += 1

    def take(self, key: tuple[str, int]) -> Departed | None:
        """Remove and return the record of ``key`` (a rank coming back), if any."""
        return self.records.pop(key, None)

    def forget_run(self, run: str) -> int:
        """Drop every record of the run key ``run`` (a new run under its id); how many."""
        keys = [k for k in self.records if k[0] == run]
        for k in keys:
            del self.records[k]
        return len(keys)

    def of_run(self, run: str) -> list[Departed]:
        """The records of the run key ``run`` (O(records))."""
        return [d for k, d in self.records.items() if k[0] == run]

    def expire(self, now: float) -> int:
        """Drop the records older than ``retention_s``; how many."""
        n = 0
        horizon = now - self.retention_s
        while self.records:
            d = next(iter(self.records.values()))
            if d.since > horizon:
                break
            self.records.popitem(last=False)
            n += 1
        self.expired += n
        return n


def hello_of(state: RankState) -> dict[str, Any]:
    """The HELLO fields of ``state`` (:data:`~trainmon_client._protocol.HELLO_FIELDS`)."""
    return {k: getattr(state, k) for k in P.HELLO_FIELDS}
