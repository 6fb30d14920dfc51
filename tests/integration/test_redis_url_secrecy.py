"""The Redis URL may carry a password (issue 25, item 7): it is never logged, and a hand-off
names the redis backend without its URL (each side uses its own configured one)."""
from __future__ import annotations

import logging

from pdserve.kvtransfer.backends.redis import RedisStore, redacted_url
from pdserve.worker.settings import WorkerSettings
from pdserve.worker.transfer import AdvertisedReceives

PASSWORD = "hunter2-do-not-log"


def test_a_failing_store_logs_where_it_is_not_its_password(redis_server, caplog):
    url = f"redis://user:{PASSWORD}@127.0.0.1:{redis_server.port}/0"  # the server has no such user
    store = RedisStore(url, timeout_s=1.0)
    try:
        with caplog.at_level(logging.DEBUG):
            assert not store.probe()  # AUTH fails: logged and counted
            assert store.count_prefix_hits([1, 2], 5) == 0
    finally:
        store.close()
    assert "probe failed" in caplog.text and f"127.0.0.1:{redis_server.port}/0" in caplog.text
    assert PASSWORD not in caplog.text and PASSWORD not in repr(store.__dict__)
    assert redacted_url(url) == f"redis://127.0.0.1:{redis_server.port}/0"
    assert redacted_url("redis://:pw@[::1]:6379/2") == "redis://[::1]:6379/2"


def test_handoff_endpoints_name_the_redis_backend_without_its_url():
    settings = WorkerSettings.from_settings("decode", {"kv_backends": "redis,disk,recompute",
                                                       "redis_url": f"redis://:{PASSWORD}@10.0.0.5:6379/0",
                                                       "disk_store": "/srv/kv"})

    class Receives:
        endpoints: dict[str, str] = {}

    receives = AdvertisedReceives(Receives(), settings)  # the real endpoint logic over a stand-in receive side
    assert list(receives.endpoints.items()) == [("redis", "redis"), ("disk", "/srv/kv")]
    assert PASSWORD not in repr(settings.transfer_config())
