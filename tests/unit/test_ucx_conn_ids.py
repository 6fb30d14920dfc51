"""UCX tags are matched per worker, across endpoints: a connection's tag prefix (its id) is
random, so one peer cannot guess another connection's and aim payloads at its receives."""
from __future__ import annotations

import collections
import types

import pytest

pytest.importorskip("ucxx", reason="the ucx backend needs ucxx")

from pdserve.kvtransfer.backends import ucx  # noqa: E402


def test_connection_ids_are_random_and_never_handed_out_twice_while_remembered(monkeypatch):
    monkeypatch.setattr(ucx, "MAX_CONN_IDS", 1000)
    runtime = types.SimpleNamespace(_conn_ids=collections.OrderedDict())
    ids = [ucx._Runtime.next_conn_id(runtime) for _ in range(1000)]
    assert len(set(ids)) == 1000 and all(0 < i < 2**32 for i in ids)
    steps = {b - a for a, b in zip(ids, ids[1:])}
    assert len(steps) > 900  # not a counter
    ucx._Runtime.next_conn_id(runtime)
    assert len(runtime._conn_ids) == 1000 and ids[0] not in runtime._conn_ids  # the oldest is forgotten
