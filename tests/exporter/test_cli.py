"""The CLI as a user meets it: --help, one-line errors, clean shutdown."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from trainmon_exporter.cli import COMMON_FLAGS, exposure_warning
from trainmon_exporter.settings import Settings

from ..conftest import ExporterProcess, free_port, short_tmpdir, wait_for


def run_cli(
    *args: str, timeout: float = 30, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainmon_exporter", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=None if env is None else {**os.environ, **env},
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


def run_cli_to(stdout: str, stderr: str, *args: str) -> tuple[int, str]:
    """Run the CLI with stdout and stderr opened on the given paths; (exit code, stderr)."""
    d = short_tmpdir()
    err_path = d / "stderr" if stderr == "file" else Path(stderr)
    with open(stdout, "wb") as out, open(err_path, "wb") as err:
        code = subprocess.run(
            [sys.executable, "-m", "trainmon_exporter", *args],
            stdout=out,
            stderr=err,
            timeout=30,
            check=False,
        ).returncode
    text = err_path.read_text() if stderr == "file" else ""
    return code, text


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("what", ["serve", "--version", "--help"])
def test_full_stdout_is_one_line_and_exit_2(what: str) -> None:
    d = short_tmpdir()
    args = (
        ["--socket", str(d / "t.sock"), "--listen", f"127.0.0.1:{free_port()}"]
        if what == "serve"
        else [what]
    )
    code, err = run_cli_to("/dev/full", "file", *args)
    assert code == 2
    assert (
        err
        == "trainmon-exporter: error: cannot write to standard output: No space left on device\n"
    )
    if what == "serve":
        assert not (d / "t.sock").exists()  # the ingest socket it had created is removed
    # stderr on the full disk too: the line is lost, the exit code still says it
    code, _ = run_cli_to("/dev/full", "/dev/full", *args)
    assert code == 2


@pytest.mark.parametrize(
    ("argv", "suggestion"),
    [
        (["--listne", "127.0.0.1:1"], "did you mean --listen?"),
        (["--series-ttl", "60"], "did you mean --series-ttl-seconds?"),  # no abbreviations
        (["--analytics.hang-factr=3"], "did you mean --analytics.hang-factor?"),
        (["--colectors.gpu"], "did you mean --collectors.gpu?"),
    ],
)
def test_unknown_flag_is_one_line_with_a_suggestion(argv: list[str], suggestion: str) -> None:
    out = run_cli(*argv)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("trainmon-exporter: error: unrecognized arguments: " + argv[0])
    assert suggestion in out.stderr and "--help" in out.stderr


def test_help_puts_the_common_flags_first() -> None:
    out = run_cli("--help").stdout
    sections = re.findall(r"^(\w[\w ]*):$", out, re.MULTILINE)
    assert sections[:2] == ["common options", "more options"]
    common = out.split("common options:")[1].split("more options:")[0]
    assert common.startswith("\n  -h, --help")
    flags = re.findall(r"^  (--[\w.-]+)", common, re.MULTILINE)
    assert sorted(flags) == sorted("--" + f.replace("_", "-") for f in ("version", *COMMON_FLAGS))
    assert out.startswith("usage: trainmon-exporter [--listen HOST:PORT] [--socket PATH]")
    assert out.count("\nusage") == 0 and "--series-ttl-seconds SECONDS" in out
    assert "default factory" not in out and "tuple[" not in out


@pytest.mark.parametrize(
    ("argv", "env", "line"),
    [
        (
            ["--series-ttl-seconds", "10m"],
            {},
            "--series-ttl-seconds '10m': input should be a valid number, unable to parse string "
            "as a number; expected a number of seconds > 0 and <= 604800\n",
        ),
        (
            [],
            {"TRAINMON_SERIES_TTL_SECONDS": "10m"},
            "TRAINMON_SERIES_TTL_SECONDS (environment) '10m': input should be a valid number",
        ),
        (
            ["--analytics.hang-factor=-1"],
            {},
            "--analytics.hang-factor '-1': input should be greater than 0; expected a number > 0 "
            "and <= 1000\n",
        ),
        (
            ["--analytics", '{"ema_decay": 3}'],
            {},
            "--analytics 3: input should be less than 1; expected a number > 0 and < 1",
        ),
        (
            [],
            {"trainmon_max_ranks": "0"},  # read case-insensitively, named as it was set
            "trainmon_max_ranks (environment) '0': input should be greater than or equal to 1; "
            "expected a whole number >= 1 and <= 65536\n",
        ),
        (
            ["--ingest-max-bytes-per-second", "4M"],
            {},
            "--ingest-max-bytes-per-second '4M': input should be a valid number, unable to parse "
            "string as a number; expected a number of bytes per second > 0 and <= 1073741824\n",
        ),
        (
            ["--analytics.window-steps", "1e9"],
            {},
            "--analytics.window-steps '1e9': input should be a valid integer, unable to parse "
            "string as an integer; expected a whole number of steps >= 5 and <= 10000\n",
        ),
        (
            ["--step-duration-buckets", "[1, 0.5]"],
            {},
            "--step-duration-buckets: buckets must be positive and strictly increasing",
        ),
    ],
)
def test_invalid_value_names_the_flag_or_variable_given(
    argv: list[str], env: dict[str, str], line: str
) -> None:
    out = run_cli(*argv, env=env)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("trainmon-exporter: error: " + line), out.stderr


def test_listening_beyond_loopback_says_what_it_exposes(
    exporter_process: Callable[..., ExporterProcess],
) -> None:
    port = free_port()
    out = exporter_process("--listen", f"0.0.0.0:{port}", port=port).start().stop(signal.SIGTERM)
    lines = [line for line in out.splitlines() if "readable by anyone" in line]
    assert len(lines) == 1, out
    assert f" WARNING trainmon_exporter: HTTP listens on 0.0.0.0:{port} (every network " in lines[0]
    assert "every run's metrics, the status page and the JSON API" in lines[0]
    quiet = exporter_process().start().stop(signal.SIGTERM)  # 127.0.0.1: not a word
    assert "readable by anyone" not in quiet


@pytest.mark.parametrize(
    ("address", "exposed"),
    [
        ("127.0.0.1", False),
        ("127.0.0.2", False),
        ("::1", False),
        ("::ffff:127.0.0.1", False),
        ("0.0.0.0", True),
        ("::", True),
        ("10.1.2.3", True),
        ("fe80::1%eth0", True),
    ],
)
def test_which_addresses_are_beyond_this_host(address: str, exposed: bool) -> None:
    assert (exposure_warning(address, f"{address}:9478") is not None) is exposed
