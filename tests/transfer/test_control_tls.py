"""Specification of DecodeControl over mutual TLS (transfer/auth.py `ControlTLS`): a real server on loopback with a
certificate for 127.0.0.1, clients with and without certificates of its CA (made here with `cryptography`).

    client: CA-signed certificate + the secret  -> served
    client: no certificate (plain TCP)          -> the connection fails (PeerUnreachableError), nothing served
    client: a certificate of another CA         -> the TLS handshake fails, nothing served
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")
x509 = pytest.importorskip("cryptography.x509")

from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

from k3serve.transfer.auth import ControlTLS, new_secret  # noqa: E402
from k3serve.transfer.backend import AgentInfo  # noqa: E402
from k3serve.transfer.control import (  # noqa: E402
    DecodeControlClient,
    DecodeControlServer,
    HandshakeInfo,
    PeerUnreachableError,
)

COMPAT = "compat-tls"
SECRET = new_secret()
AGENT = AgentInfo("local", "x", b"", ())


def _pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, issuer_key, issuer: str, key, *, ca: bool) -> bytes:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(hours=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                        critical=False)
    return builder.sign(issuer_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def _authority(name: str) -> tuple[bytes, object]:
    key = ec.generate_private_key(ec.SECP256R1())
    return _certificate(name, key, name, key, ca=True), key


def _issue(ca: tuple[bytes, object], ca_name: str, subject: str) -> ControlTLS:
    ca_pem, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    return ControlTLS(ca_pem, _certificate(subject, ca_key, ca_name, key, ca=False), _pem(key))


class Decode:
    def __init__(self) -> None:
        self.calls = 0

    def handshake(self, peer, layout_json, tp_size, tp_rank, request_id) -> HandshakeInfo:
        self.calls += 1
        return HandshakeInfo(AGENT, "{}", 1, 0)


@pytest.fixture(scope="module")
def authority():
    return _authority("k3serve-test-ca")


@pytest.fixture
def decode() -> Decode:
    return Decode()


@pytest.fixture
def server(authority, decode: Decode):
    server = DecodeControlServer(decode, COMPAT, secret=SECRET,
                                 tls=_issue(authority, "k3serve-test-ca", "decode-0")).start()
    yield server
    server.stop(0)


def test_a_client_with_a_certificate_of_the_ca_is_served(authority, server: DecodeControlServer,
                                                         decode: Decode) -> None:
    tls = _issue(authority, "k3serve-test-ca", "prefill-0")
    with DecodeControlClient(server.address, COMPAT, secret=SECRET, tls=tls) as client:
        client.handshake(AGENT, "{}", 1, 0)
    assert decode.calls == 1


def test_a_client_without_a_certificate_is_refused_the_connection(server: DecodeControlServer, decode: Decode) -> None:
    with DecodeControlClient(server.address, COMPAT, secret=SECRET, timeout_s=1.0) as plain:
        with pytest.raises(PeerUnreachableError):
            plain.handshake(AGENT, "{}", 1, 0)
    assert decode.calls == 0


def test_a_client_with_a_certificate_of_another_ca_is_refused(server: DecodeControlServer, decode: Decode) -> None:
    stranger = _issue(_authority("other-ca"), "other-ca", "prefill-0")
    with DecodeControlClient(server.address, COMPAT, secret=SECRET, timeout_s=1.0, tls=stranger) as client:
        with pytest.raises(PeerUnreachableError):
            client.handshake(AGENT, "{}", 1, 0)
    assert decode.calls == 0


def test_the_tls_files_are_read_from_a_certificate_secrets_directory(authority, tmp_path: Path) -> None:
    tls = _issue(authority, "k3serve-test-ca", "decode-0")
    for name, data in (("ca.crt", tls.root_ca), ("tls.crt", tls.cert_chain), ("tls.key", tls.private_key)):
        (tmp_path / name).write_bytes(data)
    assert ControlTLS.from_dir(tmp_path) == tls
    (tmp_path / "tls.key").unlink()
    with pytest.raises(ValueError, match="missing .*tls.key"):
        ControlTLS.from_dir(tmp_path)
