"""The repository speaks of the product only: no internal tracker numbers, work sessions,
lent machines or paths to notes outside the repository.

The user docs (Markdown) are held to every pattern; every other text file git tracks (code,
comments, configuration, scripts, the changelog) to those that cannot be product words there:
"session" is a fine word in code (a golden capture's scripted session, an HTTP session).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.helpers.checkout import ignored_file, tracked

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


def user_docs() -> list[Path]:
    """Every Markdown file a user reads: README.md, docs/, and the READMEs beside the code
    (git tracks them; the tests' own files are not the user's)."""
    return [p for p in tracked("**/*.md") if p.relative_to(ROOT).parts[0] != "tests"]


def text_files() -> list[Path]:
    """Every text file git tracks, except this test's own examples and the goldens."""
    out = []
    for path in tracked():
        name = path.relative_to(ROOT).as_posix()
        if name == "tests/test_docs_words.py" or name.startswith("tests/golden/"):
            continue
        try:
            path.read_text()
        except UnicodeDecodeError:  # binary
            continue
        out.append(path)
    return out


def test_user_docs_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in user_docs()}
    assert {"README.md", "docs/metrics.md", "docs/performance.md"} <= names


def test_what_git_ignores_is_not_judged() -> None:
    """``make demo`` leaves ``.venv-demo`` in the checkout, with the Markdown files of every
    package in it (one of FastAPI's says "session"); a build leaves ``__pycache__``. Neither is
    the repository's: only the files git tracks are judged."""
    text = "An HTTP session, see issue 12 and /work/notes.\n"
    for stray in (".venv-demo/lib/tm-stray/README.md", "docs/__pycache__/tm-stray.md"):
        with ignored_file(stray, text) as path:
            assert path not in user_docs() and path not in text_files()
        assert not path.exists()


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
