"""Goodput for the whole job, true across nodes, exporter restarts and long outages, and at the
job's critical path: real trainers, real exporters, a real Prometheus with the shipped rules.

Shorter runs of ``benchmarks/goodput_job.py`` (``tests/helpers/goodput_lab.py`` describes the
scenarios and how the trainers measure the truth): for each, the job's goodput that the rules
record and the JSON API shows is within 3 points of what the trainers measured, and every
badput kind of a second or more within 15 %.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..helpers.goodput_lab import SCENARIOS, Result, run_scenarios
from .stack import require_binaries

pytestmark = pytest.mark.slow

SIZES = {"steps": 30}


@pytest.fixture(scope="module")
def results() -> Iterator[dict[str, Result]]:
    require_binaries("prometheus", package="prometheus")
    yield {r.scenario: r for r in run_scenarios(SCENARIOS, **SIZES)}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_job_goodput_is_the_trainers_own(results: dict[str, Result], scenario: str) -> None:
    result = results[scenario]
    print(result.table())
    assert not result.problems(), "\n".join([*result.problems(), result.table()])


def test_the_figures_are_the_jobs_not_one_nodes(results: dict[str, Result]) -> None:
    """What one node's view gets wrong is seen: the moved rank's figures on the exporter it
    restarted on (its own) are far from the job's, which count its other node, the time it
    lost and the time between the two as recovery."""
    moved = results["moved"]
    assert abs(moved.api_local["ratio"] - moved.truth["ratio"]) > 0.05
    assert moved.rules["recovery"] > 1.0 and moved.rules["wasted_progress"] > 0.3
    assert results["ttl"].rules["recovery"] > 5.0
