"""Golden capture of the wire: a scripted client session, byte for byte.

``tests/helpers/client_session.py`` drives the real client on a fake clock against a real
``SOCK_SEQPACKET`` listener and prints every packet. Any difference from
``tests/golden/client.packets.hex`` fails: the bytes on the wire are a contract with every
exporter already deployed. A change that alters them on purpose updates the file
(``TRAINMON_UPDATE_GOLDEN=1 pytest tests/client/test_golden_wire.py``) and says why.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ..conftest import ROOT, child_env

pytest.importorskip("torch")
pytest.importorskip("numpy")

GOLDEN = ROOT / "tests" / "golden" / "client.packets.hex"
SCRIPT = ROOT / "tests" / "helpers" / "client_session.py"


def test_a_scripted_client_session_sends_exactly_the_golden_packets() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
        check=False,
    )
    assert out.returncode == 0, out.stderr
    if os.environ.get("TRAINMON_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(out.stdout)
    want = GOLDEN.read_text().splitlines()
    got = out.stdout.splitlines()
    assert len(got) == len(want), f"{len(got)} packets, the golden file has {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"packet {i} differs from tests/golden/{GOLDEN.name}"


def test_the_golden_packets_decode_as_the_protocol_says() -> None:
    from trainmon_client import _protocol as P

    types = []
    for line in GOLDEN.read_text().splitlines():
        types += [rtype for rtype, _ in P.iter_records(bytes.fromhex(line))]
    for rtype in (P.HELLO, P.NAME, P.STEP, P.EVAL, P.TRACK, P.CHECKPOINT, P.LAYERS, P.FINISH):
        assert rtype in types
    assert types.count(P.HELLO) == 2  # the reconnect said HELLO again
