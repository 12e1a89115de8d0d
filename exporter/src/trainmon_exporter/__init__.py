"""trainmon exporter: the per-node sidecar that turns training steps into Prometheus metrics.

Public surface: :func:`create_app`, :class:`Settings` and :func:`main` (the CLI).

They are loaded on first use (PEP 562), so importing a submodule costs only what that
submodule needs: ``trainmon status`` loads neither FastAPI, uvicorn, prometheus_client nor
pynvml.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from trainmon_exporter._version import __version__

if TYPE_CHECKING:
    from trainmon_exporter.app import create_app
    from trainmon_exporter.cli import main
    from trainmon_exporter.settings import Settings

__all__ = ["Settings", "__version__", "create_app", "main"]

_LAZY = {
    "create_app": "trainmon_exporter.app",
    "main": "trainmon_exporter.cli",
    "Settings": "trainmon_exporter.settings",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
