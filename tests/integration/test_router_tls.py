"""TLS on the client ports and mutual TLS on internal gRPC.
Real router listeners on 127.0.0.1, in-test workers (`router_fakes`)."""
from __future__ import annotations

import grpc
import httpx
import openai
import pytest

from pdserve.proto.pdserve.v1 import common_pb2, generation_pb2_grpc, registry_pb2
from pdserve.rpc.credentials import INTERNAL_SERVER_NAME, InternalTLS
from pdserve.security.credentials import CallKey, CallSigner
from pdserve.security.secret import ClusterSecret
from pdserve.worker.registry_client import RegistryClient

from router_fakes import MODEL, REPLY, WAIT_S, FakeWorker


def _self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 made here (cryptography), and its key, as PEM files."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    import ipaddress

    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def test_tls_on_the_client_ports_and_metrics_behind_the_api_key(make_cluster, tmp_path):
    cert, key = _self_signed(tmp_path)
    cluster = make_cluster(tls_cert=cert, tls_key=key, api_key="sesame", metrics_auth=True)
    cluster.add("d0")
    https = cluster.http.replace("http://", "https://")
    with httpx.Client(base_url=https, verify=cert, timeout=WAIT_S) as client:
        assert client.get("/health").status_code == 200 and client.get("/ready").status_code == 200
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers={"Authorization": "Bearer sesame"}).status_code == 200
        chat = openai.OpenAI(base_url=f"{https}/v1", api_key="sesame", http_client=client, max_retries=0)
        answer = chat.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8)
        assert answer.choices[0].message.content == "".join(REPLY)
    with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on a TLS port
        httpx.get(f"{cluster.http}/health", timeout=WAIT_S)
    with open(cert, "rb") as f:
        credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
    with grpc.secure_channel(cluster.grpc_address, credentials) as channel:
        info = generation_pb2_grpc.GenerationStub(channel).ModelInfo(
            common_pb2.ModelInfoRequest(model=MODEL), timeout=WAIT_S, metadata=[("authorization", "Bearer sesame")])
    assert info.model_name == MODEL


def _internal_pki(tmp_path) -> dict[str, str]:
    """A CA and the deployment's certificate (SAN pdserve-internal) signed by it; and a second
    CA's certificate, as an outsider would have. PEM paths."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(subject: str, key, issuer: str, issuer_key, ca: bool):
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(INTERNAL_SERVER_NAME)]),
                                            critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    out = {}
    for name in ("ours", "theirs"):
        ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
        ca = cert(f"{name}-ca", ca_key, f"{name}-ca", ca_key, True)
        leaf = cert(INTERNAL_SERVER_NAME, leaf_key, f"{name}-ca", ca_key, False)
        for kind, data in (("ca", ca.public_bytes(serialization.Encoding.PEM)),
                           ("cert", leaf.public_bytes(serialization.Encoding.PEM)),
                           ("key", leaf_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))):
            path = tmp_path / f"{name}-{kind}.pem"
            path.write_bytes(data)
            path.chmod(0o600)  # a key others may read is refused, as the cluster secret is
            out[f"{name}_{kind}"] = str(path)
    return out


def test_internal_grpc_over_mutual_tls(make_cluster, tmp_path, loop_thread):
    pki = _internal_pki(tmp_path)
    secret_path = tmp_path / "cluster-secret"
    secret = ClusterSecret.create(secret_path)
    ours = InternalTLS.load(pki["ours_cert"], pki["ours_key"], pki["ours_ca"])
    cluster = make_cluster(cluster_secret_file=str(secret_path), internal_tls_cert=pki["ours_cert"],
                           internal_tls_key=pki["ours_key"], internal_tls_ca=pki["ours_ca"])
    cluster.add("d0", signer=CallSigner(secret, "d0", CallKey()), tls=ours)  # registry and router -> d0 both over mTLS
    chat = cluster.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=8)
    assert chat.choices[0].message.content == "".join(REPLY)
    # plaintext, and TLS with a certificate of another CA, never reach the registry
    theirs = InternalTLS.load(pki["theirs_cert"], pki["theirs_key"], pki["theirs_ca"])
    mixed = InternalTLS(theirs.cert, theirs.key, ours.ca)  # trusts us, but is not trusted
    for tls in (None, mixed):
        async def try_register() -> None:
            client = RegistryClient(cluster.registry_address, FakeWorker(registry_pb2.WORKER_ROLE_DECODE, "d9",
                                                                          address="127.0.0.1:9").info(),
                                    lambda: common_pb2.WorkerLoad(), rpc_timeout_s=2.0, retry_s=0.05,
                                    signer=CallSigner(secret, "d9", CallKey()), tls=tls)
            client.start()
            try:
                with pytest.raises(TimeoutError):
                    await client.wait_registered(1.5)
                assert client.num_refused >= 1
            finally:
                await client.stop(deregister=False)

        loop_thread.run(try_register())
    assert cluster.router.registry.get("d9") is None


def test_a_host_certificate_registers_only_its_own_addresses(make_cluster, tmp_path, loop_thread, caplog):
    from pki import TestCA

    (tmp_path / "ca").mkdir()
    ca = TestCA(tmp_path / "ca")
    router_files, worker_files = ca.issue("router", ["127.0.0.1"]), ca.issue("worker", ["127.0.0.1"])
    secret_path = tmp_path / "cluster-secret"
    secret = ClusterSecret.create(secret_path)
    cluster = make_cluster(cluster_secret_file=str(secret_path), internal_tls_cert=router_files.cert,
                           internal_tls_key=router_files.key, internal_tls_ca=router_files.ca)
    tls = InternalTLS.load(worker_files.cert, worker_files.key, worker_files.ca)

    async def register(worker_id: str, address: str) -> RegistryClient:
        client = RegistryClient(cluster.registry_address, FakeWorker(registry_pb2.WORKER_ROLE_DECODE, worker_id,
                                                                      address=address).info(),
                                lambda: common_pb2.WorkerLoad(), rpc_timeout_s=2.0, retry_s=0.05,
                                signer=CallSigner(secret, worker_id, CallKey()), tls=tls)
        client.start()
        return client

    squatter = loop_thread.run(register("d-squat", "10.9.9.9:5000"))  # another host's address
    try:
        from router_fakes import wait_until
        wait_until(lambda: squatter.num_refused >= 1, "the squatter's Register refused")
        assert cluster.router.registry.get("d-squat") is None
        assert any("not 10.9.9.9, the address it registers" in r.getMessage() for r in caplog.records)
    finally:
        loop_thread.run(squatter.stop(deregister=False))
    cluster.add("d-own", signer=CallSigner(secret, "d-own", CallKey()), tls=tls)  # its own address: accepted
    assert cluster.router.registry.get("d-own") is not None
