"""Defaults that parts without the settings model need (the settings module re-exports them).

``trainmon status`` reads the exporter's default address from here: importing
:mod:`trainmon_exporter.settings` would load pydantic-settings, which the terminal has no use for.
"""

DEFAULT_PORT = 9478
"""The exporter's HTTP port (``--listen`` default ``127.0.0.1:9478``)."""
