"""trainmon exporter: the per-node sidecar that turns training steps into Prometheus metrics.

Public surface: :func:`create_app`, :class:`Settings` and :func:`main` (the CLI).
"""

from __future__ import annotations

from trainmon_exporter._version import __version__
from trainmon_exporter.app import create_app
from trainmon_exporter.cli import main
from trainmon_exporter.settings import Settings

__all__ = ["Settings", "__version__", "create_app", "main"]
