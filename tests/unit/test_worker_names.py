"""A registrant's names (worker id, model name, backends) and a decode's backend words reach
logs and metric labels: a name that could forge a log line or grow the metric series
without bound is refused or folded into "other"."""
from __future__ import annotations

import pytest

from pdserve.common.errors import InvalidRequestError
from pdserve.proto.pdserve.v1 import common_pb2, decode_pb2, registry_pb2
from pdserve.router.membership import worker_from_proto
from pdserve.router.metrics import MAX_BACKEND_LABELS, RouterMetrics


def _info(**fields) -> registry_pb2.WorkerInfo:
    base = dict(worker_id="decode-0", role=registry_pb2.WORKER_ROLE_DECODE, grpc_address="127.0.0.1:5000",
                model_name="org/SmolLM2-135M-Instruct", block_size=16, kv_backends=["ucx", "disk"])
    return registry_pb2.WorkerInfo(**{**base, **fields})


def test_plain_names_register() -> None:
    assert worker_from_proto(_info()).model_name == "org/SmolLM2-135M-Instruct"


@pytest.mark.parametrize("field,value", [("model_name", "m\nINFO forged line"), ("model_name", 'm"} 1\nx{a="'),
                                         ("worker_id", "d\r0"), ("model_name", "x" * 257)])
def test_a_name_that_could_forge_a_log_line_or_label_is_refused(field: str, value: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        worker_from_proto(_info(**{field: value}))
    assert refused.value.param == field


def test_a_backend_list_entry_is_a_plain_name() -> None:
    with pytest.raises(InvalidRequestError):
        worker_from_proto(_info(kv_backends=["ucx", "bad name"]))


def test_a_decodes_backend_words_cannot_grow_the_series() -> None:
    metrics = RouterMetrics()
    for i in range(3 * MAX_BACKEND_LABELS):
        verdict = common_pb2.TransferVerdict(outcome=common_pb2.TRANSFER_OUTCOME_TRANSFERRED, backend=f"b{i}")
        metrics.observe_finished(decode_pb2.DecodeResponse(transfer=verdict))
    weird = common_pb2.TransferVerdict(outcome=common_pb2.TRANSFER_OUTCOME_TRANSFERRED, backend='x"\n')
    metrics.observe_finished(decode_pb2.DecodeResponse(transfer=weird))
    labels = {s.labels["backend"] for m in metrics.transfers.collect() for s in m.samples}
    assert len(labels) <= MAX_BACKEND_LABELS + 1 and "other" in labels and 'x"\n' not in labels


def test_a_load_report_is_clamped() -> None:
    from pdserve.router.membership import MAX_REPORTED_BACKENDS, MAX_REPORTED_REQUESTS, load_from_proto

    report = common_pb2.WorkerLoad(num_queued=2**32 - 1, num_running=3, num_free_blocks=10**9, num_total_blocks=64,
                                   kv_backends=[common_pb2.KVBackendState(name=f"b{i}", usable=True)
                                                for i in range(40)])
    load = load_from_proto(report)
    assert load.num_queued == MAX_REPORTED_REQUESTS and load.num_running == 3
    assert load.num_free_blocks == 64 and len(load.kv_backends) == MAX_REPORTED_BACKENDS
