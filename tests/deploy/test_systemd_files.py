"""deploy/systemd, the shared set-up (one exporter, many local users), without systemd as init:
the unit passes ``systemd-analyze verify``, the tmpfiles.d line makes the directory the unit
and both sides' default socket expect, and docs/exporter.md shows the unit's own commands."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainmon_client._env import DEFAULT_SOCKET

from ..conftest import ROOT, require_tool

SYSTEMD = ROOT / "deploy" / "systemd"
UNIT = SYSTEMD / "trainmon-exporter.service"
TMPFILES = SYSTEMD / "trainmon.conf"
PROGRAM = "/opt/trainmon/bin/trainmon-exporter"


def setting(unit: str, key: str) -> str:
    values = re.findall(rf"^{key}=(.*)$", unit, re.M)
    assert len(values) == 1, (key, values)
    return values[0]


def verify(text: str, tmp_path: Path) -> str:
    """``systemd-analyze verify`` of a unit: a line per unknown directive or invalid value."""
    analyze = require_tool("systemd-analyze", "systemd")
    path = tmp_path / UNIT.name
    path.write_text(text.replace(PROGRAM, sys.executable))  # a program that exists here
    out = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True)
    return (out.stdout + out.stderr).strip()


def test_the_unit_verifies(tmp_path: Path) -> None:
    unit = UNIT.read_text()
    assert verify(unit, tmp_path) == ""
    misspelt = unit.replace("\nNoNewPrivileges=yes", "\nNoNewPrivilege=yes")
    assert "NoNewPrivilege" in verify(misspelt, tmp_path)  # the check does catch a typo


def test_the_unit_serves_the_shared_default_socket_on_loopback() -> None:
    unit = UNIT.read_text()
    argv = setting(unit, "ExecStart").split()
    assert argv[0] == PROGRAM
    assert argv[argv.index("--socket") + 1] == DEFAULT_SOCKET  # trainers need no setting
    assert argv[argv.index("--listen") + 1].startswith("127.0.0.1:")
    assert (setting(unit, "User"), setting(unit, "Group")) == ("trainmon", "trainmon")
    assert setting(unit, "RuntimeDirectory") == Path(DEFAULT_SOCKET).parent.name
    assert "\nPrivateDevices=yes" not in unit  # it would hide /dev/nvidia* from NVML


@pytest.mark.uid
def test_tmpfiles_makes_the_directory_of_the_unit(tmp_path: Path) -> None:
    """``systemd-tmpfiles --create`` into a scratch root whose passwd has the user (another uid
    as root; a normal user can only give a directory to itself, so there it names its own)."""
    lines = [ln for ln in TMPFILES.read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines == [f"d {Path(DEFAULT_SOCKET).parent} 0755 trainmon trainmon -"]
    tmpfiles = shutil.which("systemd-tmpfiles")
    if tmpfiles is None:
        pytest.skip("systemd-tmpfiles not installed (Debian package systemd)")
    uid, gid = (43210, 43211) if os.geteuid() == 0 else (os.geteuid(), os.getegid())
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text(f"trainmon:x:{uid}:{gid}::/nonexistent:/bin/false\n")
    (tmp_path / "etc" / "group").write_text(f"trainmon:x:{gid}:\n")
    out = subprocess.run(
        [tmpfiles, "--create", f"--root={tmp_path}", str(TMPFILES)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    made = (tmp_path / Path(DEFAULT_SOCKET).parent.relative_to("/")).stat()
    assert oct(made.st_mode & 0o7777) == "0o755"
    assert (made.st_uid, made.st_gid) == (uid, gid)


def test_the_docs_show_the_units_commands() -> None:
    """The commands in the unit's header are the ones docs/exporter.md gives to copy."""
    header = [
        ln.removeprefix("#").strip()
        for ln in UNIT.read_text().split("[Unit]")[0].splitlines()
        if ln.startswith("#   ")
    ]
    commands = [re.sub(r"\s+#.*$", "", c) for c in header]
    assert len(commands) >= 6
    docs = (ROOT / "docs" / "exporter.md").read_text()
    for command in commands:
        assert command in docs, command
