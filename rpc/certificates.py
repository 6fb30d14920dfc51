"""The IP addresses a PEM certificate names (the iPAddress entries of its subjectAltName),
read with the standard library: what a service needs to know of its own internal
certificate to decide how it checks its peers (`InternalTLS`).

DER walk: Certificate ::= SEQUENCE { tbsCertificate SEQUENCE { ..., [3] EXPLICIT
Extensions } , ... }; Extension ::= SEQUENCE { extnID OID, critical BOOLEAN OPTIONAL,
extnValue OCTET STRING }; the SAN's value is a SEQUENCE of GeneralName, iPAddress being
[7] IMPLICIT OCTET STRING of 4 or 16 bytes.
"""
from __future__ import annotations

import base64
import ipaddress
import re

_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", re.DOTALL)
_SAN_OID = bytes.fromhex("551d11")  # 2.5.29.17
_SEQUENCE, _OID, _OCTET_STRING, _EXTENSIONS, _IP_ADDRESS = 0x30, 0x06, 0x04, 0xA3, 0x87


class CertificateError(ValueError):
    """The PEM holds no certificate, or its DER does not parse."""


def _children(der: bytes, start: int, end: int) -> list[tuple[int, int, int]]:
    """(tag, value start, value end) of each TLV in der[start:end]."""
    out = []
    while start < end:
        if start + 2 > end:
            raise CertificateError("truncated DER")
        tag, length, start = der[start], der[start + 1], start + 2
        if length & 0x80:  # long form: the next (length & 0x7f) bytes are the length
            num = length & 0x7F
            if num == 0 or num > 4 or start + num > end:
                raise CertificateError("bad DER length")
            length, start = int.from_bytes(der[start:start + num], "big"), start + num
        if start + length > end:
            raise CertificateError("DER value past its parent")
        out.append((tag, start, start + length))
        start += length
    return out


def _only(der: bytes, start: int, end: int, tag: int) -> tuple[int, int]:
    children = _children(der, start, end)
    if not children or children[0][0] != tag:
        raise CertificateError(f"expected DER tag {tag:#x}")
    return children[0][1], children[0][2]


def certificate_ip_addresses(pem: bytes) -> tuple[str, ...]:
    """The IP addresses the first certificate of `pem` names, in its order (() for none)."""
    match = _PEM.search(pem)
    if match is None:
        raise CertificateError("no PEM certificate")
    try:
        der = base64.b64decode(b"".join(match.group(1).split()), validate=True)
    except ValueError:
        raise CertificateError("the PEM certificate is not base64") from None
    cert = _only(der, 0, len(der), _SEQUENCE)
    tbs = _only(der, *cert, _SEQUENCE)
    for tag, start, end in _children(der, *tbs):
        if tag != _EXTENSIONS:
            continue
        for _, ext_start, ext_end in _children(der, *_only(der, start, end, _SEQUENCE)):
            fields = _children(der, ext_start, ext_end)
            if fields and fields[0][0] == _OID and der[fields[0][1]:fields[0][2]] == _SAN_OID:
                value = fields[-1]
                if value[0] != _OCTET_STRING:
                    raise CertificateError("subjectAltName without a value")
                names = _children(der, *_only(der, value[1], value[2], _SEQUENCE))
                return tuple(_address(der[s:e]) for name_tag, s, e in names if name_tag == _IP_ADDRESS)
    return ()


def _address(packed: bytes) -> str:
    if len(packed) not in (4, 16):
        raise CertificateError(f"an iPAddress of {len(packed)} bytes")
    return str(ipaddress.ip_address(packed))
