"""Every benchmark runs in CI in its ``--smoke`` mode, and ``make bench`` runs every benchmark.

Smoke mode is seconds long and judges no figure: it only keeps each script working, so a
figure in docs/performance.md can always be reproduced with the command given next to it.
Benchmarks are found from the directory, so a new script is covered the day it lands.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, child_env
from tests.helpers.checkout import tracked

BENCH = ROOT / "benchmarks"


def scripts() -> list[Path]:
    """Every benchmark script: ``benchmarks/**/*.py`` except private modules (``_harness``)."""
    return [
        p
        for p in tracked("**/*.py", under=BENCH)
        if not any(part.startswith("_") for part in p.relative_to(BENCH).parts)
    ]


def children() -> set[Path]:
    """Scripts another benchmark runs itself (``detection/scenario.py`` by ``run.py``)."""
    return {
        script
        for script in scripts()
        for other in scripts()
        if other != script
        and other.parent == script.parent
        and re.search(rf"[\"']{re.escape(script.name)}[\"']", other.read_text())
    }


# What a smoke run needs that is not Python: Debian packages CI installs (.ci/run).
NEEDS = {
    "rules_eval.py": "prometheus",
    "false_alarms.py": "prometheus",
    "prometheus_memory.py": "prometheus",
    "goodput_job.py": "prometheus",
}


def test_benchmarks_are_found() -> None:
    names = {p.relative_to(BENCH).as_posix() for p in scripts()}
    assert {"ingest.py", "detection/run.py", "detection/scenario.py"} <= names
    assert "_harness.py" not in names
    assert children() == {BENCH / "detection" / "scenario.py"}


@pytest.mark.slow
@pytest.mark.parametrize("script", scripts(), ids=lambda p: p.relative_to(BENCH).as_posix())
def test_benchmark_runs_in_smoke_mode(script: Path) -> None:
    tool = NEEDS.get(script.name)
    if tool and shutil.which(tool) is None:
        if os.environ.get("CI_REQUIRE_TOOLS"):
            pytest.fail(f"{tool} is required in CI")
        pytest.skip(f"needs {tool} (Debian package)")
    assert "--smoke" in script.read_text(), f"{script.name} has no --smoke mode"
    env = child_env(TRAINMON_SOCKET=str(Path("/nonexistent") / "trainmon.sock"))
    out = subprocess.run(
        [sys.executable, str(script), "--smoke"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode == 0, f"{script.name} --smoke failed:\n{out.stdout}\n{out.stderr}"
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stdout.strip(), f"{script.name} --smoke printed nothing"


def bench_target() -> list[str]:
    """The recipe lines of the Makefile's ``bench`` target."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("bench:"))
    recipe = []
    for ln in lines[start + 1 :]:
        if not ln.startswith("\t"):
            break
        recipe.append(ln.strip())
    return recipe


def test_make_bench_runs_every_benchmark() -> None:
    recipe = " ".join(bench_target())
    listed = set(re.findall(r"benchmarks/[\w/]+\.py", recipe))
    expected = {p.relative_to(ROOT).as_posix() for p in scripts() if p not in children()}
    assert expected - listed == set(), f"make bench misses {sorted(expected - listed)}"
    assert listed - expected == set(), f"make bench runs unknown scripts {listed - expected}"


def test_performance_md_shows_how_to_run_every_benchmark() -> None:
    doc = (ROOT / "docs" / "performance.md").read_text()
    block = re.search(r"## Reproducing\s+```sh\n(.*?)```", doc, re.S)
    assert block, "docs/performance.md has no Reproducing block"
    shown = set(re.findall(r"benchmarks/[\w/]+\.py", block[1]))
    expected = {p.relative_to(ROOT).as_posix() for p in scripts() if p not in children()}
    assert expected - shown == set(), f"not in docs/performance.md: {sorted(expected - shown)}"
