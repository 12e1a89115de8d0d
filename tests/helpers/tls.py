"""Certificates and web configuration files for the TLS and basic-auth tests.

A throw-away CA signs a server certificate for 127.0.0.1 and localhost and a client
certificate, all made with the ``cryptography`` package in the test's directory; a real
exporter and a real Prometheus verify them as they would a cluster's own CA.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bcrypt
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

USER = "prometheus"
PASSWORD = "s3cret-scrape-password"


@dataclass(frozen=True)
class Pki:
    """PEM files of one CA and the certificates it signed."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def client_context(self, *, with_client_cert: bool = False) -> ssl.SSLContext:
        """A client context that trusts the CA (and presents the client certificate)."""
        ctx = ssl.create_default_context(cafile=str(self.ca))
        if with_client_cert:
            ctx.load_cert_chain(self.client_cert, self.client_key)
        return ctx


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def make_pki(directory: Path, *dns_names: str) -> Pki:
    """A CA, a server certificate (127.0.0.1, ::1, localhost and ``dns_names``) and a client
    certificate."""
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=1)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("trainmon test CA"))
        .issuer_name(_name("trainmon test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(cn: str, usage: x509.ObjectIdentifier, san: list[x509.GeneralName]) -> Any:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(ca_key, hashes.SHA256()), key

    server, server_key = leaf(
        "trainmon exporter",
        ExtendedKeyUsageOID.SERVER_AUTH,
        [
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("::1")),
            x509.DNSName("localhost"),
            *(x509.DNSName(name) for name in dns_names),
        ],
    )
    client, client_key = leaf("trainmon scraper", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    pem = serialization.Encoding.PEM
    pki = Pki(
        ca=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
    )
    pki.ca.write_bytes(ca.public_bytes(pem))
    pki.server_cert.write_bytes(server.public_bytes(pem))
    _write_key(server_key, pki.server_key)
    pki.client_cert.write_bytes(client.public_bytes(pem))
    _write_key(client_key, pki.client_key)
    return pki


def bcrypt_hash(password: str, rounds: int = 10) -> str:
    """What ``htpasswd -nBC 10`` writes after the colon (``$2b$`` rather than ``$2y$``)."""
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds)).decode()


def write_web_config(path: Path, config: dict[str, Any]) -> Path:
    """``config`` as the YAML web configuration file ``path``."""
    path.write_text(yaml.safe_dump(config))
    return path
