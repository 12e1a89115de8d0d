"""The exporter's metric catalog, for checking names used by rules and dashboards."""

from __future__ import annotations

import re
from collections.abc import Callable

from .conftest import InProcessExporter, connect, wait_for
from .exporter.test_layers import train
from .exporter.test_metrics import scripted_session
from .fakes.nvml_backend import FakeGpu, FakeNvmlBackend


def exposed_names(make_exporter: Callable[..., InProcessExporter]) -> set[str]:
    """Every series name a real exporter exposes after a scripted session and a watched run.

    The exporter samples two GPUs of the fake NVML backend, so the GPU families are there.
    Read from the TYPE lines, so families without samples yet (gauges that need hundreds of
    steps) count; histograms add their _bucket, _sum and _count series.
    """
    exporter = make_exporter(
        nvml=FakeNvmlBackend([FakeGpu(uuid="GPU-a"), FakeGpu(uuid="GPU-b")]),
        nvml_interval_seconds=0.1,
    )
    wait_for(lambda: exporter.app.state.exporter.gpus.snapshot.ok)
    scripted_session(exporter)
    watched = connect(exporter, "catalog")
    train(watched, 3, every=1)
    wait_for(lambda: (k := exporter.rank("catalog", 0)) and k["status"] == "finished")
    names: set[str] = set()
    for line in exporter.metrics_text().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


FLEET_LABELS = ("cluster", "namespace")
"""Labels that, with ``run``, identify a run fleet-wide (the same run id may exist twice)."""


def fleet_key_problems(promql: str) -> list[str]:
    """Places in a PromQL expression (or a template that builds one) that key a run by ``run``
    without ``cluster`` and ``namespace``: a ``by``/``on`` clause naming ``run``, or a selector
    matching on ``run``. Returns them as text, [] when there are none.
    """
    problems = []
    for kind, labels in re.findall(r"\b(by|on)\s*\(([^)]*)\)", promql):
        names = {n.strip() for n in labels.split(",")}
        if "run" in names and not set(FLEET_LABELS) <= names:
            problems.append(f"{kind} ({labels})")
    for selector in re.findall(r"\{[^{}]*\}", promql):
        if re.search(r"\brun\s*=", selector) and not all(
            re.search(rf"\b{label}\s*=", selector) for label in FLEET_LABELS
        ):
            problems.append(selector)
    return problems
