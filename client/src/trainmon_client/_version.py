"""The version of trainmon: the one place it is written.

Both distributions read it at build time (``trainmon-client`` from here, ``trainmon-exporter``
through its ``_version.py``, a link to this file); CHANGELOG.md says what each version changed.
"""

__version__ = "0.1.0"
