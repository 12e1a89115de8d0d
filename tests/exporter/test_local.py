"""LocalExporter: the throw-away exporter of notebooks, demos and benchmarks."""

from __future__ import annotations

from pathlib import Path

import psutil

from trainmon_exporter.local import LocalExporter


def _exporters_on(socket_path: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "trainmon_exporter" in cmd and socket_path in cmd:
            found.append(p)
    return found


def test_start_twice_keeps_one_process_and_stop_ends_it() -> None:
    ex = LocalExporter()
    try:
        with ex.start() as same:  # __enter__ starts it again: must be the same process
            assert same is ex
            assert same.get_json("/readyz")["status"] == "ready"
            procs = _exporters_on(ex.socket)
            assert len(procs) == 1, procs
            assert ex.proc is not None and procs[0].pid == ex.proc.pid
    finally:
        ex.stop()
    assert _exporters_on(ex.socket) == []
    assert not Path(ex.socket).parent.exists()
