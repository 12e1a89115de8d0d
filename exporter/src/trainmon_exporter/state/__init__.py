"""Push-side state: what the exporter knows about every (run, rank), updated per record.

Five rooms, each importing only those below it:

- :mod:`.statefile`: the exporter's state file on disk (read without trusting the path,
  written atomically) and its :class:`~.statefile.Keeper`, which fills the store from it at
  start and saves the store's rows;
- :mod:`.store`: :class:`~.store.Store`, every rank indexed by (run, rank) and by run, the lock,
  attaching a connection to its rank (ownership, owner claims, resuming), the records applied
  under the store's limits, expiry and the periodic judgement;
- :mod:`.ledger`: the durable per-rank record: the time accounting of ranks that left without
  a clean finish (kept, exported, adopted when they come back) and the state file's rows;
- :mod:`.admission`: :class:`~.admission.Admission`, the caps, per-uid quotas, series budget,
  eviction after retention and the HELLOs refused by uid;
- :mod:`.rank`: :class:`~.rank.RankState`, one rank's figures and its ``observe_*`` methods,
  its history and its time accounting's hooks.

Judgement is elsewhere (:mod:`trainmon_exporter.analytics`, :mod:`trainmon_exporter.derive`).
"""
