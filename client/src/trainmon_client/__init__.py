"""trainmon client: report training steps to the node's trainmon exporter in two lines.

Example:
    >>> import trainmon_client
    >>> run = trainmon_client.init(run="gpt2-124m", socket_path="/nonexistent/t.sock")
    >>> run.log(1, loss=3.2, lr=6e-4, tokens=524288)
    >>> run.finish()

Zero runtime dependencies; torch is only touched when the caller passes a tensor or has
already initialised CUDA. See docs/client.md.
"""

from __future__ import annotations

from trainmon_client._operation import Operation
from trainmon_client._protocol import PROTOCOL_VERSION
from trainmon_client._run import Run, init
from trainmon_client._version import __version__

__all__ = ["PROTOCOL_VERSION", "Operation", "Run", "__version__", "init"]
