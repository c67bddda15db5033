"""Self-signed certificates made at test time (never committed): a CA and a leaf for 127.0.0.1
(and any other addresses a test names)."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_tls_files(directory: Path, prefix: str = "", ips: Sequence[str] = ()) -> dict[str, str]:
    """Write ``{prefix}ca.pem``, ``{prefix}cert.pem`` and ``{prefix}key.pem`` into ``directory``.

    The leaf is valid for 127.0.0.1, localhost and ``ips`` (e.g. each emulated host's
    address), as a server and as a client (every role is both). Returns the three paths
    keyed by the CommonConfig field names.
    """
    now = datetime.datetime.now(datetime.UTC)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"{prefix}persia test CA")
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(valid[0]).not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder().subject_name(_name("persia role")).issuer_name(ca_name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(valid[0]).not_valid_after(valid[1])
        .add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"),
            *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", *ips))]),
            critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                              ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {
        "tls_ca_file": directory / f"{prefix}ca.pem",
        "tls_cert_file": directory / f"{prefix}cert.pem",
        "tls_key_file": directory / f"{prefix}key.pem",
    }
    paths["tls_ca_file"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["tls_cert_file"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["tls_key_file"].write_bytes(_pem_key(key))
    paths["tls_key_file"].chmod(0o600)
    return {k: str(v) for k, v in paths.items()}
