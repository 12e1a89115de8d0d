"""``trainmon status`` moved to :mod:`trainmon_exporter.views.terminal`.

Kept for ``trainmon`` console scripts written before the move (an editable install's script
imports ``trainmon_exporter.status:cli`` until the package is installed again).
"""

from trainmon_exporter.views.terminal import cli, main

__all__ = ["cli", "main"]
