"""The web configuration file: parsing and refusals, then a real exporter serving HTTPS with
basic auth (and client certificates) to real clients."""

from __future__ import annotations

import asyncio
import base64
import http.client
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import yaml

from trainmon_exporter import webconfig
from trainmon_exporter.local import LocalExporter
from trainmon_exporter.webconfig import (
    AuthStats,
    BasicAuth,
    WebConfigError,
    load_web_config,
)

from ..conftest import ROOT, child_env, parse_metrics, sample
from ..helpers.tls import PASSWORD, USER, Pki, bcrypt_hash, make_pki, write_web_config

# A low bcrypt cost keeps the tests quick; the exporter reads the cost from the hash.
HASH = bcrypt_hash(PASSWORD, rounds=4)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def tls_section(pki: Pki, **extra: Any) -> dict[str, Any]:
    return {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key), **extra}


def mutual_tls_section(pki: Pki) -> dict[str, Any]:
    """TLS 1.3 only, and every client must show a certificate the test CA signed."""
    return tls_section(
        pki,
        client_auth_type="RequireAndVerifyClientCert",
        client_ca_file=str(pki.ca),
        min_version="TLS13",
    )


def config_error(tmp_path: Path, config: Any) -> str:
    path = tmp_path / "web.yml"
    path.write_text(config if isinstance(config, str) else yaml.safe_dump(config))
    with pytest.raises(WebConfigError) as info:
        web = load_web_config(path)
        web.ssl_context()
    message = str(info.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------------ parsing


def test_a_full_file_loads_and_makes_a_server_context(pki: Pki, tmp_path: Path) -> None:
    path = write_web_config(
        tmp_path / "web.yml",
        {
            "tls_server_config": mutual_tls_section(pki),
            "http_server_config": {"http2": False, "headers": {"X-Frame-Options": "deny"}},
            "basic_auth_users": {USER: HASH, "other": bcrypt_hash("x", 4).replace("$2b$", "$2y$")},
        },
    )
    web = load_web_config(path)
    ctx = web.ssl_context()
    assert ctx is not None
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
    assert web.http_server_config.headers.pairs() == [(b"x-frame-options", b"deny")]
    assert set(web.basic_auth_users) == {USER, "other"}
    assert HASH not in repr(web)  # hashes are secrets: never in a repr or a log line


def test_the_documented_example_is_valid(pki: Pki, tmp_path: Path) -> None:
    doc = (ROOT / "docs" / "exporter.md").read_text()
    block = re.search(r"```yaml\n(tls_server_config:.*?)```", doc, re.S)
    assert block is not None
    config = yaml.safe_load(block[1])
    config["tls_server_config"].update(tls_section(pki))
    web = load_web_config(write_web_config(tmp_path / "web.yml", config))
    assert web.ssl_context() is not None
    (_user, stored), *_ = web.basic_auth_users.items()
    assert bcrypt.checkpw(b"SCRAPE-PASSWORD", stored.get_secret_value().encode())


def test_relative_paths_are_relative_to_the_file(pki: Pki, tmp_path: Path) -> None:
    elsewhere = tmp_path / "conf"
    elsewhere.mkdir()
    config = {"tls_server_config": {"cert_file": "../pki/server.crt", "key_file": "server.key"}}
    (elsewhere / "server.key").write_bytes(pki.server_key.read_bytes())
    (tmp_path / "pki").mkdir()
    (tmp_path / "pki" / "server.crt").write_bytes(pki.server_cert.read_bytes())
    web = load_web_config(write_web_config(elsewhere / "web.yml", config))
    assert web.tls_server_config is not None
    assert web.tls_server_config.cert_file == elsewhere / "../pki/server.crt"
    assert web.tls_server_config.key_file == elsewhere / "server.key"
    assert web.ssl_context() is not None  # whatever the working directory


def test_an_empty_file_means_plain_http_without_auth(tmp_path: Path) -> None:
    (tmp_path / "web.yml").write_text("# nothing yet\n")
    web = load_web_config(tmp_path / "web.yml")
    assert web.ssl_context() is None and not web.basic_auth_users


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"tls_config": {}}, "tls_config: unknown key"),
        ({"basic_auth_user": {}}, "basic_auth_user: unknown key"),
        ({"tls_server_config": {"certfile": "a", "cert_file": "a", "key_file": "b"}}, "certfile"),
        ({"http_server_config": {"headers": {"X-Powered-By": "x"}}}, "X-Powered-By"),
        ({"rate_limit": {"interval": "1s", "burst": 5}}, "rate_limit is not supported"),
        (
            {"tls_server_config": {"cert": "PEM", "key": "PEM"}},
            "cert is not supported by trainmon: give the certificate as cert_file",
        ),
        (
            {"tls_server_config": {"cert_file": "a", "key_file": "b", "cipher_suites": ["x"]}},
            "cipher_suites is not supported",
        ),
        (
            {"tls_server_config": {"cert_file": "a", "key_file": "b", "min_version": "SSL3"}},
            "min_version",
        ),
        (
            {
                "tls_server_config": {
                    "cert_file": "a",
                    "key_file": "b",
                    "min_version": "TLS13",
                    "max_version": "TLS12",
                }
            },
            "above max_version",
        ),
        (
            {
                "tls_server_config": {
                    "cert_file": "a",
                    "key_file": "b",
                    "client_auth_type": "RequireAnyClientCert",
                }
            },
            "without verifying it",
        ),
        (
            {
                "tls_server_config": {
                    "cert_file": "a",
                    "key_file": "b",
                    "client_auth_type": "RequireAndVerifyClientCert",
                }
            },
            "needs client_ca_file",
        ),
        (
            {"tls_server_config": {"cert_file": "a", "key_file": "b", "client_ca_file": "c"}},
            "client_auth_type is NoClientCert",
        ),
        ({"tls_server_config": {"key_file": "b"}}, "tls_server_config.cert_file: Field required"),
        ({"http_server_config": {"headers": {"X-Frame-Options": "allow"}}}, "deny or sameorigin"),
        ({"basic_auth_users": {"a:b": HASH}}, "has no ':'"),
        ("basic_auth_users: [a, b]\n", "basic_auth_users: Input should be a valid dictionary"),
        ("tls_server_config: {cert_file: a\n", "not YAML"),
        ("- a\n- b\n", "expected a mapping"),
    ],
)
def test_an_invalid_file_is_refused_with_one_line(
    tmp_path: Path, config: Any, expected: str
) -> None:
    assert expected in config_error(tmp_path, config)


