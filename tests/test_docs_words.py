"""The repository speaks of the product only: no internal tracker numbers, work sessions,
lent machines or paths to notes outside the repository.

The user docs (Markdown) are held to every pattern; every other text file git tracks (code,
comments, configuration, scripts, the changelog) to those that cannot be product words there:
"session" is a fine word in code (a golden capture's scripted session, an HTTP session).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

FORBIDDEN = {
    "an internal issue number": re.compile(r"\bissues?[ -]?#?\d+", re.I),
    "a work session": re.compile(r"\bsessions?\b", re.I),
    "a path outside the repository": re.compile(r"\.\./shared|(?<![\w.~-])/work(?:/|\b)"),
    "the machine-lending tool": re.compile(
        r"\bdevice\W{0,2} tool|\b(?:was|were|be) lent\b|\blent (?:GPU|machine)s?\b", re.I
    ),
    "a notes file outside the repository": re.compile(r"\bDESIGN\.md\b|\bBRIEF\.md\b"),
}
# What no file of the repository says, whatever its kind.
EVERYWHERE = {k: v for k, v in FORBIDDEN.items() if k != "a work session"}
SKIP_DIRS = {".git", ".venv", "node_modules", "tests", ".pytest_cache", ".ruff_cache"}


def user_docs() -> list[Path]:
    """Every Markdown file a user reads: README.md, docs/, and the READMEs beside the code."""
    return sorted(
        p for p in ROOT.rglob("*.md") if not SKIP_DIRS.intersection(p.relative_to(ROOT).parts[:-1])
    )


def text_files() -> list[Path]:
    """Every text file git tracks, except this test's own examples and the goldens."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    out = []
    for name in filter(None, listed.split("\0")):
        path = ROOT / name
        if name == "tests/test_docs_words.py" or name.startswith("tests/golden/"):
            continue
        try:
            path.read_text()
        except (UnicodeDecodeError, OSError):  # binary, or deleted and not yet committed
            continue
        out.append(path)
    return out


def test_user_docs_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in user_docs()}
    assert {"README.md", "docs/metrics.md", "docs/performance.md"} <= names


@pytest.mark.parametrize("doc", user_docs(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_doc_speaks_of_the_product_only(doc: Path) -> None:
    found = [
        f"{doc.relative_to(ROOT)}:{n}: {what}: {m[0]!r}"
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        for what, pattern in FORBIDDEN.items()
        for m in pattern.finditer(line)
    ]
    assert not found, "\n".join(found)


def test_every_file_speaks_of_the_product_only() -> None:
    files = text_files()
    assert len(files) > 100 and ROOT / "CHANGELOG.md" in files and ROOT / "Makefile" in files
    found = [
        f"{path.relative_to(ROOT)}:{n}: {what}: {m[0]!r}"
        for path in files
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for what, pattern in EVERYWHERE.items()
        for m in pattern.finditer(line)
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "# GPU, MFU and memory-pressure alerts (issue 3's series).",
        "# exporter/ (see DESIGN.md).",
        "run on a lent GPU (docs/gpu-validation.md).",
        "Not yet done (issue 5 continues):",
        "No GPU was lent to the sessions that built it",
        "The design notes live in `../shared/DESIGN.md`.",
        "Each session checks the `device` tool first.",
        "see /work/main for details",
    ],
)
def test_the_check_catches_each_kind(line: str) -> None:
    assert any(p.search(line) for p in FORBIDDEN.values()), line


@pytest.mark.parametrize(
    "line",
    [
        '`trainmon_gpu_info{device="nvidia0"}`',
        "mount /run/trainmon into the container's working dir /workspace",
        "an SSH login shell",
    ],
)
def test_the_check_lets_product_words_through(line: str) -> None:
    assert not any(p.search(line) for p in FORBIDDEN.values()), line
