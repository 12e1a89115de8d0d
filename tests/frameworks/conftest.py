"""Isolation for the framework tests: Lightning and transformers change process-wide state.

Lightning's teardown resets the SIGINT handler to SIG_DFL (``_destroy_dist_connection``), and
both frameworks set environment variables (``PL_GLOBAL_SEED``, ``MASTER_ADDR``...) that later
tests' subprocesses would inherit. Restore both after each test.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator

import pytest

from trainmon_client import _autorun

from ..conftest import InProcessExporter


@pytest.fixture(autouse=True)
def restore_process_state() -> Iterator[None]:
    env = dict(os.environ)
    handler = signal.getsignal(signal.SIGINT)
    yield
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGINT, handler)


@pytest.fixture
def hooks() -> Iterator[_autorun.Instrumenter]:
    """``trainmon-run``'s instrumentation in this process (as its ``sitecustomize`` installs
    it), removed after the test."""
    ins = _autorun.install({_autorun.ENV_AUTORUN: "1"})
    assert ins is not None
    yield ins
    ins.uninstall()


@pytest.fixture
def exporter(
    make_exporter: Callable[..., InProcessExporter], monkeypatch: pytest.MonkeyPatch
) -> InProcessExporter:
    """An exporter without GPU collectors, which this process's runs report to."""
    ex = make_exporter(**{"collectors": {"gpu": False, "rank_gpu": False}})
    monkeypatch.setenv("TRAINMON_SOCKET", ex.socket)
    return ex
