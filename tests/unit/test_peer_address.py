"""Over internal mutual TLS, a certificate that names IP addresses is a host's: servers take its
holder's calls only from those addresses, and its holder checks servers against the address
it dials. A real grpc.aio server on 127.0.0.1 with health checking as the protected service,
clients with certificates of one CA naming 127.0.0.1, another address, or no address."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.rpc.credentials import INTERNAL_SERVER_NAME, InternalTLS, PeerAddressInterceptor, bind
from pdserve.rpc.server import internal_server
from pdserve.security.internal_tls import CertificateError, certificate_ip_addresses, peer_address
from pki import TestCA

HEALTH = "grpc.health.v1.Health"


def _tls(files) -> InternalTLS:
    return InternalTLS.load(files.cert, files.key, files.ca)


async def _serve(ca: TestCA, addresses: list[str], dns_names: list[str], refused: list[str]):
    srv = internal_server(1 << 20, [PeerAddressInterceptor([HEALTH], refused.append)])
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), srv)
    port = bind(srv, "127.0.0.1:0", _tls(ca.issue("server", addresses, dns_names)))
    await srv.start()
    return srv, f"127.0.0.1:{port}"


@pytest.fixture
async def server(tmp_path):
    """A server whose certificate names 127.0.0.1 and INTERNAL_SERVER_NAME: either kind of
    client can check it."""
    ca = TestCA(tmp_path)
    refused: list[str] = []
    srv, address = await _serve(ca, ["127.0.0.1"], [INTERNAL_SERVER_NAME], refused)
    yield ca, address, refused
    await srv.stop(None)


async def _check(address: str, tls: InternalTLS) -> tuple[grpc.StatusCode, str]:
    """Status of one unary Check and of the first answer of one server-streaming Watch."""
    from pdserve.rpc.credentials import internal_channel

    async with internal_channel(address, None, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            watch = stub.Watch(health_pb2.HealthCheckRequest(), timeout=10)
            await watch.read()
            watch.cancel()
        except grpc.aio.AioRpcError as err:
            return err.code(), err.details()
    return grpc.StatusCode.OK, ""


async def test_a_certificate_naming_the_callers_address_is_taken(server):
    ca, address, refused = server
    files = ca.issue("here", ["127.0.0.1", "10.77.0.12"], [INTERNAL_SERVER_NAME])
    assert await _check(address, _tls(files)) == (grpc.StatusCode.OK, "")
    assert refused == []


async def test_a_certificate_for_another_address_is_refused_with_the_reason(server):
    ca, address, refused = server
    code, details = await _check(address, _tls(ca.issue("elsewhere", ["10.77.0.99"], [INTERNAL_SERVER_NAME])))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "names 10.77.0.99, not 127.0.0.1" in details, details
    assert len(refused) == 1


async def test_a_certificate_naming_no_address_is_the_deployments_and_taken_anywhere(server):
    ca, address, _ = server
    assert await _check(address, _tls(ca.issue("deployment", [], [INTERNAL_SERVER_NAME]))) == (grpc.StatusCode.OK, "")


async def test_a_hosts_certificate_checks_the_server_by_the_address_it_dials(tmp_path):
    ca = TestCA(tmp_path)
    host = _tls(ca.issue("host", ["127.0.0.1"]))
    assert host.addresses == ("127.0.0.1",)
    for addresses, dns_names, expected in ((["127.0.0.1"], [], grpc.StatusCode.OK),
                                           (["127.0.0.2"], [INTERNAL_SERVER_NAME], grpc.StatusCode.UNAVAILABLE),
                                           ([], [INTERNAL_SERVER_NAME], grpc.StatusCode.UNAVAILABLE)):
        srv, address = await _serve(ca, addresses, dns_names, [])
        try:
            assert (await _check(address, host))[0] == expected, (addresses, dns_names)
        finally:
            await srv.stop(None)


def test_a_certificates_ip_addresses_are_read_from_its_der(tmp_path):
    ca = TestCA(tmp_path)
    both = ca.issue("both", ["10.77.0.12", "fd00::7"], [INTERNAL_SERVER_NAME])
    chain = open(both.cert, "rb").read() + open(ca.ca_path, "rb").read()  # the first certificate counts
    assert certificate_ip_addresses(chain) == ("10.77.0.12", "fd00::7")
    assert certificate_ip_addresses(open(ca.issue("name", [], [INTERNAL_SERVER_NAME]).cert, "rb").read()) == ()
    assert certificate_ip_addresses(open(ca.ca_path, "rb").read()) == ()  # no subjectAltName at all
    for junk in (b"cert", b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----"):
        with pytest.raises(CertificateError):
            certificate_ip_addresses(junk)
    assert InternalTLS(b"cert", b"key", b"ca").addresses == ()  # grpc refuses it at the handshake


def test_peer_strings_give_their_ip_address():
    assert str(peer_address("ipv4:10.77.0.12:40000")) == "10.77.0.12"
    assert str(peer_address("ipv6:%5B::ffff:10.0.0.1%5D:5")) == "10.0.0.1"
    assert str(peer_address("ipv6:[::1]:5")) == "::1"
    assert peer_address("unix:/tmp/sock") is None
