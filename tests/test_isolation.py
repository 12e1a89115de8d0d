"""The suite never reaches a socket it did not make, even where this user's exporter listens.

A user who already runs an exporter (on this user's default socket, and named in
``TRAINMON_SOCKET`` in the shell) runs the tests: the parts of the suite that start trainers
of their own (the README's Hugging Face example with its injected NaN, which would page; the
client's environment tests) run in a pytest of their own, and that exporter receives nothing:
no connection, no run. As root, the default socket is ``/run/trainmon/trainmon.sock``: the
inner pytest then runs in a mount namespace where that path is the listening exporter's
(``unshare``; the node's own ``/run`` is never touched).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, ExporterProcess, child_env, free_port, sample, short_tmpdir

pytestmark = [pytest.mark.slow, pytest.mark.uid]  # the default socket depends on the user

PARTS = ["tests/test_docs_commands.py", "tests/client/test_env.py"]
SELECT = "train_hf_trainer or test_env"
# As root: /run replaced by an empty tmpfs in a private mount namespace, and the listening
# exporter's directory mounted at /run/trainmon.
NAMESPACE = (
    "mount --make-rprivate / && mount -t tmpfs -o mode=0755 tmpfs /run && "
    'mkdir /run/trainmon && mount --bind "$0" /run/trainmon && exec "$@"'
)


def can_unshare() -> bool:
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        return False
    return subprocess.run([unshare, "--mount", "true"], check=False).returncode == 0


def test_this_users_running_exporter_receives_nothing_from_the_suite() -> None:
    if os.geteuid() == 0 and not can_unshare():
        pytest.skip("as root the default socket is /run/trainmon's: needs unshare --mount")
    runtime = short_tmpdir()  # 0700, this user's: a login's runtime directory
    try:
        ex = ExporterProcess(runtime / "trainmon" / "trainmon.sock", free_port()).start()
        try:
            env = child_env(XDG_RUNTIME_DIR=str(runtime), TRAINMON_SOCKET=ex.socket)
            cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider"]
            cmd += ["-k", SELECT, *PARTS]
            if os.geteuid() == 0:
                cmd = ["unshare", "--mount", "sh", "-c", NAMESPACE, str(runtime / "trainmon"), *cmd]
            inner = subprocess.run(
                cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
            )
            assert inner.returncode == 0, inner.stdout[-4000:] + inner.stderr[-2000:]
            assert re.search(r"train_hf_trainer\.py\] PASSED", inner.stdout), inner.stdout[-4000:]
            m = ex.metrics()
            assert sample(m, "trainmon_ingest_connections_total") == 0, ex.runs()
            assert ex.runs()["runs"] == []
        finally:
            ex.stop()
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
