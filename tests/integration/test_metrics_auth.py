"""Metrics listeners of their own (a worker's --metrics-port, the router's): a bearer token
when set (the router's --metrics-port follows --metrics-auth as its HTTP /metrics does), GET
/metrics only, and at most a few connections served at once, the rest closed, so idle
connections cost no thread each. Real sockets, a real router."""
from __future__ import annotations

import socket
import threading

import httpx
import pytest
from router_fakes import wait_until

from pdserve.common.metrics_http import MetricsServer
from pdserve.worker.metrics import WorkerMetrics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def worker_metrics():
    metrics = WorkerMetrics("decode")
    metrics.requests.labels(outcome="ok").inc()
    server = metrics.serve("127.0.0.1", free_port(), token="scrape-me")
    yield f"http://127.0.0.1:{server.port}"
    server.shutdown()


def test_worker_metrics_answer_only_the_token(worker_metrics):
    assert httpx.get(f"{worker_metrics}/metrics").status_code == 401
    assert httpx.get(f"{worker_metrics}/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = httpx.get(f"{worker_metrics}/metrics", headers={"Authorization": "Bearer scrape-me"})
    assert ok.status_code == 200 and 'pdserve_worker_requests_total{outcome="ok"} 1.0' in ok.text
    assert httpx.get(f"{worker_metrics}/", headers={"Authorization": "Bearer scrape-me"}).status_code == 404


def test_without_a_token_the_worker_metrics_stay_open():
    metrics = WorkerMetrics("prefill")
    server = metrics.serve("127.0.0.1", free_port())
    try:
        assert httpx.get(f"http://127.0.0.1:{server.port}/metrics").status_code == 200
    finally:
        server.shutdown()
    assert metrics.serve("127.0.0.1", 0) is None


def closed_by_server(sock: socket.socket, timeout_s: float = 10.0) -> bool:
    """Whether the server closes `sock` (EOF or reset) before `timeout_s`; sends nothing."""
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_connections_take_no_thread_each():
    # The held connections must stay held for the whole test: a long request timeout.
    server = MetricsServer("127.0.0.1", 0, lambda: b"up 1\n", token=None, max_connections=4,
                           request_timeout_s=120.0)

    def handlers() -> int:  # this process's metrics handler threads (other tests' may linger)
        return sum(t.name == "pdserve-metrics" for t in threading.enumerate())

    before = handlers()
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
    extra = []
    try:
        wait_until(lambda: server.num_serving == 4, "the first connections were not served")
        extra = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(60)]
        assert all(closed_by_server(sock) for sock in extra), "a connection past the limit was kept"
        assert server.num_serving == 4 and handlers() <= before + 4
    finally:
        for sock in held + extra:
            sock.close()
        server.shutdown()


def test_a_silent_client_is_dropped_and_scrapes_resume():
    server = MetricsServer("127.0.0.1", 0, lambda: b"up 1\n", token=None, max_connections=1,
                           request_timeout_s=0.5)
    silent = socket.create_connection(("127.0.0.1", server.port))
    try:
        wait_until(lambda: server.num_serving == 1, "the silent connection was not served")
        assert closed_by_server(silent), "a client that sent nothing was not dropped"
        wait_until(lambda: server.num_serving == 0, "the dropped connection still holds its slot")
        assert httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=5).text == "up 1\n"
    finally:
        silent.close()
        server.shutdown()


def _key_file(path, text: str) -> str:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return str(path)


def test_the_routers_metrics_answer_only_the_metrics_token_from_its_file(make_cluster, tmp_path):
    """Issue 48, item 7: the router's /metrics (it names workers and their prefix-cache hits)
    answers only the scraper's token, read from a file, on HTTP and on its metrics port;
    the API key (read from a file too), a tenant's or nothing gets 401. The API key still
    serves the API."""
    port = free_port()
    cluster = make_cluster(api_key_file=_key_file(tmp_path / "api-key", "client-k"),
                           metrics_token_file=_key_file(tmp_path / "token", "scraper-t"), metrics_port=port)
    for url in (f"{cluster.http}/metrics", f"http://127.0.0.1:{port}/metrics"):
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer client-k"}).status_code == 401
        ok = httpx.get(url, headers={"Authorization": "Bearer scraper-t"})
        assert ok.status_code == 200 and "pdserve_router_requests_total" in ok.text
    assert httpx.get(f"{cluster.http}/v1/models").status_code == 401
    assert httpx.get(f"{cluster.http}/v1/models", headers={"Authorization": "Bearer client-k"}).status_code == 200


def test_a_key_file_others_can_read_or_two_api_keys_stop_the_router(tmp_path):
    from pdserve.router.config import ConfigError, RouterConfig
    from pdserve.security.secret import ClusterSecretError

    shared = _key_file(tmp_path / "shared", "k")
    (tmp_path / "shared").chmod(0o644)
    with pytest.raises((ConfigError, ClusterSecretError), match="readable by others"):
        RouterConfig(metrics_token_file=shared)
    with pytest.raises(ConfigError, match="give one"):
        RouterConfig(api_key="a", api_key_file=_key_file(tmp_path / "api", "tok-b7e1"))
    assert RouterConfig(api_key_file=str(tmp_path / "api")).api_key == "tok-b7e1"
    assert "tok-b7e1" not in repr(RouterConfig(metrics_token_file=str(tmp_path / "api")))


def test_the_routers_metrics_port_follows_metrics_auth(make_cluster):
    port = free_port()
    make_cluster(api_key="sesame", metrics_auth=True, metrics_port=port)
    url = f"http://127.0.0.1:{port}/metrics"
    assert httpx.get(url).status_code == 401
    ok = httpx.get(url, headers={"Authorization": "Bearer sesame"})
    assert ok.status_code == 200 and "pdserve_router_requests_total" in ok.text



def test_a_client_dripping_its_headers_is_dropped_at_the_deadline():
    server = MetricsServer("127.0.0.1", 0, lambda: b"up 1\n", token=None, max_connections=1,
                           request_timeout_s=1.0)
    drip = socket.create_connection(("127.0.0.1", server.port))
    stop = threading.Event()

    def drip_loop() -> None:  # the attacker's pace: a byte every 0.2 s, each read well within its timeout
        try:
            while not stop.wait(0.2):
                drip.sendall(b"X")
        except OSError:
            pass

    try:
        drip.sendall(b"GET /metrics HTTP/1.1\r\n")
        wait_until(lambda: server.num_serving == 1, "the dripping connection was not served")
        threading.Thread(target=drip_loop, daemon=True).start()
        wait_until(lambda: server.num_serving == 0, "a dripping client held its slot past the deadline", 5.0)
        assert httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=5).text == "up 1\n"
    finally:
        stop.set()
        drip.close()
        server.shutdown()
