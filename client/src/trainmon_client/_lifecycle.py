"""Process hooks over the live runs: interpreter exit, ``fork()``, and uncaught exceptions.

- **Exit:** each live run has its own ``atexit`` hook, registered when it starts and removed by
  :func:`detach` when it finishes, which calls ``finish(failed=...)``: failed when the
  interpreter is dying of an uncaught exception. Per-run hooks keep the order the user sees:
  a run finishes before the ``atexit`` hooks registered before it started.
- **Uncaught exceptions:** ``sys.excepthook`` is chained once, at import: the previous hook
  still runs; trainmon only remembers that it happened (:func:`died_of_exception`).
- **Fork:** ``os.register_at_fork`` disables every live run in the child (e.g. a DataLoader
  worker), which shares the parent's socket: it must never write to it, nor send FINISH at
  exit.

The hooks know runs only through :class:`LiveRun`, not as ``Run``: this module imports
nothing of the client's.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Protocol

__all__ = ["LiveRun", "attach", "detach", "died_of_exception"]


class LiveRun(Protocol):
    """What the process hooks need of a run."""

    def finish(self, *, failed: bool = False) -> None:
        """Send what is left and a FINISH record; ``failed``: the process dies of an error."""

    def _disable_in_child(self) -> None:
        """In a forked child: stop for good, without touching the parent's socket or threads.

        Underscored: it is for this module, not for training code.
        """


_live: dict[LiveRun, Callable[[], None]] = {}  # each live run and its atexit hook
_uncaught_exception = False


def died_of_exception() -> bool:
    """Whether an uncaught exception reached ``sys.excepthook`` (the interpreter is dying)."""
    return _uncaught_exception


def attach(run: LiveRun) -> None:
    """Hook a run that starts: finish it at exit, disable it in forked children."""

    def at_exit() -> None:
        run.finish(failed=_uncaught_exception)

    _live[run] = at_exit
    atexit.register(at_exit)


def detach(run: LiveRun) -> None:
    """Unhook a run that finished (idempotent)."""
    at_exit = _live.pop(run, None)
    if at_exit is not None:
        atexit.unregister(at_exit)


def _chain_excepthook() -> None:
    """Remember whether the interpreter dies of an uncaught exception (FINISH status)."""
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        global _uncaught_exception
        _uncaught_exception = True
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def _after_fork_in_child() -> None:
    for run in list(_live):
        run._disable_in_child()


_chain_excepthook()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