def test_a_clear_password_is_refused_without_being_repeated(tmp_path: Path) -> None:
    message = config_error(tmp_path, {"basic_auth_users": {USER: "hunter2-in-clear"}})
    assert f"user '{USER}': the password must be a bcrypt hash" in message
    assert "hunter2" not in message
    truncated = {"basic_auth_users": {USER: HASH[:-1]}}
    assert "must be a bcrypt hash" in config_error(tmp_path, truncated)


def test_a_missing_or_bad_certificate_is_one_line(pki: Pki, tmp_path: Path) -> None:
    missing = config_error(
        tmp_path, {"tls_server_config": tls_section(pki, cert_file=str(tmp_path / "none.crt"))}
    )
    assert missing == f"tls_server_config: {tmp_path / 'none.crt'}: No such file or directory"
    (tmp_path / "junk.crt").write_text("not a certificate\n")
    junk = config_error(
        tmp_path, {"tls_server_config": tls_section(pki, cert_file=str(tmp_path / "junk.crt"))}
    )
    assert junk.endswith("not a PEM certificate and matching private key"), junk
    mismatch = config_error(
        tmp_path, {"tls_server_config": tls_section(pki, key_file=str(pki.client_key))}
    )
    assert mismatch.endswith("key values mismatch"), mismatch
    unreadable = tmp_path / "unreadable.yml"
    with pytest.raises(WebConfigError, match=r"unreadable.yml: No such file or directory$"):
        load_web_config(unreadable)


