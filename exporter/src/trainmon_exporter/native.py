"""Native stacks of a hung rank with py-spy: the optional extra of ``hang_native_stacks``.

The client's own capture (:mod:`trainmon_client._capture`) needs no ptrace, but it sees
Python frames only, and it cannot answer while native code holds the GIL. ``py-spy dump
--native`` reads the process from outside (``process_vm_readv`` and ptrace): its C, C++ and
Python frames together, GIL or not. It needs py-spy installed, and the right to ptrace the
trainer: the same uid (or ``CAP_SYS_PTRACE``) and a Yama ``ptrace_scope`` that allows it,
which Kubernetes' baseline and restricted pod security levels forbid. So it is off unless
asked for, and every way it can fail is one line the views show.

The process is the rank's connection's peer (``SO_PEERCRED`` pid, in this exporter's PID
namespace). Before it is read, its owner must be the run's owner uid: a pid reused by another
user's process is never read into this run's evidence.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

__all__ = ["DUMP_TIMEOUT_S", "find_py_spy", "py_spy_dump"]

DUMP_TIMEOUT_S = 10.0
"""Longest a ``py-spy dump`` may take (it pauses the process while it unwinds)."""


def find_py_spy() -> str | None:
    """The ``py-spy`` executable on ``PATH`` or beside this Python's, or None."""
    return shutil.which("py-spy") or shutil.which(
        "py-spy", path=os.path.dirname(sys.executable) or None
    )


def py_spy_dump(pid: int | None, owner_uid: int | None, limit: int) -> tuple[str | None, str]:
    """``(py-spy dump --native`` of ``pid`` at most ``limit`` bytes, or None; a note why not).

    Blocking (up to :data:`DUMP_TIMEOUT_S`): call it from a worker thread. Never raises.
    """
    exe = find_py_spy()
    if exe is None:
        return None, "native stacks: py-spy is not installed"
    if pid is None:
        return None, "native stacks: the kernel did not give the trainer's pid (SO_PEERCRED)"
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None, f"native stacks: process {pid} is not visible from the exporter"
    if owner_uid is not None and uid != owner_uid:
        return None, (
            f"native stacks: process {pid} belongs to uid {uid}, not the run's uid {owner_uid}"
        )
    try:
        out = subprocess.run(
            [exe, "dump", "--pid", str(pid), "--native"],
            capture_output=True,
            timeout=DUMP_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"native stacks: py-spy failed ({exc})"
    if out.returncode != 0:
        why = out.stderr.decode(errors="replace").strip().splitlines()
        return None, f"native stacks: py-spy failed ({why[-1] if why else out.returncode})"[:300]
    text = out.stdout.decode(errors="replace")
    if len(text.encode()) > limit:
        text = text.encode()[:limit].decode(errors="ignore") + "\n[cut]"
    return text, ""
