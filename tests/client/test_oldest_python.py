"""The client runs on the oldest Python it supports (``requires-python = ">=3.9"``).

Type checkers and linters run on the development Python only, so this is the check that the
client's modules parse on 3.9 and that its API works there against a real socket. Skipped,
with the reason, where no Python 3.9 interpreter is installed.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import pytest

from ..conftest import ROOT, short_tmpdir
from ..helpers.checkout import tracked

OLDEST = "3.9"

SESSION = """
import socket, sys, threading
from trainmon_client import _protocol as P
import trainmon_client

path = sys.argv[1]
server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
server.bind(path)
server.listen(1)
records = []

def serve():
    conn, _ = server.accept()
    while True:
        data = conn.recv(P.MAX_PACKET_BYTES)
        if not data:
            return
        records.extend(t for t, _ in P.iter_records(data))

reader = threading.Thread(target=serve)
reader.start()
run = trainmon_client.init(run="oldest", socket_path=path, flush_interval=0.0)
for step in range(5):
    run.log(step, loss=2.0 - step / 10, lr=1e-3, tokens=128, my_metric=float(step))
run.eval(4, val_loss=1.5)
with run.track("validation"):
    pass
run.checkpoint(4, seconds=1.0)
run.finish()
reader.join(10)
assert sys.version_info[:2] == (3, 9), sys.version
assert records.count(P.STEP) == 5, records
assert P.FINISH in records and P.EVAL in records and P.TRACK in records, records
assert sum(run.dropped.values()) == 0 and run.refused == 0, (run.dropped, run.refused)
print("ok")
"""


def oldest_python() -> str | None:
    found = shutil.which(f"python{OLDEST}")
    if found:
        probe = subprocess.run([found, "-c", "pass"], capture_output=True, check=False)
        if probe.returncode == 0:  # a pyenv shim without that version installed fails here
            return found
    pattern = os.path.expanduser(f"~/.pyenv/versions/{OLDEST}.*/bin/python{OLDEST}")
    candidates = sorted(glob.glob(pattern))
    return candidates[-1] if candidates else None


@pytest.fixture(scope="module")
def python39() -> str:
    found = oldest_python()
    if found is None:
        pytest.skip(f"no Python {OLDEST} interpreter here (python{OLDEST} or pyenv)")
    return found


def test_every_client_module_parses_on_the_oldest_python(python39: str) -> None:
    files = [str(p) for p in tracked("*.py", under=ROOT / "client" / "src" / "trainmon_client")]
    parse = "import ast, sys\nfor f in sys.argv[1:]: ast.parse(open(f).read(), f)"
    out = subprocess.run(
        [python39, "-c", parse, *files],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr


def test_the_client_api_works_on_the_oldest_python(python39: str) -> None:
    path = str(short_tmpdir() / "t.sock")
    out = subprocess.run(
        [python39, "-X", "dev", "-W", "error", "-c", SESSION, path],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "client" / "src")},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "ok"
