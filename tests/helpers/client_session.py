"""A scripted client session on a fake clock; prints every packet the exporter would read.

Run as a script (``python tests/helpers/client_session.py``): the clocks, the PID and the
host name are replaced *before* ``trainmon_client`` is imported, so the bytes depend on the
script alone, not on where the client keeps its clock references. A listener in this process
reads each packet as the client sends it; the script waits for each expected packet before
its next call, so the packet boundaries are the client's flush decisions, not thread timing.

The session covers what the client puts on the wire: HELLO and NAME records on connect,
plain, NumPy and tensor values, the cumulative token and sample totals, refused names and
values, a step that cannot be encoded, a NaN (sent at once), an evaluation, a tracked
operation, a checkpoint, a watched model's LAYERS records, the TOTALS accounting, a lost
connection and the reconnect that re-sends the names, and FINISH. Output: one hex line per
packet, in order; the HELLO's ``client_version`` reads ``golden`` (it follows releases).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import threading
import time


class FakeClock:
    """``time.time``, ``time.perf_counter`` and ``time.thread_time`` that move only when told."""

    def __init__(self) -> None:
        self.wall = 1_800_000_000.0
        self.perf = 5_000.0

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.perf += seconds


CLOCK = FakeClock()
time.time = lambda: CLOCK.wall
time.perf_counter = lambda: CLOCK.perf
time.thread_time = lambda: 0.0
os.getpid = lambda: 4242
socket.gethostname = lambda: "node1"
# The model's float32 numbers must not depend on the CPU: MKL's conditional numerical
# reproducibility mode and one ATen kernel set (AVX2, which AVX-512 machines also run) give
# the same bits on every x86-64 machine; MKL's own choice differs between CPUs in the last bit.
os.environ["MKL_CBWR"] = "COMPATIBLE"
os.environ["ATEN_CPU_CAPABILITY"] = "avx2"

import numpy as np  # noqa: E402
import torch  # noqa: E402

import trainmon_client  # noqa: E402
from trainmon_client import _protocol as P  # noqa: E402


class Listener:
    """A SOCK_SEQPACKET listener that keeps every packet it reads, in order."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(path)
        self.sock.listen(4)
        self.packets: list[bytes] = []
        self.conn: socket.socket | None = None
        self.cond = threading.Condition()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.cond:
                self.conn = conn
            while True:
                try:
                    data = conn.recv(P.MAX_PACKET_BYTES + 1)
                except OSError:
                    break
                if not data:
                    break
                with self.cond:
                    self.packets.append(data)
                    self.cond.notify_all()

    def expect(self, n: int, timeout: float = 30.0) -> None:
        """Wait until ``n`` packets have arrived in all, then make sure no more do."""
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.packets) >= n, timeout):
                raise SystemExit(f"expected {n} packets, got {len(self.packets)}")
            self.cond.wait_for(lambda: len(self.packets) > n, 0.2)
            if len(self.packets) != n:
                raise SystemExit(f"expected {n} packets, got {len(self.packets)}")

    def drop_connection(self) -> None:
        """Close the server side of the current connection (an exporter restart)."""
        with self.cond:
            conn, self.conn = self.conn, None
        assert conn is not None
        conn.shutdown(socket.SHUT_RDWR)
        conn.close()


def normalised(packet: bytes) -> bytes:
    """``packet`` with the HELLO's client version replaced by ``golden``."""
    out = bytearray(packet[: P.PACKET_HEADER.size])
    for rtype, payload in P.iter_records(packet):
        if rtype == P.HELLO:
            hello = P.decode_hello(payload)
            hello["client_version"] = "golden"
            out += P.encode_hello(hello)
        else:
            out += P.RECORD_HEADER.pack(rtype, len(payload)) + bytes(payload)
    return bytes(out)


def main() -> None:
    tmp = tempfile.mkdtemp(prefix="tm-golden-")
    path = os.path.join(tmp, "t.sock")
    listener = Listener(path)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.linspace(-1.0, 1.0, 32).reshape(8, 4)
    y = torch.linspace(0.0, 1.0, 16).reshape(8, 2)

    run = trainmon_client.init(
        run="golden-client",
        socket_path=path,
        rank=1,
        local_rank=1,
        world_size=2,
        num_params=58,
        gpu_uuid="GPU-00000001-0000-0000-0000-000000000000",
        dtype="fp32",
        flush_interval=60.0,
    )
    watcher = run.watch(model, opt, every=2, quantiles_every=4)
    expected = 0

    def train_step(step: int) -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    # Step 1: the first step goes at once (HELLO packet, then the step).
    CLOCK.advance(0.25)
    run.log(1, loss=train_step(1), lr=0.1, tokens=256, samples=8, my_signal=0.5)
    expected += 2
    listener.expect(expected)

    # Steps 2-6: queued until a synchronous flush; mixed value types, refusals, layers.
    for step in range(2, 7):
        CLOCK.advance(0.25)
        loss = train_step(step)
        run.log(
            step,
            loss=float(loss),
            lr=np.float32(0.1),
            grad_norm=np.float64(1.0 + step / 10),
            tokens=256,
            batch_size=8,
            seq_len=32,
            my_signal=step / 10,
            **{"bad name": 1.0},
        )
    CLOCK.advance(0.25)
    run.log(np.int64(7), loss=2.0, tokens=float("nan"), note="text")  # type: ignore[arg-type]
    run.log("8", loss=2.0)  # type: ignore[arg-type]  # a string is refused as a step
    run.log(True, loss=2.0)  # a bool is refused as a step
    run.log(9, loss=2.0, huge=10**400)  # cannot be encoded
    CLOCK.advance(0.25)
    run.eval(6, val_loss=2.5, accuracy=0.25)  # flushes everything before it
    expected += 1
    listener.expect(expected)

    # A NaN wakes the flusher at once.
    CLOCK.advance(0.25)
    run.log(10, loss=float("nan"), lr=0.1, tokens=256)
    expected += 1
    listener.expect(expected)

    # A tracked operation: one packet when it starts, one when it ends.
    with run.track("validation"):
        expected += 1
        listener.expect(expected)
        CLOCK.advance(1.5)
    expected += 1
    listener.expect(expected)

    # The exporter goes away: the next flush notices, and the backoff drops what follows.
    CLOCK.advance(0.25)
    run.log(11, loss=1.9, lr=0.1, tokens=256)
    listener.drop_connection()
    CLOCK.advance(0.01)
    run.checkpoint(11, seconds=3.0)  # lost: disconnected, counted
    listener.expect(expected)

    # After the backoff, the next flush reconnects: HELLO and every NAME again.
    CLOCK.advance(5.0)
    run.log(12, loss=1.8, lr=0.1, tokens=256, my_signal=0.7)
    run.checkpoint(12, seconds=2.0)
    expected += 2
    listener.expect(expected)

    CLOCK.advance(0.25)
    watcher.remove()
    run.finish()
    expected += 1
    listener.expect(expected)
    for packet in listener.packets:
        sys.stdout.write(normalised(packet).hex() + "\n")


if __name__ == "__main__":
    main()
