"""A test CA and certificates signed by it, made with `cryptography` (a test dependency):
internal mTLS material whose certificates name hosts' IP addresses."""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """PEM paths of one service's internal TLS material (key mode 0600, as the services ask)."""

    cert: str
    key: str
    ca: str

    def flags(self) -> list[str]:
        return ["--internal-tls-cert", self.cert, "--internal-tls-key", self.key, "--internal-tls-ca", self.ca]


class TestCA:
    """A CA in `directory`; `issue(name, addresses, dns_names)` writes a certificate and its key."""

    __test__ = False  # not a test class

    def __init__(self, directory: Path) -> None:
        from cryptography.hazmat.primitives.asymmetric import ec

        self.directory = directory
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._cert = self._sign("pdserve-test-ca", self._key, [], ca=True)
        self.ca_path = self._write("ca.pem", self._pem(self._cert))

    def issue(self, name: str, addresses: Sequence[str] = (), dns_names: Sequence[str] = ()) -> TLSFiles:
        from cryptography import x509
        from cryptography.hazmat.primitives.asymmetric import ec

        key = ec.generate_private_key(ec.SECP256R1())
        sans = [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses] + [x509.DNSName(d) for d in dns_names]
        cert = self._sign(name, key, sans, ca=False)
        return TLSFiles(self._write(f"{name}-cert.pem", self._pem(cert)),
                        self._write(f"{name}-key.pem", self._pem_key(key)), self.ca_path)

    def _sign(self, subject: str, key, sans: list, ca: bool):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.x509.oid import NameOID

        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve-test-ca")]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(self._key if not ca else key, hashes.SHA256())

    @staticmethod
    def _pem(cert) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return cert.public_bytes(serialization.Encoding.PEM)

    @staticmethod
    def _pem_key(key) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    def _write(self, name: str, data: bytes) -> str:
        path = self.directory / name
        path.write_bytes(data)
        path.chmod(0o600)
        return str(path)
