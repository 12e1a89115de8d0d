"""Connection slots are shared per uid: a uid at its quota is refused, other uids are not.

The clients are real processes of other uids (the test process is root; each client drops to
its uid after its imports, before it connects), against a real exporter socket.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from trainmon_exporter import Settings

from ..conftest import InProcessExporter, child_env, sample, wait_for

SQUATTER, VICTIM = 43201, 43202

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to run clients as other uids (setuid)"
)

PRELUDE = """
import os, socket, time
import trainmon_client
from trainmon_client import _protocol as P
os.setgroups([]); os.setgid({uid}); os.setuid({uid})
SOCK = {sock!r}

def hello(rank):
    fields = {{k: None for k in P.HELLO_FIELDS}} | {{
        "run": "squat", "rank": rank, "local_rank": 0, "world_size": 4096, "hostname": "h",
        "pid": os.getpid(), "client_version": "test", "started_at": 1.0, "dtype": "bf16"}}
    return P.packet_header() + P.encode_hello(fields)

def held(s):
    # Refused connections read EOF at once; held ones have nothing to read.
    s.settimeout(0.3)
    try:
        return s.recv(16) != b""
    except TimeoutError:
        return True
    except OSError:  # reset by the exporter's close
        return False
"""

# Opens 10 HELLO-only connections and holds them; then, on stdin, closes one held connection
# and opens a new one.
SQUAT = """
socks = []
for rank in range(10):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(SOCK)
    try:
        s.send(hello(rank))
        socks.append(s)
    except OSError:  # already closed by the exporter: refused
        s.close()
time.sleep(0.5)
kept = [s for s in socks if held(s)]
print(len(kept), flush=True)
input()
kept[0].close()
time.sleep(0.5)
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(SOCK)
try:
    s.send(hello(100))
    time.sleep(0.5)
    print(held(s), flush=True)
except OSError:
    print(False, flush=True)
input()
"""

TRAIN = """
r = trainmon_client.init(run="victim", rank=0, world_size=1, socket_path=SOCK,
                         flush_interval=0.0)
for i in range(1, 4):
    r.log(i, loss=2.0)
r.finish()
print(sum(r.dropped.values()), flush=True)
"""


def as_uid(sock: str, uid: int, code: str) -> subprocess.Popen[str]:
    src = PRELUDE.format(uid=uid, sock=sock) + textwrap.dedent(code)
    return subprocess.Popen(
        [sys.executable, "-c", src],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )


def line(p: subprocess.Popen[str]) -> str:
    assert p.stdout is not None
    out = p.stdout.readline()
    assert out, p.stderr.read() if p.stderr else ""
    return out.strip()


def say(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None
    p.stdin.write("\n")
    p.stdin.flush()


def refused(ex: InProcessExporter, reason: str) -> float:
    m = ex.metrics()
    return sample(m, "trainmon_ingest_connections_refused_total", reason=reason) or 0.0


@needs_root
def test_a_uid_at_its_quota_is_refused_and_another_uid_still_gets_in(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    ex = make_exporter(
        socket_mode="0666", ingest_max_connections=16, ingest_max_connections_per_uid=4
    )
    os.chmod(Path(ex.socket).parent, 0o755)
    squat = as_uid(ex.socket, SQUATTER, SQUAT)
    try:
        assert line(squat) == "4"  # 4 held, 6 refused at accept
        assert refused(ex, "uid_quota") == 6
        assert refused(ex, "max_connections") == 0
        # Another uid is not affected by the squatter's quota.
        train = as_uid(ex.socket, VICTIM, TRAIN)
        out, err = train.communicate(timeout=30)
        assert train.returncode == 0, err
        assert out.strip() == "0"  # nothing dropped
        wait_for(lambda: (r := _rank(ex, "victim")) is not None and r["step"] == 3)
        # A slot the squatter gives back is its own again.
        say(squat)
        assert line(squat) == "True"
        assert refused(ex, "uid_quota") == 6
        m = ex.metrics()
        assert sample(m, "trainmon_ingest_open_connections") == 4
    finally:
        squat.kill()
        squat.communicate()


def _rank(ex: InProcessExporter, run: str) -> dict[str, object] | None:
    for r in ex.runs()["runs"]:
        if r["run"] == run:
            return r["ranks"][0]  # type: ignore[no-any-return]
    return None


def test_the_per_uid_quota_agrees_with_the_connection_cap() -> None:
    s = Settings()
    assert s.ingest_max_connections == 1024
    assert s.connections_per_uid(1024) == 256  # a quarter
    assert s.connections_per_uid(100) == 64  # at least 64 (8 GPUs x 8 processes)
    assert s.connections_per_uid(10) == 10  # never more than the cap
    assert Settings(ingest_max_connections_per_uid=8).connections_per_uid(1024) == 8
    # An explicit quota is lowered with the cap when the open-file limit lowers the cap.
    assert Settings(ingest_max_connections_per_uid=500).connections_per_uid(300) == 300
    with pytest.raises(ValueError, match="at most ingest_max_connections"):
        Settings(ingest_max_connections=10, ingest_max_connections_per_uid=11)
