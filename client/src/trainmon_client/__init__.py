"""trainmon client: report training steps to the node's trainmon exporter in two lines.

Example:
    >>> import trainmon_client
    >>> run = trainmon_client.init(run="gpt2-124m", socket_path="/nonexistent/t.sock")
    >>> run.log(1, loss=3.2, lr=6e-4, tokens=524288)
    >>> run.finish()

Zero runtime dependencies; torch is only touched when the caller passes a tensor or has
already initialised CUDA. See docs/client.md.

The public names are loaded on first use (PEP 562), so that ``trainmon-run``'s bootstrap,
which imports :mod:`trainmon_client._autorun` in every Python process it starts, does not pay
for the whole client in processes that never train.
"""

from __future__ import annotations

from trainmon_client._version import __version__

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing itself is not imported: see above
    from typing import Any

    from trainmon_client._protocol import PROTOCOL_VERSION
    from trainmon_client._run import Operation, Run, init

__all__ = ["PROTOCOL_VERSION", "Operation", "Run", "__version__", "init"]


def __getattr__(name: str) -> Any:
    if name == "PROTOCOL_VERSION":
        from trainmon_client._protocol import PROTOCOL_VERSION

        return PROTOCOL_VERSION
    if name in ("Operation", "Run", "init"):
        from trainmon_client import _run

        return getattr(_run, name)
    raise AttributeError(f"module 'trainmon_client' has no attribute {name!r}")
