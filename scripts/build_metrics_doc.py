"""Write the metric tables of docs/metrics.md from the metric catalog.

    python scripts/build_metrics_doc.py          # rewrite the tables in docs/metrics.md
    python scripts/build_metrics_doc.py --check  # exit 1 if they are stale

The rows come from ``trainmon_exporter.catalog`` (one table per ``catalog.SECTIONS`` entry,
:func:`trainmon_exporter.catalog.markdown_table`). Each table sits between the markers
``<!-- catalog: NAME ... -->`` and ``<!-- end catalog: NAME -->``; the prose around them is
written by hand and kept as it is. ``tests/exporter/test_docs.py`` fails when the committed
file differs from what this writes.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from trainmon_exporter.catalog import SECTIONS, markdown_table

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
BLOCK = re.compile(r"(<!-- catalog: (\w+)[^\n]*-->\n)(.*?)(<!-- end catalog: \2 -->)", re.S)


def render(text: str) -> str:
    """``text`` (docs/metrics.md) with every marked table rebuilt from the catalog."""
    found = [m[2] for m in BLOCK.finditer(text)]
    if sorted(found) != sorted(SECTIONS) or len(set(found)) != len(found):
        raise ValueError(f"docs/metrics.md marks tables {found}, the catalog has {list(SECTIONS)}")
    return BLOCK.sub(lambda m: f"{m[1]}\n{markdown_table(SECTIONS[m[2]])}\n{m[4]}", text)


def main(argv: list[str] | None = None) -> int:
    """Rewrite docs/metrics.md, or with ``--check`` say whether it is stale."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    args = parser.parse_args(argv)
    old = DOC.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print(f"{DOC} is stale: run python scripts/build_metrics_doc.py", file=sys.stderr)
            return 1
        return 0
    if new != old:
        DOC.write_text(new)
        print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
