"""TextExposition writes exactly what prometheus-client's generate_latest writes."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import generate_latest

from trainmon_client import _protocol as P
from trainmon_exporter.app import build_exporter
from trainmon_exporter.exposition import TextExposition
from trainmon_exporter.settings import CollectorToggles, Settings

ODD = ['"', "\\", "\n", "é", "µs", "{", "}", ",", "=", " ", "\t", "☃", "a", "0", "_"]


class Families:
    """A collector yielding whatever families the test put in ``self.families``."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def collect(self) -> list[Metric]:
        return self.families


def odd_text(rng: random.Random, n: int = 6) -> str:
    return "".join(rng.choice(ODD) for _ in range(rng.randint(0, n)))


def value(rng: random.Random) -> float:
    return rng.choice(
        [
            0.0,
            -0.0,
            1.0,
            float("nan"),
            float("inf"),
            float("-inf"),
            1e-300,
            1e300,
            123456789.0,
            1234567.5,
            rng.uniform(-1e9, 1e9),
            float(rng.randint(-(10**12), 10**12)),
        ]
    )


def random_families(rng: random.Random, series: int) -> list[Metric]:
    """Families of every type the exporter uses, with hostile HELP and label values."""
    out: list[Metric] = []
    for i in range(rng.randint(1, 6)):
        kind = rng.choice(["gauge", "counter", "histogram", "info", "summary", "plain"])
        name = f"fam{i}_{rng.choice(['x', 'bytes', 'seconds', 'a:b'])}"
        doc = odd_text(rng, 12)
        labels = ["rank", "layer", "le_x"][: rng.randint(0, 3)]
        fam: Any
        if kind == "gauge":
            fam = GaugeMetricFamily(name, doc, labels=labels)
        elif kind == "counter":
            fam = CounterMetricFamily(name, doc, labels=labels)
        elif kind == "histogram":
            fam = HistogramMetricFamily(name, doc, labels=labels)
        elif kind == "info":
            fam = InfoMetricFamily(name, doc, labels=labels)
        elif kind == "summary":
            fam = SummaryMetricFamily(name, doc, labels=labels)
        else:
            out.append(GaugeMetricFamily(name, doc, value=value(rng)))
            continue
        for _ in range(rng.randint(0, series)):
            lv = [odd_text(rng) if rng.random() < 0.5 else str(rng.randint(0, 3)) for _ in labels]
            if kind == "gauge":
                fam.add_metric(lv, value(rng))
            elif kind == "counter":
                fam.add_metric(lv, abs(value(rng)), created=rng.choice([None, 1700000000.5]))
            elif kind == "histogram":
                fam.add_metric(lv, [("0.1", 1.0), ("1.0", 2.0), ("+Inf", 3.0)], 4.5)
            elif kind == "info":
                fam.add_metric(lv, {"version": odd_text(rng), "uuid": "GPU-1"})
            else:
                fam.add_metric(lv, rng.randint(0, 9), value(rng))
        out.append(fam)
    return out


def test_random_families_render_as_generate_latest_does_across_scrapes() -> None:
    rng = random.Random(20261124)
    source = Families()
    registry = CollectorRegistry()
    registry.register(source)  # type: ignore[arg-type]
    text = TextExposition()
    for _ in range(300):  # series come, go and change value between renders
        source.families = random_families(rng, series=8)
        assert text.render(registry) == generate_latest(registry)


def test_a_label_value_change_is_a_new_series_not_a_stale_prefix() -> None:
    source = Families()
    registry = CollectorRegistry()
    registry.register(source)  # type: ignore[arg-type]
    text = TextExposition()
    for host in ("a", "b", "a"):
        g = GaugeMetricFamily("m", "h", labels=["host"])
        g.add_metric([host], 1.0)
        source.families = [g]
        assert text.render(registry) == generate_latest(registry)
        assert f'm{{host="{host}"}} 1.0'.encode() in text.render(registry)


def test_the_exporters_own_registry_renders_identically(tmp_path: Path) -> None:
    ex = build_exporter(
        Settings(socket=tmp_path / "t.sock", collectors=CollectorToggles(gpu=False, rank_gpu=False))
    )
    now = time.time()
    for r in range(4):
        st = ex.store.attach(
            {
                "run": 'odd "run"\\',
                "rank": r,
                "local_rank": r,
                "world_size": 4,
                "hostname": "node-1",
                "pid": 1000 + r,
                "client_version": "t",
                "gpu_uuid": None,
                "started_at": now - 100,
                "flops_per_token": 6e6,
                "dtype": "bf16",
            }
        )
        assert not isinstance(st, str)
        for i in range(50):
            st.observe_step(
                P.Step(
                    P.StepHeader(
                        i, i + 1, now - 50 + i, 0.1, 4096.0 * i, 8.0 * i, 1e-3 * i, 0, 0, 0
                    ),
                    (1, 2, 3),
                    (2.0 + 0.01 * (i % 7), 3e-4, float("nan") if i == 40 else 1.0),
                ),
                {},
                30.0,
            )
    # The exporter's families as one scrape collected them (values that move with the clock,
    # like CPU seconds, are frozen), rendered both ways, twice (the second from the cache).
    frozen = Families()
    frozen.families = list(ex.registry.collect())
    registry = CollectorRegistry()
    registry.register(frozen)  # type: ignore[arg-type]
    text = TextExposition()
    expected = generate_latest(registry)
    assert expected.count(b"\n") > 300
    assert text.render(registry) == expected
    assert text.render(registry) == expected
