"""The CLI as a user meets it: --help, one-line errors, clean shutdown."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from trainmon_exporter.settings import Settings

from ..conftest import ExporterProcess, free_port, short_tmpdir, wait_for


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainmon_exporter", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_help_documents_every_setting() -> None:
    out = run_cli("--help")
    assert out.returncode == 0
    for name in Settings.model_fields:
        if name != "collectors":
            assert "--" + name.replace("_", "-") in out.stdout, name
    for name in Settings.model_fields["collectors"].annotation.model_fields:  # type: ignore[union-attr]
        assert f"--collectors.{name.replace('_', '-')}" in out.stdout
    assert "TRAINMON_" in out.stdout


def test_invalid_setting_is_one_line() -> None:
    out = run_cli("--listen", "nonsense")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "listen" in out.stderr
    assert "Traceback" not in out.stderr


def test_port_in_use_is_one_actionable_line() -> None:
    d = short_tmpdir()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = run_cli("--listen", f"127.0.0.1:{port}", "--socket", str(d / "t.sock"))
    assert out.returncode == 2
    assert "already in use" in out.stderr and "--listen" in out.stderr
    assert "Traceback" not in out.stderr
    assert list(d.iterdir()) == []  # the ingest socket it had created, and its lock, removed


@pytest.mark.uid
@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_socket_directory_non_root(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    out = run_cli("--socket", str(ro / "t.sock"), "--listen", f"127.0.0.1:{free_port()}")
    assert out.returncode == 2 and "--socket" in out.stderr


def test_socket_directory_that_cannot_exist() -> None:
    out = run_cli("--socket", "/proc/self/trainmon/t.sock", "--listen", f"127.0.0.1:{free_port()}")
    assert out.returncode == 2
    assert "--socket" in out.stderr and "Traceback" not in out.stderr


def test_second_exporter_on_the_same_socket_is_refused(
    exporter_process: Callable[..., ExporterProcess],
) -> None:
    first = exporter_process().start()
    out = run_cli("--socket", first.socket, "--listen", f"127.0.0.1:{free_port()}")
    assert out.returncode == 2 and "another exporter" in out.stderr
    assert first.ready()


def test_stale_socket_is_replaced_and_sigterm_removes_it(
    exporter_process: Callable[..., ExporterProcess],
) -> None:
    d = short_tmpdir()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(str(d / "t.sock"))  # a leftover socket file nobody listens on
    stale.close()
    ex = exporter_process(socket_dir=d).start()
    assert Path(ex.socket).exists()
    out = ex.stop(signal.SIGTERM)
    assert not Path(ex.socket).exists()
    assert "Traceback" not in out


def test_sigint_shuts_down_cleanly(exporter_process: Callable[..., ExporterProcess]) -> None:
    ex = exporter_process().start()
    out = ex.stop(signal.SIGINT)
    assert not Path(ex.socket).exists() and "Traceback" not in out
    wait_for(lambda: ex.proc is not None and ex.proc.poll() is not None)
