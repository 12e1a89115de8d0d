"""Run the real sampler and GPU collectors once against whichever libnvidia-ml.so.1 loads.

    LD_LIBRARY_PATH=DIR FAKE_NVML_CONFIG=CFG python -m tests.fakes.libnvml.probe [passes]

Builds an exporter (:func:`trainmon_exporter.app.build_exporter`, real
:class:`~trainmon_exporter.nvml.PynvmlBackend`, nothing started), opens NVML, runs ``passes``
sampling passes (3 by default: GPM needs two) and prints one JSON object: the sampler's
state, GPU count, read errors, which symbols of ``BRANCH_SYMBOLS``' union the library
exports, and the ``/metrics`` exposition. The log (INFO and up) goes to stderr. A pass that
raises ends the process with a traceback: the caller sees a non-zero exit. Run in a
subprocess because a process holds one libnvidia-ml.so.1.
"""

from __future__ import annotations

import ctypes
import json
import logging
import sys
import tempfile
from pathlib import Path

from prometheus_client.exposition import generate_latest

from tests.fakes.libnvml import BRANCH_SYMBOLS
from trainmon_exporter.app import build_exporter
from trainmon_exporter.settings import Settings


def main(passes: int) -> None:
    """Print the probe's JSON on stdout (see the module docstring)."""
    ex = build_exporter(Settings(socket=Path(tempfile.mkdtemp()) / "probe.sock"))
    sampler = ex.gpus
    assert sampler is not None
    opened = sampler.open()
    snap = sampler.snapshot
    for _ in range(passes if opened else 0):
        snap = sampler.sample_once()
    lib = ctypes.CDLL("libnvidia-ml.so.1")
    every = frozenset().union(*BRANCH_SYMBOLS.values())
    exported = sorted(name for name in every if hasattr(lib, name))
    text = generate_latest(ex.registry).decode()
    sampler.stop()
    print(
        json.dumps(
            {
                "opened": opened,
                "state": snap.state,
                "gpus": len(snap.gpus),
                "read_errors": {k: v for k, v in snap.read_errors.items() if v},
                "lost": snap.lost_total,
                "exported": exported,
                "exposition": text,
            }
        )
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
