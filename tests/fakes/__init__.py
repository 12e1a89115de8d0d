"""Fakes of what the exporter reads: NVML as a Python backend and as a compiled library."""
