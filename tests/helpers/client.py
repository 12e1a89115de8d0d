"""Helpers for tests of the client: a listener that decodes what a run sends, a run on it, and a
tiny watched model. Shared by tests/client, tests/gpu and any other test that drives a run.

torch is imported only by the helpers that need it (:func:`tiny`, :func:`train_step`).
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import trainmon_client
from trainmon_client import _protocol as P

from ..conftest import tiny_model


class Listener:
    """A minimal server: accepts one client at a time and decodes what it receives."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.conn: socket.socket | None = None

    def accept(self, timeout: float = 5) -> socket.socket:
        self.sock.settimeout(timeout)
        self.conn, _ = self.sock.accept()
        return self.conn

    def packets(self, timeout: float = 0.3) -> list[bytes]:
        """Every packet until none comes for ``timeout`` seconds (or the client hangs up)."""
        assert self.conn is not None
        out = []
        self.conn.settimeout(timeout)
        try:
            while True:
                data = self.conn.recv(P.MAX_PACKET_BYTES + 1)
                if not data:
                    break
                out.append(data)
        except TimeoutError:
            pass
        return out

    def records(self, timeout: float = 0.3, totals: bool = False) -> list[tuple[int, Any]]:
        """Decoded records; TOTALS (last in every packet the client sends) only with ``totals``."""
        out: list[tuple[int, Any]] = []
        for pkt in self.packets(timeout):
            for rtype, payload in P.iter_records(pkt):
                if rtype == P.TOTALS:
                    if totals:
                        out.append((rtype, P.decode_totals(payload)))
                elif rtype == P.HELLO:
                    out.append((rtype, P.decode_hello(payload)))
                else:  # every other type as the exporter decodes it (unknown: ProtocolError)
                    out.append((rtype, P.decode_record(rtype, payload)))
        return out

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.sock.close()
        self.path.unlink(missing_ok=True)


def make_run(path: Path | str, **kw: Any) -> trainmon_client.Run:
    """``trainmon_client.init`` on ``path`` as rank 0 of 1 of the run ``test-run``."""
    kw.setdefault("run", "test-run")
    kw.setdefault("rank", 0)
    kw.setdefault("world_size", 1)
    kw.setdefault("local_rank", 0)
    return trainmon_client.init(socket_path=path, **kw)


def steps_of(records: list[tuple[int, Any]]) -> list[Any]:
    """The decoded STEP records (``P.Step``) among ``records``."""
    return [r[1] for r in records if r[0] == P.STEP]


# ----------------------------------------------------------------------------- watched models


def tiny() -> tuple[Any, Any]:
    """:func:`tests.conftest.tiny_model` with plain SGD (lr 0.1), whose update is exact."""
    import torch

    model, _ = tiny_model()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(model: Any, opt: Any) -> None:
    """One optimizer step of ``model`` on a random batch."""
    import torch

    x = torch.randn(32, 8)
    loss = (model(x) - 1.0).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def layer_records(listener: Listener) -> list[tuple[Any, dict[int, str], Any]]:
    """The LAYERS records the listener receives, each with the names known at that point."""
    names: dict[int, str] = {}
    out = []
    for pkt in listener.packets():
        for rtype, payload in P.iter_records(pkt):
            if rtype == P.NAME:
                fid, name = P.decode_name(payload)
                names[fid] = name
            elif rtype == P.LAYERS:
                out.append((P.decode_layers(payload), dict(names), None))
    return out


def table(rec: Any) -> dict[str, dict[int, float]]:
    """One LAYERS record from :func:`layer_records` as ``{layer name: {stat code: value}}``."""
    (_head, codes, ids, values), names, _ = rec
    k = len(codes)
    return {
        names[i]: dict(zip(codes, values[r * k : (r + 1) * k], strict=True))
        for r, i in enumerate(ids)
    }
