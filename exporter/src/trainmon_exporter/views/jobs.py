"""A job's figures across nodes, read from the Prometheus that records them (``prometheus_url``).

One exporter sees the ranks of its node; a job's goodput is computed where every node is
visible, by the recording rules (docs/goodput.md#the-whole-job). With ``prometheus_url`` set,
the JSON API, the status page and ``trainmon status`` add to each run the job's figures read
back from there (:class:`~trainmon_exporter.views.api.JobView`): its goodput over its life
and the last hour, its badput by kind and the rank it waits on.

One instant query per refresh for every run of the answer (``run=~"a|b"``), cached for
:data:`CACHE_S` seconds so the API's callers never multiply the queries; a refresh waits at
most ``timeout`` seconds and reads at most :data:`MAX_BODY_BYTES`. A Prometheus that does not
answer (or answers nonsense) leaves ``job`` null, logged once per change of the reason: it
never delays the answer by more than the timeout, never fails it.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
import urllib.parse
import urllib.request
from typing import Any

from trainmon_exporter.views.api import JobView, RunsResponse

__all__ = ["CACHE_S", "MAX_BODY_BYTES", "JobSource", "source_of"]

log = logging.getLogger("trainmon_exporter.views.jobs")

CACHE_S = 10.0
"""How long the job figures read are served before they are read again (s)."""
MAX_BODY_BYTES = 4 * 2**20
"""Largest answer read from Prometheus."""
MAX_RUNS = 256
"""Runs asked about in one query (the first ones, sorted)."""
RECORDS = (
    "run:trainmon_train_goodput:ratio",
    "run:trainmon_train_goodput:ratio_1h",
    "run:trainmon_train_badput_seconds:sum",
    "run:trainmon_train_badput_seconds:data_loading_critical_rank",
)
"""The recording rules read (deploy/prometheus/trainmon.rules.yml)."""


class JobSource:
    """Reads and caches the job figures of runs from the Prometheus at ``url``."""

    def __init__(self, url: str, timeout: float = 2.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._lock = threading.Lock()
        self._cache: tuple[float, frozenset[tuple[str, str]], dict[Any, JobView]] | None = None
        self._problem = ""

    def add_to(self, response: RunsResponse) -> RunsResponse:
        """Set each run's ``job`` from the cache (refreshed first when stale); ``response``."""
        runs = frozenset((r.namespace, r.run) for r in response.runs)
        if not runs:
            return response
        figures = self._figures(runs)
        for view in response.runs:
            view.job = figures.get((view.namespace, view.run))
        return response

    def _figures(self, runs: frozenset[tuple[str, str]]) -> dict[Any, JobView]:
        now = time.monotonic()
        cached = self._cache
        if cached is not None and now - cached[0] < CACHE_S and runs <= cached[1]:
            return cached[2]
        if not self._lock.acquire(blocking=False):  # another request refreshes it now
            return cached[2] if cached is not None else {}
        try:
            try:
                figures = self._read(runs)
                self._report("")
            except (OSError, ValueError, KeyError, TypeError) as exc:
                figures = {}
                self._report(f"{type(exc).__name__}: {exc}")
            self._cache = (time.monotonic(), runs, figures)
            return figures
        finally:
            self._lock.release()

    def _report(self, problem: str) -> None:
        if problem != self._problem:
            if problem:
                log.warning("cannot read job figures from %s: %s", self.url, problem[:300])
            else:
                log.info("job figures read from %s", self.url)
            self._problem = problem

    def _read(self, runs: frozenset[tuple[str, str]]) -> dict[Any, JobView]:
        ids = sorted({run for _, run in runs})[:MAX_RUNS]
        names = _quoted("|".join(re.escape(n) for n in RECORDS))
        selector = f'{{__name__=~"{names}",run=~"{_quoted("|".join(map(re.escape, ids)))}"}}'
        query = urllib.parse.urlencode({"query": selector})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{query}", timeout=self.timeout) as r:
            body = r.read(MAX_BODY_BYTES + 1)
        if len(body) > MAX_BODY_BYTES:
            raise ValueError(f"an answer over {MAX_BODY_BYTES} bytes")
        doc = json.loads(body)
        if doc.get("status") != "success":
            raise ValueError(f"status {doc.get('status')!r}: {doc.get('error', '')!r}")
        clusters: dict[tuple[str, str], set[str]] = {}
        out: dict[Any, dict[str, Any]] = {}
        for sample in doc["data"]["result"]:
            labels = sample["metric"]
            key = (labels.get("namespace", ""), labels["run"])
            if key not in runs:
                continue
            clusters.setdefault(key, set()).add(labels.get("cluster", ""))
            value = float(sample["value"][1])
            if not math.isfinite(value):
                continue
            fig = out.setdefault(key, {"badput_seconds": {}})
            name = labels["__name__"]
            if name == RECORDS[0]:
                fig["goodput_ratio"] = value
            elif name == RECORDS[1]:
                fig["goodput_ratio_1h"] = value
            elif name == RECORDS[2] and "kind" in labels:
                fig["badput_seconds"][labels["kind"]] = value
            elif name == RECORDS[3] and value > 0 and "rank" in labels:
                fig["waits_on_rank"] = int(labels["rank"])
                fig["waits_on_hostname"] = labels.get("hostname")
        # The same run id in two clusters of one Prometheus: which one is this is unknown.
        return {k: JobView(**v) for k, v in out.items() if len(clusters.get(k, ())) == 1}


def source_of(url: str | None) -> JobSource | None:
    """The job source of the ``prometheus_url`` setting (None: not set)."""
    return None if not url else JobSource(url)


def _quoted(regex: str) -> str:
    """``regex`` inside a PromQL double-quoted string (its backslashes and quotes escaped)."""
    return regex.replace("\\", "\\\\").replace('"', '\\"')
