"""The docs follow one rule for the socket: no setting where the shared default applies.

The exporter and the client pick the same default socket (``default_socket()``); a command in
the docs that sets ``TRAINMON_SOCKET`` to a path of its own sends its steps nowhere unless the
exporter beside it was started with ``--socket`` and the same path. Every command the docs
show, in fenced blocks (indented ones too) and in inline code, is checked here.
"""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.helpers.checkout import tracked

DOCS = [ROOT / "README.md", *tracked("docs/*.md"), ROOT / "secrets" / "README.md"]
FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
# TRAINMON_SOCKET=VALUE as an assignment (a variable named TRAINMON_SOCKET_* is another setting)
ASSIGN = re.compile(r"(?<![\w-])TRAINMON_SOCKET=(\S+)")
PLACEHOLDER = re.compile(r"[A-Z_]+|…|\.\.\.|<[^>]*>|\$\{?\w+\}?")


def code_of(text: str) -> list[str]:
    """Every line of code in a markdown text: fenced lines, then inline code spans."""
    fenced = [ln for m in FENCE.finditer(text) for ln in m[1].splitlines()]
    prose = FENCE.sub("", text)
    return fenced + INLINE.findall(prose)


def socket_assignments(text: str) -> list[str]:
    return [m[1].strip("\"'`;,") for line in code_of(text) for m in ASSIGN.finditer(line)]


def exporter_sockets(text: str) -> set[str]:
    """``--socket`` values of the exporter commands the document shows."""
    out = set()
    for line in code_of(text):
        if "trainmon-exporter" not in line and "trainmon_exporter" not in line:
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            words = line.split()
        for flag, value in itertools.pairwise(words):
            if flag == "--socket":
                out.add(value)
        out |= {w.split("=", 1)[1] for w in words if w.startswith("--socket=")}
    return out


def misplaced(text: str) -> list[str]:
    """``TRAINMON_SOCKET`` values that no exporter command of the same text listens on."""
    listening = exporter_sockets(text)
    return [
        v for v in socket_assignments(text) if not PLACEHOLDER.fullmatch(v) and v not in listening
    ]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_command_sets_a_socket_its_exporter_does_not_use(doc: Path) -> None:
    assert misplaced(doc.read_text()) == [], (
        f"{doc.name}: TRAINMON_SOCKET set to a path no exporter command there uses; leave it out "
        "(both sides share the default) or start the exporter with --socket and that path"
    )


def test_the_check_sees_a_mismatch() -> None:
    # What the README once said: the exporter on its default, the trainers on another path.
    text = (
        "```sh\ntrainmon-exporter --listen 0.0.0.0:9478\n```\n\n"
        "```sh\nTRAINMON_SOCKET=~/.trainmon/trainmon.sock torchrun --standalone x.py\n```\n"
    )
    assert misplaced(text) == ["~/.trainmon/trainmon.sock"]
    indented = "1. Start:\n\n   ```sh\n   TRAINMON_SOCKET=/srv/t.sock python x.py\n   ```\n"
    assert misplaced(indented) == ["/srv/t.sock"]
    assert misplaced("Trainers use `TRAINMON_SOCKET=/srv/t.sock`.") == ["/srv/t.sock"]
    same = (
        "```sh\ntrainmon-exporter --socket /srv/t.sock &\n"
        "TRAINMON_SOCKET=/srv/t.sock python x.py\n```"
    )
    assert misplaced(same) == []
    assert misplaced("pass `TRAINMON_SOCKET=PATH` to the trainers") == []
    assert misplaced("`TRAINMON_SOCKET_GROUP=hpcusers`") == []


def test_single_node_torchrun_commands_are_standalone() -> None:
    """``torchrun`` without ``--standalone`` (or a rendezvous of its own) waits for a rendezvous
    at localhost:29400 that nothing serves."""
    for doc in DOCS:
        for line in code_of(doc.read_text()):
            if re.match(r"(?:[A-Z_]+=\S+\s+)*torchrun\s", line.strip()):
                assert re.search(r"--standalone|--rdzv[-_]endpoint|--master[-_]addr", line), (
                    doc.name,
                    line,
                )
