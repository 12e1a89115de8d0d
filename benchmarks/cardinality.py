"""Print the series a real exporter exports per rank, GPU, node, run and watched layer.

The session and the counting rules are in ``tests/helpers/cardinality.py``; the budget that
``tests/exporter/test_cardinality.py`` holds the exporter to, and the fleet table it
publishes in docs/scaling.md, follow from these figures.

    python benchmarks/cardinality.py [--smoke]

It takes seconds as it is; ``--smoke`` is accepted so every benchmark has the same CI mode.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers.cardinality import BUDGET, GPUS, RANKS, measure, table  # noqa: E402  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="the same run (it takes seconds)")
    ap.parse_args()
    f = measure()
    print(f"one exporter, {GPUS} fake H100s, one run of {RANKS} ranks ({f.total} series)")
    print(f"{'unit':<8}{'measured':>10}{'budget':>8}")
    for unit, n in f.rows():
        print(f"{unit:<8}{n:>10g}{BUDGET[unit]:>8}")
    print()
    print(table())


if __name__ == "__main__":
    main()
