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


def test_nan_query_sees_a_short_runs_nan_and_an_old_one_after_a_gap_not(tmp_path: Path) -> None:
    nan = next(q for c, q in example_queries().items() if "NaN/Inf in loss" in c)
    labels = 'run="{run}",rank="0",field="loss"'
    name = "trainmon_train_nonfinite_values_last_timestamp_seconds"
    series = [
        # A run that hit NaN (at 1m50s) before its first scrape, and ended.
        {"series": name + "{" + labels.format(run="short") + "}", "values": "_ _ 110 110"},
        # A long run: one NaN at 5m50s; then its exporter misses a scrape at 12m.
        {"series": name + "{" + labels.format(run="long") + "}", "values": "_x6 350x5 stale 350x5"},
        # A healthy run has no such series.
    ]
    promtool_eval(
        tmp_path,
        series,
        [
            {
                "expr": nan,
                "eval_time": "3m",
                "exp_samples": [
                    {"labels": name + "{" + labels.format(run="short") + "}", "value": 110}
                ],
            },
            {
                "expr": nan,
                "eval_time": "7m",
                "exp_samples": [
                    {"labels": name + "{" + labels.format(run="long") + "}", "value": 350}
                ],
            },
            # The scrape gap brings the old NaN back as nothing new.
            {"expr": nan, "eval_time": "13m", "exp_samples": []},
        ],
    )


def test_every_example_query_parses_and_evaluates(tmp_path: Path) -> None:
    queries = example_queries()
    assert len(queries) >= 5
    tests = [{"expr": q, "eval_time": "1m", "exp_samples": []} for q in queries.values()]
    promtool_eval(tmp_path, [{"series": "up", "values": "1x3"}], tests)
