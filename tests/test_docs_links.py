"""Every relative link in the Markdown files resolves: the file exists, and its ``#anchor``
names a heading of that file (as GitHub makes anchors from headings)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.helpers.checkout import ignored_file, tracked

FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```[^\n]*$", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
EXPLICIT = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def markdown_files() -> list[Path]:
    """Every Markdown file git tracks (never a package's, in a virtual environment)."""
    return tracked("**/*.md")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)  # keeps letters, digits, _, -, spaces
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Anchors of a Markdown file; a repeated heading gets -1, -2... as on GitHub."""
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    out = set(EXPLICIT.findall(text))
    for heading in HEADING.findall(text):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    out = []
    text = FENCE.sub("", path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            out.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{target}: no heading #{anchor} in {file_part or path.name}")
    return out


def test_what_git_ignores_is_not_followed() -> None:
    """A package's README in ``.venv-demo`` (``make demo``) links to files it does not ship."""
    with ignored_file(".venv-demo/lib/tm-stray/README.md", "[gone](missing.md)\n") as path:
        assert path not in markdown_files()


def test_the_markdown_files_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in markdown_files()}
    assert {"README.md", "docs/reliability.md", "CHANGELOG.md"} <= names


@pytest.mark.parametrize("doc", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_resolves(doc: Path) -> None:
    assert broken_links(doc) == []


def test_slugs_follow_github() -> None:
    assert slug("Who may write") == "who-may-write"
    assert slug("`log()` and `finish()` in each fault") == "log-and-finish-in-each-fault"
    assert slug("CUDA tensors: no synchronisation") == "cuda-tensors-no-synchronisation"
    assert slug("Hugging Face `transformers.Trainer`") == "hugging-face-transformerstrainer"
    assert slug("An agent forwards, the store evaluates") == "an-agent-forwards-the-store-evaluates"


def test_a_broken_anchor_is_seen(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Title\n\n## Who may write\n\n```sh\n# not a heading\n```\n")
    doc = tmp_path / "b.md"
    doc.write_text(
        "[ok](a.md#who-may-write) [bad](a.md#not-a-heading) [self](#here) [gone](c.md)\n"
        "[web](https://example.com/#x) `[code](a.md#nope)`\n"
    )
    assert broken_links(doc) == [
        "a.md#not-a-heading: no heading #not-a-heading in a.md",
        "#here: no heading #here in b.md",
        "c.md: no such file",
    ]
