"""Internal certificates (mutual TLS between the services of one deployment).

Threat: a host's certificate, stolen or copied, used from another address to speak for that
host.

Rule: a certificate that names IP addresses (its iPAddress subjectAltNames) binds its holder
to them: its calls to a protected service are taken only from one of those addresses
(`check_peer_address`), and the address it registers as a worker's must be one of them
(`check_registered_address`: no squatting another host's address). A certificate naming none (the deployment's, whose only SAN is the
internal server name) is taken from any address. Which addresses a service's own
certificate names decides how it checks its peers (`certificate_ip_addresses`). The gRPC
side (credentials, the interceptor) is an adapter in `pdserve.rpc.credentials`.
"""
from __future__ import annotations

import ipaddress
import urllib.parse
from typing import Collection

from cryptography import x509

from pdserve.common.errors import AuthError

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


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


def named_addresses(subject_alt_names) -> set:
    """The IP addresses among a verified peer certificate's subjectAltNames (bytes or str
    each, as the TLS layer reports them); DNS names are skipped."""
    found = set()
    for name in subject_alt_names:
        try:
            found.add(ipaddress.ip_address(name.decode() if isinstance(name, bytes) else name))
        except ValueError:
            continue  # a DNS name
    return found


def peer_address(peer: str) -> Address | None:
    """The IP address of a grpc peer string ("ipv4:10.0.0.1:5000", "ipv6:[::1]:5000", the
    brackets maybe %-escaped); None for another kind (a unix socket)."""
    kind, _, rest = urllib.parse.unquote(peer).partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    try:
        address = ipaddress.ip_address(rest.rpartition(":")[0].strip("[]"))
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address


def check_peer_address(named: Collection[Address], source: Address | None) -> None:
    """AuthError, saying which addresses the certificate names and where the call came
    from, unless a certificate naming `named` may call from `source`."""
    if not named or source in named:
        return
    raise AuthError(f"the peer's certificate names {', '.join(sorted(map(str, named)))}, not {source}, "
                    "the address its call came from")


def check_registered_address(named: Collection[Address], address: str) -> None:
    """AuthError unless a certificate naming `named` may register a worker at `address`
    ("host:port", "[v6]:port"): its host is one of them, or the certificate names none."""
    if not named:
        return
    host = address.rpartition(":")[0].strip("[]")
    try:
        registered = ipaddress.ip_address(host)
    except ValueError:
        registered = None
    if registered not in named:
        raise AuthError(f"the peer's certificate names {', '.join(sorted(map(str, named)))}, not {host}, "
                        "the address it registers")
