"""Test certificates made on the spot with `cryptography`: a CA, a server and a client it signed,
and a second ("rogue") CA with its own client, for the cases that must be refused.

EC P-256 keys (fast to make); PEM files: certificates and PKCS#8 private keys.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path
    rogue_client_cert: Path
    rogue_client_key: Path


def make_pki(folder: Path) -> Pki:
    """Write every certificate and key into `folder`."""
    ca_key, ca_cert = _authority("Tandem test CA")
    rogue_key, rogue_cert = _authority("Rogue CA")
    server = _leaf(ca_key, ca_cert, "localhost", ExtendedKeyUsageOID.SERVER_AUTH,
                   [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client = _leaf(ca_key, ca_cert, "tandem-frontend", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    rogue_client = _leaf(rogue_key, rogue_cert, "intruder", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    paths = {
        "ca": _write_cert(folder / "ca.pem", ca_cert),
        "rogue_ca": _write_cert(folder / "rogue-ca.pem", rogue_cert),
    }
    for name, (key, cert) in (("server", server), ("client", client), ("rogue_client", rogue_client)):
        paths[f"{name}_cert"] = _write_cert(folder / f"{name}.pem", cert)
        paths[f"{name}_key"] = _write_key(folder / f"{name}-key.pem", key)
    return Pki(**paths)


def _authority(common_name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    cert = (_builder(name, name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(ca_key, ca_cert, common_name: str, usage, alt_names: list):
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (_builder(_name(common_name), ca_cert.subject, key.public_key())
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if alt_names:
        builder = builder.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1)))


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _write_key(path: Path, key) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path
