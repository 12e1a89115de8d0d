"""What people see: one view model, three ways to show it.

- :mod:`~trainmon_exporter.views.api`: the view model (pydantic) and the builders that fill
  it from the store and the NVML sampler; served as JSON at ``/api/v1/runs`` and
  ``/api/v1/gpus``.
- :mod:`~trainmon_exporter.views.html`: the status page at ``/``.
- :mod:`~trainmon_exporter.views.terminal`: ``trainmon status``, an HTTP client of the JSON
  API that parses it back into the same models.
- :mod:`~trainmon_exporter.views.cells`: how a value is written in a cell, shared by the page
  and the terminal.

``trainmon status`` runs without the daemon: ``api``, ``cells`` and ``terminal`` import
neither FastAPI, uvicorn, prometheus_client nor pynvml (tests/exporter/test_imports.py).
"""
