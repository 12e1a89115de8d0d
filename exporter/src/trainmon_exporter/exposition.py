"""The Prometheus text exposition (format 0.0.4), byte for byte what prometheus-client writes.

``prometheus_client.exposition.generate_latest`` formats every sample from scratch at every
scrape: it sorts and escapes the labels, validates their names and formats the value. At a
realistic node size (8 ranks, 128 watched layers, 8 GPUs: about 2,000 samples) that is two
thirds of a scrape (``benchmarks/scrape.py``, profiled with py-spy). Between two scrapes
nearly every series is the same series with a new value, so :class:`TextExposition` keeps,
per series, the finished text before its value (``name{a="x",b="y"} ``) and only formats the
value. The cache holds the series of the last scrape only (rebuilt each time), so it never
grows past one exposition's worth of strings.

The output is identical to ``generate_latest(registry)`` with its default escaping
(``openmetrics.UNDERSCORES``): the same family munging (counters get ``_total``, info
becomes a gauge named ``_info``, ...), the same order (``_created``, ``_gsum`` and ``_gcount``
samples moved to gauges after their family), the same escaping and the same value format
(``floatToGoString``). ``tests/exporter/test_exposition.py`` checks this against
``generate_latest`` on the exporter's own registry and on generated families. Samples with
a timestamp or an exemplar take prometheus-client's own path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client.openmetrics import exposition as om
from prometheus_client.utils import floatToGoString as _untyped_float_to_go

_float_to_go: Callable[[float], str] = _untyped_float_to_go  # untyped in prometheus-client

_MUNGE = {
    "info": "gauge",
    "stateset": "gauge",
    "gaugehistogram": "histogram",
    "unknown": "untyped",
}
_OM_SUFFIXES = ("_created", "_gsum", "_gcount")


def _help_text(documentation: str) -> str:
    return documentation.replace("\\", r"\\").replace("\n", r"\n")


def _label_value(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _prefix(name: str, labels: dict[str, str]) -> str:
    """``name{labels} ``: everything of a sample line before its value.

    As prometheus-client writes it: labels sorted by name, names escaped with UNDERSCORES,
    values with backslash, newline and quote escapes.
    """
    if labels:
        labelstr = ",".join(
            f'{om.escape_label_name(k, om.UNDERSCORES)}="{_label_value(v)}"'
            for k, v in sorted(labels.items())
        )
        return f"{om.escape_metric_name(name, om.UNDERSCORES)}{{{labelstr}}} "
    return f"{om.escape_metric_name(name, om.UNDERSCORES)} "


class TextExposition:
    """Renders a registry in the text format with a per-series prefix cache.

    Not thread-safe: one instance per caller that serialises its scrapes (the exporter's
    ``/metrics`` route holds one and a lock around it).
    """

    def __init__(self) -> None:
        self._prefixes: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}
        self._headers: dict[tuple[str, str, str], str] = {}

    def render(self, registry: Any) -> bytes:
        """The exposition of ``registry`` (anything with ``collect()``), UTF-8 bytes."""
        old = self._prefixes
        new: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}
        headers_old = self._headers
        headers_new: dict[tuple[str, str, str], str] = {}
        output: list[str] = []
        append = output.append

        def line(s: Any) -> str:
            if s.timestamp is not None or s.exemplar is not None or s.native_histogram:
                return _slow_line(s)
            key = (s.name, tuple(s.labels.items()))
            prefix = new.get(key)
            if prefix is None:
                prefix = old.get(key)
                if prefix is None:
                    prefix = _prefix(s.name, s.labels)
                new[key] = prefix
            return f"{prefix}{_float_to_go(s.value)}\n"

        def header(name: str, mtype: str, documentation: str) -> str:
            hkey = (name, mtype, documentation)
            text = headers_new.get(hkey) or headers_old.get(hkey)
            if text is None:
                escaped = om.escape_metric_name(name, om.UNDERSCORES)
                text = f"# HELP {escaped} {_help_text(documentation)}\n# TYPE {escaped} {mtype}\n"
            headers_new[hkey] = text
            return text

        for metric in registry.collect():
            mname, mtype = metric.name, metric.type
            om_samples: dict[str, list[str]] = {}
            try:
                if mtype == "counter":
                    mname += "_total"
                elif mtype == "info":
                    mname += "_info"
                mtype = _MUNGE.get(mtype, mtype)
                append(header(mname, mtype, metric.documentation))
                base = metric.name
                for s in metric.samples:
                    sname = s.name
                    if sname.startswith(base) and sname[len(base) :] in _OM_SUFFIXES:
                        om_samples.setdefault(sname[len(base) :], []).append(line(s))
                    else:
                        append(line(s))
            except Exception as exception:
                exception.args = (exception.args or ("",)) + (metric,)
                raise
            for suffix, lines in sorted(om_samples.items()):
                append(header(metric.name + suffix, "gauge", metric.documentation))
                output.extend(lines)
        self._prefixes, self._headers = new, headers_new
        return "".join(output).encode("utf-8")


def _slow_line(s: Any) -> str:
    """A sample prometheus-client's way (timestamps; exemplars are not in this format)."""
    timestamp = ""
    if s.timestamp is not None:
        timestamp = f" {int(float(s.timestamp) * 1000):d}"
    return f"{_prefix(s.name, s.labels)[:-1]} {_float_to_go(s.value)}{timestamp}\n"
