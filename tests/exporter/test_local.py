"""LocalExporter: the throw-away exporter of notebooks, demos and benchmarks."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import psutil
import pytest

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


def test_a_given_socket_collected_output_and_an_early_exit() -> None:
    d = Path(tempfile.mkdtemp(prefix="tm-", dir="/tmp"))
    try:
        ex = LocalExporter(socket_path=d / "t.sock", quiet=False, capture_output=True)
        assert ex.socket == str(d / "t.sock")
        ex.start()
        assert Path(ex.socket).exists()
        out = ex.stop()
        assert "metrics on http://127.0.0.1:" in out  # the banner, collected
        assert d.is_dir() and not Path(ex.socket).exists()  # the caller's directory stays
        bad = LocalExporter("--no-such-flag", socket_path=d / "t.sock", capture_output=True)
        with pytest.raises(RuntimeError, match=r"(?s)exited with code 2:.*--no-such-flag"):
            bad.start()
    finally:
        shutil.rmtree(d, ignore_errors=True)
