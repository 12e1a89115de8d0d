"""``trainmon-run``'s bootstrap, imported by Python's :mod:`site` before the program runs.

Python imports it at the start of every Python process that ``trainmon-run`` starts, and of
every Python process those start in turn.

``trainmon-run`` puts this file's directory first on ``PYTHONPATH`` and sets
``TRAINMON_AUTORUN=1``, as ``opentelemetry-instrument`` and ``ddtrace-run`` do with their own
``sitecustomize``. This module then:

1. installs :mod:`trainmon_client._autorun` (an import hook that waits for ``torch``; nothing
   is imported here but the client's own modules), unless ``TRAINMON_AUTORUN`` is not ``1``;
2. takes its directory off ``sys.path`` again, so that the program's ``sys.path`` is the one it
   would have had (children still inherit ``PYTHONPATH``);
3. runs the ``sitecustomize`` this one hides, if there is one further along ``sys.path`` (a
   distribution's or a virtual environment's), as Python would have.

It never raises into the program: a failure is printed as one line on stderr, the way Python
reports a broken ``sitecustomize``, and the program runs without trainmon.
"""

import os
import sys


def _boot() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        if os.environ.get("TRAINMON_AUTORUN") == "1":
            try:
                from trainmon_client import _autorun
            except ImportError:
                # Another environment's Python (no trainmon-client there): only the process
                # trainmon-run started itself says so, not every other process it starts.
                if os.environ.get("TRAINMON_AUTORUN_PID") == str(os.getpid()):
                    print(
                        "trainmon-run: trainmon-client is not installed for "
                        f"{sys.executable}; the program runs without trainmon",
                        file=sys.stderr,
                    )
            else:
                _autorun.install()
    except Exception as e:  # never break the program
        print(f"trainmon-run: instrumentation failed ({e!r}); running without", file=sys.stderr)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    _chain(here)


def _chain(here: str) -> None:
    """Import the next ``sitecustomize`` on ``sys.path`` (ours is taken off it by now)."""
    mine = sys.modules.pop("sitecustomize", None)
    try:
        import importlib.util

        spec = importlib.util.find_spec("sitecustomize")
        if spec is None or spec.origin is None or os.path.dirname(spec.origin) == here:
            return
        import importlib

        importlib.import_module("sitecustomize")
    except Exception as e:
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{e!r}", file=sys.stderr)
    finally:
        if "sitecustomize" not in sys.modules and mine is not None:
            sys.modules["sitecustomize"] = mine


_boot()