def start_exporter(tmp_path: Path, *flags: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m trainmon_exporter`` with ``flags`` and ``env``, run until it exits (60 s)."""
    cmd = [sys.executable, "-m", "trainmon_exporter", "--socket", str(tmp_path / "s.sock")]
    return subprocess.run(
        [*cmd, "--listen", "127.0.0.1:0", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(**env),
        check=False,
    )


def test_the_exporter_refuses_to_start_with_a_bad_file(pki: Pki, tmp_path: Path) -> None:
    path = write_web_config(tmp_path / "web.yml", {"tls_server_config": {"cert_file": "x"}})
    for flag in ("--web.config.file", "--web-config-file"):
        out = start_exporter(tmp_path, flag, str(path))
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip().splitlines() == [
            f"trainmon-exporter: error: web config {path}: tls_server_config.key_file: "
            "Field required"
        ]
    bad_key = write_web_config(
        tmp_path / "web.yml", {"tls_server_config": tls_section(pki, key_file=str(pki.ca))}
    )
    out = start_exporter(tmp_path, TRAINMON_WEB_CONFIG_FILE=str(bad_key))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("trainmon-exporter: error: tls_server_config: cert_file")
    assert not (tmp_path / "s.sock").exists()  # the ingest socket is removed again


# ----------------------------------------------------------------------- the password checks


def basic(user: str, password: str | bytes) -> bytes:
    raw = user.encode() + b":" + (password if isinstance(password, bytes) else password.encode())
    return b"Basic " + base64.b64encode(raw)


class CountingBcrypt:
    """The real ``bcrypt.checkpw``, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.real = bcrypt.checkpw

    def __call__(self, password: bytes, hashed: bytes) -> bool:
        self.calls += 1
        return bool(self.real(password, hashed))


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> CountingBcrypt:
    spy = CountingBcrypt()
    monkeypatch.setattr(webconfig.bcrypt, "checkpw", spy)
    return spy


def test_a_verified_password_is_not_checked_with_bcrypt_again(counted: CountingBcrypt) -> None:
    stats = AuthStats()
    auth = BasicAuth({USER: HASH.encode()}, stats, max_checks=2)

    async def run() -> list[str | None]:
        return [
            await auth.check(basic(USER, PASSWORD)),
            await auth.check(basic(USER, PASSWORD)),
            await auth.check(basic(USER, PASSWORD)),
            await auth.check(basic(USER, "wrong")),
            await auth.check(basic(USER, PASSWORD)),
        ]

    assert asyncio.run(run()) == [None, None, None, "rejected", None]
    assert counted.calls == 2  # the first right password and the wrong one
    assert stats.failures == {"missing": 0, "malformed": 0, "rejected": 1, "check_limit": 0}


def test_refusals_by_reason(counted: CountingBcrypt) -> None:
    stats = AuthStats()
    auth = BasicAuth({USER: HASH.encode()}, stats, max_checks=2)
    cases = {
        None: "missing",
        b"Bearer abc": "missing",
        b"Basic !!!": "malformed",
        b"Basic " + base64.b64encode(b"no-colon"): "malformed",
        b"Basic " + base64.b64encode(b"\xff\xfe:pw"): "malformed",
        basic(USER, b"x" * 73): "rejected",  # past bcrypt's 72 bytes: no check at all
    }

    async def run() -> list[str | None]:
        return [await auth.check(header) for header in cases]

    assert asyncio.run(run()) == list(cases.values())
    assert counted.calls == 0
    # An unknown user costs a bcrypt check like a known one, and is refused even with a
    # password that matches another user's hash.
    assert asyncio.run(auth.check(basic("mallory", PASSWORD))) == "rejected"
    assert counted.calls == 1
    assert stats.failures == {"missing": 2, "malformed": 3, "rejected": 2, "check_limit": 0}
    assert asyncio.run(auth.check(basic(USER.upper(), PASSWORD))) == "rejected"


def test_checks_past_the_limit_are_refused_at_once(counted: CountingBcrypt) -> None:
    stats = AuthStats()
    auth = BasicAuth({USER: HASH.encode()}, stats, max_checks=1)

    async def run() -> list[str | None]:
        return list(
            await asyncio.gather(
                auth.check(basic(USER, "guess-1")),
                auth.check(basic(USER, "guess-2")),
                auth.check(basic(USER, "guess-3")),
            )
        )

    assert asyncio.run(run()) == ["rejected", "check_limit", "check_limit"]
    assert counted.calls == 1 and auth.checks == 0
    assert stats.failures["check_limit"] == 2

    async def verified_then_flood() -> list[str | None]:
        assert await auth.check(basic(USER, PASSWORD)) is None
        # while a wrong password holds the only check, the verified password still gets in
        return list(
            await asyncio.gather(
                auth.check(basic(USER, "guess-4")), auth.check(basic(USER, PASSWORD))
            )
        )

    assert asyncio.run(verified_then_flood()) == ["rejected", None]


def test_a_flooding_address_holds_one_check_and_others_wait_their_turn(
    counted: CountingBcrypt,
) -> None:
    stats = AuthStats()
    auth = BasicAuth({USER: HASH.encode()}, stats, max_checks=1)

    async def run() -> list[str | None]:
        flood = [auth.check(basic(USER, f"guess-{i}"), "10.0.0.2") for i in range(4)]
        flood += [auth.check(basic(USER, f"guess-{i}"), f"2001:db8::{i}") for i in range(4)]
        return list(await asyncio.gather(*flood, auth.check(basic(USER, PASSWORD), "10.0.0.1")))

    *flood, right = asyncio.run(run())
    # One check per address (an IPv6 /64 is one address), the right password in its turn.
    assert right is None
    assert flood == ["rejected", *["check_limit"] * 3, "rejected", *["check_limit"] * 3]
    assert counted.calls == 3 and auth.checks == 0


def test_client_keys() -> None:
    assert webconfig.client_key("10.1.2.3") == "10.1.2.3"
    assert webconfig.client_key("::ffff:10.1.2.3") == "10.1.2.3"
    assert webconfig.client_key("2001:db8:1:2:aaaa::1") == "2001:db8:1:2::/64"
    assert webconfig.client_key("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert webconfig.client_key(None) == webconfig.client_key("") == ""
    assert webconfig.client_key("testclient") == "testclient"


# ------------------------------------------------------------------------ a real exporter


def request(
    url: str, context: ssl.SSLContext | None = None, auth: tuple[str, str] | None = None
) -> tuple[int, Any]:
    """(status, headers) of a GET; HTTP errors are answers too."""
    headers = {}
    if auth is not None:
        headers["Authorization"] = basic(*auth).decode()
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=10, context=context
        ) as r:
            r.read()
            return r.status, r.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers


@pytest.fixture(scope="module")
def tls_exporter(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalExporter]:
    path = write_web_config(
        tmp_path_factory.mktemp("web") / "web.yml",
        {
            "tls_server_config": tls_section(pki),
            "http_server_config": {"headers": {"X-Content-Type-Options": "nosniff"}},
            "basic_auth_users": {USER: HASH},
        },
    )
    ex = LocalExporter(
        "--web.config.file",
        str(path),
        "--http-header-timeout-seconds",
        "1",
        ssl_context=pki.client_context(),
        auth=(USER, PASSWORD),
    )
    with ex:
        yield ex


def failures(ex: LocalExporter, reason: str) -> float:
    metrics = parse_metrics(ex.get("/metrics").decode())
    return sample(metrics, "trainmon_http_auth_failures_total", reason=reason) or 0.0


def test_https_with_basic_auth_on_every_route(tls_exporter: LocalExporter, pki: Pki) -> None:
    ex, ctx = tls_exporter, pki.client_context()
    assert ex.url.startswith("https://")
    before = {r: failures(ex, r) for r in ("missing", "rejected")}
    for path in ("/metrics", "/healthz", "/readyz", "/api/v1/runs", "/", "/openapi.json"):
        status, headers = request(ex.url + path, ctx)
        assert status == 401, path
        assert headers["WWW-Authenticate"] == 'Basic realm="trainmon", charset="UTF-8"'
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert request(ex.url + path, ctx, (USER, "wrong"))[0] == 401, path
        assert request(ex.url + path, ctx, ("nobody", PASSWORD))[0] == 401, path
        status, headers = request(ex.url + path, ctx, (USER, PASSWORD))
        assert status == 200, path
        assert headers["X-Content-Type-Options"] == "nosniff"
    assert failures(ex, "missing") == before["missing"] + 6
    assert failures(ex, "rejected") == before["rejected"] + 12


def test_the_tls_port_refuses_plain_http_and_unknown_certificates(
    tls_exporter: LocalExporter,
) -> None:
    plain = tls_exporter.url.replace("https://", "http://")
    with pytest.raises((OSError, ConnectionError)):  # the handshake fails: closed, no answer
        urllib.request.urlopen(plain + "/healthz", timeout=10)
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(tls_exporter.url + "/healthz", timeout=10)  # system CAs only
    assert tls_exporter.get_json("/healthz") == {"status": "ok"}  # still serving


def test_a_stalled_tls_handshake_is_closed_by_the_header_timeout(
    tls_exporter: LocalExporter,
) -> None:
    """Without it asyncio waits 60 s for a handshake, holding a descriptor outside the HTTP
    connection limit; here the exporter's header timeout is 1 s."""
    with socket.create_connection(("127.0.0.1", tls_exporter.port), timeout=30) as stalled:
        started = time.monotonic()
        assert stalled.recv(1) == b""  # closed by the server, not by our timeout
        assert time.monotonic() - started < 15
    assert tls_exporter.get_json("/healthz") == {"status": "ok"}


def test_client_certificates_and_min_version_are_enforced(pki: Pki, tmp_path: Path) -> None:
    path = write_web_config(
        tmp_path / "web.yml",
        {"tls_server_config": mutual_tls_section(pki)},
    )
    with LocalExporter(
        "--web.config.file", str(path), ssl_context=pki.client_context(with_client_cert=True)
    ) as ex:
        assert ex.get_json("/healthz") == {"status": "ok"}
        # without a client certificate the handshake fails (TLS 1.3 reports it on first read)
        with pytest.raises((ssl.SSLError, OSError)):
            urllib.request.urlopen(ex.url + "/healthz", timeout=10, context=pki.client_context())
        client = pki.client_context(with_client_cert=True)
        client.maximum_version = ssl.TLSVersion.TLSv1_2  # below min_version TLS13
        with pytest.raises((ssl.SSLError, OSError)):
            urllib.request.urlopen(ex.url + "/healthz", timeout=10, context=client)
        client.maximum_version = ssl.TLSVersion.TLSv1_3  # the same client, allowed TLS 1.3
        assert request(ex.url + "/healthz", client)[0] == 200
        assert ex.get_json("/healthz") == {"status": "ok"}


def test_trainmon_status_reads_an_https_exporter_with_basic_auth(
    tls_exporter: LocalExporter, pki: Pki, tmp_path: Path
) -> None:
    url = tls_exporter.url
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")
    args = ["--url", url, "--ca-file", str(pki.ca), "--user", USER, "--once"]

    def status(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "trainmon_exporter", "status", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            env=child_env(**env),
            check=False,
        )

    for out in (
        status(*args, TRAINMON_STATUS_PASSWORD=PASSWORD),
        status(*args, "--password-file", str(password_file)),
    ):
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("# ranks\n") and "# gpus" in out.stdout
    wrong = status(*args, TRAINMON_STATUS_PASSWORD="wrong")
    assert wrong.returncode == 2
    assert wrong.stderr == (
        f"trainmon status: cannot read {url}/api/v1/runs: 401 Unauthorized: give --user, and "
        "the password in TRAINMON_STATUS_PASSWORD\n"
    )
    no_password = status(*args)
    assert no_password.returncode == 2
    assert "--user needs a password" in no_password.stderr
    untrusted = status("--url", url, "--once")
    assert untrusted.returncode == 2 and "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr


def test_basic_auth_over_plain_http_works_and_warns(tmp_path: Path) -> None:
    path = write_web_config(tmp_path / "web.yml", {"basic_auth_users": {USER: HASH}})
    ex = LocalExporter(
        "--web.config.file", str(path), auth=(USER, PASSWORD), quiet=False, capture_output=True
    )
    with ex:
        assert ex.url.startswith("http://")
        assert request(ex.url + "/healthz")[0] == 401
        assert ex.get_json("/healthz") == {"status": "ok"}
    out = ex.stop()
    assert "passwords cross the network in clear text" in out, out


def test_right_after_a_start_the_right_password_gets_in_during_a_flood(tmp_path: Path) -> None:
    """No password is verified yet (a restart): wrong passwords from two other addresses
    keep both bcrypt checks busy, and the right one is still let in at its first try."""
    scrapers = (USER, "second", "third")
    users = {name: bcrypt_hash(PASSWORD, 10) for name in scrapers}
    users["probe"] = bcrypt_hash("probe-password", 4)  # the readiness checks' own user
    path = write_web_config(tmp_path / "web.yml", {"basic_auth_users": users})
    with LocalExporter("--web.config.file", str(path), auth=("probe", "probe-password")) as ex:
        stop = threading.Event()
        answers: list[int] = []

        def flood(source: str) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", ex.port, source_address=(source, 0))
            while not stop.is_set():
                conn.request("GET", "/healthz", headers={"Authorization": basic(USER, "guess")})
                response = conn.getresponse()
                response.read()
                answers.append(response.status)
            conn.close()

        threads = [
            threading.Thread(target=flood, args=(source,))
            for source in ("127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3")
        ]
        for t in threads:
            t.start()
        try:
            time.sleep(0.5)
            firsts = [request(ex.url + "/healthz", auth=(u, PASSWORD))[0] for u in scrapers]
        finally:
            stop.set()
            for t in threads:
                t.join(30)
    assert firsts == [200, 200, 200]
    assert answers.count(401) >= 2 and 503 in answers  # the flood was checked, and limited


# ------------------------------------------------------------------ certificate renewal


def served_certificate(port: int) -> bytes:
    """The DER certificate a new TLS connection to ``port`` is shown (not verified)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def der(path: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(path.read_text())


def replace(path: Path, data: bytes) -> None:
    """Write ``path`` at once, as the kubelet and cert-manager do (a new file renamed)."""
    new = path.with_suffix(".new")
    new.write_bytes(data)
    os.replace(new, path)


def test_a_renewed_certificate_is_served_without_a_restart(tmp_path: Path) -> None:
    """Renewed under a running exporter: new connections get the new certificate, an open
    one goes on, and a bad renewal keeps the last good certificate (logged and counted)."""
    for name in ("first", "renewed", "live"):
        (tmp_path / name).mkdir()
    first = make_pki(tmp_path / "first")
    renewed = make_pki(tmp_path / "renewed")  # another CA: a client trusts one or the other
    live = tmp_path / "live"
    cert, key = live / "tls.crt", live / "tls.key"
    replace(cert, first.server_cert.read_bytes())
    replace(key, first.server_key.read_bytes())
    path = write_web_config(
        tmp_path / "web.yml",
        {"tls_server_config": {"cert_file": "live/tls.crt", "key_file": str(key)}},
    )
    ex = LocalExporter(
        "--web.config.file",
        str(path),
        ssl_context=first.client_context(),
        quiet=False,
        capture_output=True,
    )
    with ex:
        kept = http.client.HTTPSConnection("127.0.0.1", ex.port, context=first.client_context())
        kept.request("GET", "/healthz")
        assert kept.getresponse().read() == b'{"status":"ok"}'
        assert served_certificate(ex.port) == der(first.server_cert)

        replace(cert, renewed.server_cert.read_bytes())
        replace(key, renewed.server_key.read_bytes())
        assert served_certificate(ex.port) == der(renewed.server_cert)
        url = ex.url + "/healthz"
        assert request(url, renewed.client_context())[0] == 200  # verified against the new CA
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            request(url, first.client_context())
        kept.request("GET", "/healthz")  # the connection opened before goes on
        assert kept.getresponse().read() == b'{"status":"ok"}'
        kept.close()

        replace(cert, b"not a certificate\n")  # a bad renewal
        assert served_certificate(ex.port) == der(renewed.server_cert)
        replace(cert, first.server_cert.read_bytes())  # a certificate of another key
        assert served_certificate(ex.port) == der(renewed.server_cert)
        assert served_certificate(ex.port) == der(renewed.server_cert)  # tried once per change
        with urllib.request.urlopen(
            ex.url + "/metrics", timeout=10, context=renewed.client_context()
        ) as r:
            metrics = parse_metrics(r.read().decode())
        reloads = "trainmon_http_tls_reloads_total"
        assert sample(metrics, reloads, result="success") == 1
        assert sample(metrics, reloads, result="failure") == 2
    out = ex.stop()
    assert out.count("do not load; still serving the previous certificate") == 2, out
    assert "not a PEM certificate and matching private key" in out
    assert "key values mismatch" in out


def test_client_certificates_are_still_required_after_a_renewal(tmp_path: Path) -> None:
    """A connection switched to the renewed context keeps the client policy: no certificate,
    or one of the old CA, is refused; one of the new CA is let in."""
    for name in ("first", "renewed", "live"):
        (tmp_path / name).mkdir()
    first, renewed = make_pki(tmp_path / "first"), make_pki(tmp_path / "renewed")
    live = {name: tmp_path / "live" / name for name in ("tls.crt", "tls.key", "ca.crt")}

    def install(pki: Pki) -> None:
        for name, source in zip(live, (pki.server_cert, pki.server_key, pki.ca), strict=True):
            replace(live[name], source.read_bytes())

    install(first)
    tls = tls_section(first, client_auth_type="RequireAndVerifyClientCert")
    tls |= {"cert_file": str(live["tls.crt"]), "key_file": str(live["tls.key"])}
    tls["client_ca_file"] = str(live["ca.crt"])
    path = write_web_config(tmp_path / "web.yml", {"tls_server_config": tls})
    with LocalExporter(
        "--web.config.file", str(path), ssl_context=first.client_context(with_client_cert=True)
    ) as ex:
        url = ex.url + "/healthz"
        install(renewed)
        assert request(url, renewed.client_context(with_client_cert=True))[0] == 200
        old_client = renewed.client_context()
        old_client.load_cert_chain(first.client_cert, first.client_key)
        for refused in (renewed.client_context(), old_client):
            with pytest.raises((ssl.SSLError, OSError)):
                request(url, refused)
