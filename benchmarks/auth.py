"""What HTTPS and basic auth cost a request, and whether a wrong-password flood delays a scraper.

Three real exporter processes in turn, in the same run: plain HTTP (the baseline), HTTPS
(``tls_server_config``), and HTTPS with basic auth (``basic_auth_users``, a bcrypt hash of
cost ``--cost``), all with a self-signed CA made here. For each, ``--requests`` GETs of
``/healthz`` on one keep-alive connection (as Prometheus scrapes) and on a fresh connection
each (a TLS handshake each). Then, on the basic-auth exporter, ``--flood`` threads send wrong
passwords as fast as they are answered for ``--seconds`` from two other addresses (127.0.0.2
and 127.0.0.3, so both default password checks are busy) while one scraper with the right
password requests ``/healthz`` every 50 ms, and a user whose password was never verified (as
after a restart) sends its first request half a second into the flood.

    python benchmarks/auth.py [--requests 300 --cost 10 --flood 4 --seconds 5]
    python benchmarks/auth.py --smoke      # seconds: bcrypt cost 4, a few requests

Prints p50 / p99 / max milliseconds per setting, the first authenticated request (the one
bcrypt check) against the second (a cached digest), and the scraper's latency during the
flood with how the flood's requests were answered (401, or 503 for a second check from one
address), and the never-verified user's first answer and its latency.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import ssl
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _harness import latency_summary  # noqa: E402

from tests.helpers.tls import PASSWORD, USER, bcrypt_hash, make_pki, write_web_config  # noqa: E402
from trainmon_exporter.local import LocalExporter  # noqa: E402


def basic(password: str, user: str = USER) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def connection(
    port: int, ctx: ssl.SSLContext | None, source: str | None = None
) -> http.client.HTTPConnection:
    """A connection to the exporter, from the local address ``source`` if given."""
    address = None if source is None else (source, 0)
    if ctx is None:
        return http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=address)
    return http.client.HTTPSConnection(
        "127.0.0.1", port, timeout=10, context=ctx, source_address=address
    )


def timed_get(conn: http.client.HTTPConnection, headers: dict[str, str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    conn.request("GET", "/healthz", headers=headers)
    r = conn.getresponse()
    r.read()
    return time.perf_counter() - t0, r.status


def measure(
    port: int, ctx: ssl.SSLContext | None, headers: dict[str, str], n: int
) -> tuple[str, str]:
    """(keep-alive summary, fresh-connection summary) of ``n`` GETs each."""
    conn = connection(port, ctx)
    keep = []
    for _ in range(n):
        dt, status = timed_get(conn, headers)
        assert status == 200, status
        keep.append(dt)
    conn.close()
    fresh = []
    for _ in range(n):
        t0 = time.perf_counter()
        c = connection(port, ctx)
        _, status = timed_get(c, headers)
        c.close()
        assert status == 200, status
        fresh.append(time.perf_counter() - t0)
    return latency_summary(keep), latency_summary(fresh)


FLOOD_SOURCES = ("127.0.0.2", "127.0.0.3")


def flood(
    port: int, ctx: ssl.SSLContext, threads: int, seconds: float
) -> tuple[str, Counter[int], tuple[float, int]]:
    """The right-password scraper's latency while ``threads`` send wrong passwords (from
    :data:`FLOOD_SOURCES` in turn), and the first request of the never-verified user
    ``late`` half a second in: ``(seconds, status)``."""
    answers: Counter[int] = Counter()
    lock = threading.Lock()
    stop = threading.Event()

    def attacker(i: int) -> None:
        source = FLOOD_SOURCES[i % len(FLOOD_SOURCES)]
        conn = connection(port, ctx, source)
        wrong = basic(f"guess-{i}")
        while not stop.is_set():
            try:
                _, status = timed_get(conn, wrong)
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = connection(port, ctx, source)
                continue
            with lock:
                answers[status] += 1
        conn.close()

    workers = [threading.Thread(target=attacker, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    conn = connection(port, ctx)
    right = basic(PASSWORD)
    lat = []
    failed = 0
    late = (0.0, 0)
    start = time.monotonic()
    deadline = start + seconds
    while time.monotonic() < deadline:
        if not late[1] and time.monotonic() - start > min(0.5, seconds / 2):
            first = connection(port, ctx)
            late = timed_get(first, basic(PASSWORD, "late"))
            first.close()
        dt, status = timed_get(conn, right)
        if status == 200:
            lat.append(dt)
        else:
            failed += 1
        time.sleep(0.05)
    stop.set()
    for w in workers:
        w.join(10)
    conn.close()
    return latency_summary(lat, failed), answers, late


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--cost", type=int, default=10, help="bcrypt cost of the password hash")
    ap.add_argument("--flood", type=int, default=4, help="threads sending wrong passwords")
    ap.add_argument("--seconds", type=float, default=5.0, help="length of the flood")
    ap.add_argument("--smoke", action="store_true", help="seconds: cost 4, a few requests")
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.cost, args.flood, args.seconds = 5, 4, 2, 0.5
    with tempfile.TemporaryDirectory(prefix="trainmon-auth-bench-") as tmp:
        d = Path(tmp)
        pki = make_pki(d)
        ctx = pki.client_context()
        tls = {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)}
        # "fresh" is a second user no request has used yet: its first request pays for bcrypt
        # "late" is verified for the first time during the flood, as after a restart
        users = {u: bcrypt_hash(PASSWORD, args.cost) for u in (USER, "fresh", "late")}
        settings: list[tuple[str, dict[str, object] | None, ssl.SSLContext | None]] = [
            ("plain HTTP (baseline)", None, None),
            ("HTTPS", {"tls_server_config": tls}, ctx),
            (
                f"HTTPS + basic auth (bcrypt cost {args.cost})",
                {"tls_server_config": tls, "basic_auth_users": users},
                ctx,
            ),
        ]
        print(f"/healthz, {args.requests} requests each; p50 / p99 / max")
        for name, config, client_ctx in settings:
            flags: list[str] = []
            if config is not None:
                flags = ["--web.config.file", str(write_web_config(d / "web.yml", config))]
            auth = (USER, PASSWORD) if config and "basic_auth_users" in config else None
            with LocalExporter(*flags, ssl_context=client_ctx, auth=auth) as ex:
                headers = basic(PASSWORD) if auth else {}
                if auth:
                    conn = connection(ex.port, client_ctx)
                    first, status = timed_get(conn, basic(PASSWORD, "fresh"))
                    second, _ = timed_get(conn, basic(PASSWORD, "fresh"))
                    conn.close()
                    assert status == 200, status
                    print(
                        f"  first authenticated request (one bcrypt check) {first * 1e3:.1f} ms, "
                        f"the next (cached digest) {second * 1e3:.1f} ms"
                    )
                keep, fresh = measure(ex.port, client_ctx, headers, args.requests)
                print(f"{name}\n  keep-alive:       {keep}\n  fresh connection: {fresh}")
                if auth:
                    summary, answers, late = flood(ex.port, ctx, args.flood, args.seconds)
                    print(
                        f"  during a flood of wrong passwords from {args.flood} connections "
                        f"on {len(FLOOD_SOURCES)} other addresses ({args.seconds:g} s): "
                        f"scraper {summary}; flood answered {answers[401]} x 401, "
                        f"{answers[503]} x 503; a never-verified user's first request: "
                        f"{late[1]} in {late[0] * 1e3:.1f} ms"
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
