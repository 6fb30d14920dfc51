"""The IP addresses a PEM certificate names (the iPAddress entries of its subjectAltName):
what a service needs to know of its own internal certificate to decide how it checks its
peers (`InternalTLS`)."""
from __future__ import annotations

from cryptography import x509


class CertificateError(ValueError):
    """The PEM holds no certificate, or it does not parse."""


def certificate_ip_addresses(pem: bytes) -> tuple[str, ...]:
    """The IP addresses the first certificate of `pem` names, in its order (() for none)."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    except ValueError as exc:
        raise CertificateError(f"not a PEM certificate: {exc}") from None
    return tuple(str(address) for address in names.get_values_for_type(x509.IPAddress))
