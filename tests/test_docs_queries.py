"""The example PromQL in docs/metrics.md, evaluated by promtool on series shaped like ours."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from tests.conftest import ROOT, require_tool


def example_queries() -> dict[str, str]:
    """``{comment: query}`` of the ``promql`` block under "Useful queries"."""
    doc = (ROOT / "docs" / "metrics.md").read_text()
    block = re.search(r"## Useful queries\s+```promql\n(.*?)```", doc, re.S)
    assert block, "docs/metrics.md has no Useful queries block"
    queries: dict[str, str] = {}
    comment: list[str] = []
    expr: list[str] = []
    for line in [*block[1].splitlines(), "# end"]:
        if line.startswith("#"):
            if expr:
                queries[" ".join(comment)] = "\n".join(expr)
                comment, expr = [], []
            comment.append(line.lstrip("# "))
        elif line.strip():
            expr.append(line)
    return queries


def promtool_eval(tmp_path: Path, series: list[dict[str, str]], tests: list[dict]) -> None:  # type: ignore[type-arg]
    promtool = require_tool("promtool", "prometheus")
    spec = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": tests}],
    }
    f = tmp_path / "queries_test.yml"
    f.write_text(yaml.safe_dump(spec, sort_keys=False))
    out = subprocess.run(
        [promtool, "test", "rules", str(f)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_nan_query_sees_a_short_runs_nan(tmp_path: Path) -> None:
    nan = next(q for c, q in example_queries().items() if "NaN" in c)
    labels = 'run="{run}",rank="0",field="loss"'
    series = [
        # A run that hit NaN before its first scrape: the series is born at 1 and ends.
        {
            "series": "trainmon_train_nonfinite_values_total{" + labels.format(run="short") + "}",
            "values": "_ _ 1 1",
        },
        # A long run: 0 for a while, then one NaN.
        {
            "series": "trainmon_train_nonfinite_values_total{" + labels.format(run="long") + "}",
            "values": "0x5 1 1",
        },
        # A healthy run: no NaN, nothing reported.
        {
            "series": "trainmon_train_nonfinite_values_total{" + labels.format(run="ok") + "}",
            "values": "0x8",
        },
    ]
    short = {"labels": "trainmon_train_nonfinite_values_total{" + labels.format(run="short") + "}"}
    promtool_eval(
        tmp_path,
        series,
        [
            # At 3m the short run has two samples, both 1: increase() is 0, the NaN is shown.
            {"expr": nan, "eval_time": "3m", "exp_samples": [short | {"value": 1}]},
            {
                "expr": nan,
                "eval_time": "7m",
                "exp_samples": [
                    {"labels": "{" + labels.format(run="long") + "}", "value": 1},
                ],
            },
        ],
    )


def test_every_example_query_parses_and_evaluates(tmp_path: Path) -> None:
    queries = example_queries()
    assert len(queries) >= 5
    tests = [{"expr": q, "eval_time": "1m", "exp_samples": []} for q in queries.values()]
    promtool_eval(tmp_path, [{"series": "up", "values": "1x3"}], tests)
