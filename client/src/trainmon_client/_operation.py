"""A monitoring operation of a run (:meth:`Run.track`): the handle that times it.

The handle only keeps its name and when it started; the run sends and counts
(``Run._track_begin`` sends the TRACK record that says it runs and returns its name's id,
``Run._track_end`` adds the time to its totals and sends them). ``_perf``
(``time.perf_counter``) is read through this module global at call time, as the run's clocks
are.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainmon_client._run import Run

__all__ = ["Operation"]

_perf = time.perf_counter


class Operation:
    """A monitoring operation of a run, from :meth:`Run.track`: timed between start and stop.

    Use it as a context manager (``with run.track("validation"):``), or call :meth:`start`
    and :meth:`stop` where one block cannot span it (callbacks: one hook starts it, a later
    one stops it). :meth:`start` on a running operation and :meth:`stop` on a stopped one do
    nothing; stopped, it can start again. Neither raises; a refused name is counted once per
    :meth:`start` (:attr:`Run.refused`) and the operation does not run.

    Example:
        >>> from trainmon_client import init
        >>> run = init(run="doc", socket_path="/nonexistent/x.sock")
        >>> sampling = run.track("sampling")
        >>> sampling.start()
        >>> sampling.running
        True
        >>> sampling.stop()
    """

    __slots__ = ("_field_id", "_run", "_t0", "name")

    def __init__(self, run: Run, name: str) -> None:
        self._run = run
        self.name = name
        """The operation's name."""
        self._field_id = 0  # its name's id while it runs, else 0
        self._t0 = 0.0

    @property
    def running(self) -> bool:
        """Whether it was started (and the exporter told) and not stopped since."""
        return self._field_id != 0

    def start(self) -> None:
        """Tell the exporter the operation runs now (sent at once, about 0.1 ms)."""
        if not self._field_id:
            self._field_id = self._run._track_begin(self.name)
            self._t0 = _perf()

    def stop(self) -> None:
        """Add the time since :meth:`start` to the operation's totals and send them at once."""
        field_id = self._field_id
        if field_id:
            self._field_id = 0
            self._run._track_end(field_id, _perf() - self._t0)

    def __enter__(self) -> Operation:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()  # the block's own exception propagates
