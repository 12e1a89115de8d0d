"""Isolation for the framework tests: Lightning and transformers change process-wide state.

Lightning's teardown resets the SIGINT handler to SIG_DFL (``_destroy_dist_connection``), and
both frameworks set environment variables (``PL_GLOBAL_SEED``, ``MASTER_ADDR``...) that later
tests' subprocesses would inherit. Restore both after each test.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def restore_process_state() -> Iterator[None]:
    env = dict(os.environ)
    handler = signal.getsignal(signal.SIGINT)
    yield
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGINT, handler)
