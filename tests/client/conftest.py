"""Fixtures of the client tests: a short socket directory and a listener in it."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..conftest import short_tmpdir
from ..helpers.client import Listener


@pytest.fixture
def sockdir() -> Iterator[Path]:
    d = short_tmpdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def listener(sockdir: Path) -> Iterator[Listener]:
    lst = Listener(sockdir / "t.sock")
    yield lst
    lst.close()
