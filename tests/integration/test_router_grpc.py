"""The router's gRPC Generation service: streams, options, health and reflection, bad input,
cancel and Abort, echo, tools, n and best_of.
Real router listeners on 127.0.0.1, in-test workers (`router_fakes`)."""
from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from pdserve.proto.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc, registry_pb2, registry_pb2_grpc

from router_fakes import MAX_MODEL_LEN, MODEL, TOKENIZER, WAIT_S, Script, wait_until, words


def test_grpc_generate_carries_penalties_bias_and_constraint_to_decode(make_cluster):
    cluster = make_cluster()
    decode = cluster.add("d0")
    channel, stub = cluster.generation()
    with channel:
        sampling = common_pb2.SamplingParams(max_tokens=8, presence_penalty=0.5, frequency_penalty=0.25,
                                             logit_bias={7: -3.0},
                                             constraint=common_pb2.Constraint(json_schema='{"type": "object"}'))
        request = generation_pb2.GenerateRequest(model=MODEL, prompt="hello", sampling=sampling)
        list(stub.Generate(request, timeout=WAIT_S))
        sent = decode.requests[-1].sampling
        assert (sent.presence_penalty, sent.frequency_penalty, dict(sent.logit_bias)) == (0.5, 0.25, {7: -3.0})
        assert sent.repetition_penalty == 1.0 and sent.constraint.WhichOneof("kind") == "llguidance"
        (grammar,) = json.loads(sent.constraint.llguidance)["grammars"]  # compiled, the object closed
        assert grammar["json_schema"] == {"type": "object", "additionalProperties": False,
                                          "x-guidance": {"whitespace_flexible": False}}
        bad = generation_pb2.GenerateRequest(model=MODEL, prompt="hello", sampling=common_pb2.SamplingParams(
            max_tokens=8, logit_bias={10**6: 1.0}))
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(bad, timeout=WAIT_S))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_grpc_generate_streams_the_same_and_example_client(make_cluster):
    from grpc_client import stream_chat

    cluster = make_cluster()
    cluster.add("d0")
    channel, stub = cluster.generation()
    with channel:
        request = generation_pb2.GenerateRequest(
            model=MODEL, request_id="my-id",
            chat=generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content="hello")]),
            sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0))
        responses = list(stub.Generate(request, timeout=WAIT_S))
        info = stub.ModelInfo(common_pb2.ModelInfoRequest(), timeout=WAIT_S)
    assert "".join(r.text for r in responses) == "Hello, world!"
    assert [t for r in responses for t in r.token_ids] == [100, 101, 102, 103]
    assert {r.request_id for r in responses} == {"my-id"}
    assert responses[0].routing.decode_worker_id == "d0"
    assert responses[0].transfer.outcome == common_pb2.TRANSFER_OUTCOME_LOCAL
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert responses[-1].usage.completion_tokens == 4
    assert info.model_name == MODEL and info.max_model_len == MAX_MODEL_LEN and not info.tokenizer_json

    raw: list = []
    assert "".join(stream_chat(cluster.grpc_address, "hello", max_tokens=8, responses=raw)) == "Hello, world!"
    assert raw[-1].finish_reason == common_pb2.FINISH_REASON_STOP


def test_grpc_health_and_reflection(make_cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    cluster = make_cluster()
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"), timeout=WAIT_S)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        answers = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=WAIT_S)
        names = {s.name for a in answers for s in a.list_services_response.service}
    # Clients see the Generation service only; the registry has a port of its own.
    assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= names and "pdserve.v1.Registry" not in names
    with grpc.insecure_channel(cluster.registry_address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pdserve.v1.Registry"), timeout=WAIT_S)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(cluster.grpc_address) as channel:  # the client port has no Registry
        with pytest.raises(grpc.RpcError) as caught:
            registry_pb2_grpc.RegistryStub(channel).Heartbeat(registry_pb2.HeartbeatRequest(worker_id="d0"),
                                                              timeout=WAIT_S)
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_malformed_and_oversized_grpc_requests_are_invalid_argument(make_cluster):
    from grpc_client import stream_chat

    cluster = make_cluster()
    decode = cluster.add("d0")
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        raw = channel.unary_stream("/pdserve.v1.Generation/Generate", request_serializer=None,
                                   response_deserializer=None)
        for garbage in (b"\xff\xff\xff\xff garbage", b"\x12\x03\xff\xfe\xfd"):  # junk; a non-UTF-8 prompt string
            with pytest.raises(grpc.RpcError) as caught:
                list(raw(garbage, timeout=WAIT_S))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "Traceback" not in caught.value.details() and "Error" not in caught.value.details()
        big = generation_pb2.GenerateRequest(model=MODEL, prompt="x" * 8000)  # over --max-body-bytes (4096)
        with pytest.raises(grpc.RpcError) as caught:
            list(generation_pb2_grpc.GenerationStub(channel).Generate(big, timeout=WAIT_S))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "".join(stream_chat(cluster.grpc_address, "hello", max_tokens=8)) == "Hello, world!"
    assert len(decode.requests) == 1


BAD_GRPC = [
    ("unknown model", dict(model="nope"), grpc.StatusCode.NOT_FOUND),
    ("max_tokens < 1", dict(sampling=common_pb2.SamplingParams(max_tokens=0)), grpc.StatusCode.INVALID_ARGUMENT),
    ("max_tokens beyond context", dict(sampling=common_pb2.SamplingParams(max_tokens=MAX_MODEL_LEN)),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("temperature < 0", dict(sampling=common_pb2.SamplingParams(temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT),
    ("top_p outside (0, 1]", dict(sampling=common_pb2.SamplingParams(top_p=0)), grpc.StatusCode.INVALID_ARGUMENT),
    ("prompt longer than context", dict(prompt=words(MAX_MODEL_LEN)), grpc.StatusCode.INVALID_ARGUMENT),
    ("no prompt", dict(prompt=None), grpc.StatusCode.INVALID_ARGUMENT),
    ("token id outside vocab", dict(prompt=None, token_ids=generation_pb2.TokenIds(ids=[10**6])),
     grpc.StatusCode.INVALID_ARGUMENT),
]


@pytest.mark.parametrize("case", BAD_GRPC, ids=[c[0] for c in BAD_GRPC])
def test_bad_grpc_input_gets_status(make_cluster, case):
    _, fields, code = case
    cluster = make_cluster()
    decode = cluster.add("d0")
    kwargs: dict[str, Any] = dict(model=MODEL, prompt="hello")
    kwargs.update(fields)
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    channel, stub = cluster.generation()
    with channel:
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(generation_pb2.GenerateRequest(**kwargs), timeout=WAIT_S))
        assert caught.value.code() == code
        ok = list(stub.Generate(generation_pb2.GenerateRequest(model=MODEL, prompt="hello"), timeout=WAIT_S))
    assert "".join(r.text for r in ok) == "Hello, world!"
    assert len(decode.requests) == 1


def test_grpc_cancel_and_abort_rpc_reach_decode(make_cluster):
    cluster = make_cluster()
    decode = cluster.add("d0", script=Script(hold_after=1))
    channel, stub = cluster.generation()
    with channel:
        call = stub.Generate(generation_pb2.GenerateRequest(model=MODEL, prompt="hello", request_id="r1"),
                             timeout=WAIT_S)
        assert next(call).text == "Hello"
        r1 = decode.requests[-1].request_id  # the router's id; the client's "r1" is a label
        assert r1.startswith("req-") and len(r1) == len("req-") + 32
        call.cancel()
        wait_until(lambda: r1 in decode.aborts, "Abort after the gRPC cancel")

        call = stub.Generate(generation_pb2.GenerateRequest(model=MODEL, prompt="hello", request_id="r2"),
                             timeout=WAIT_S)
        assert next(call).text == "Hello"
        with pytest.raises(grpc.RpcError) as caught:  # the id is taken while r2 runs
            list(stub.Generate(generation_pb2.GenerateRequest(model=MODEL, prompt="hello", request_id="r2"),
                               timeout=WAIT_S))
        assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert stub.Abort(common_pb2.AbortRequest(request_id="r2"), timeout=WAIT_S).found
        assert decode.aborts[-1] == decode.requests[-1].request_id != "r2"
        rest = list(call)
        assert rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        assert not stub.Abort(common_pb2.AbortRequest(request_id="r2"), timeout=WAIT_S).found


def test_grpc_echo_and_prompt_logprobs_come_once_even_across_a_migration(make_cluster):
    """gRPC echo: the first message names the prompt (a chat as templated) and its ids;
    sampling.prompt_logprobs: the first message with tokens carries them. When the decode dies
    mid-stream, the one the request migrates to is not asked for them again."""
    cluster = make_cluster(decode_policy="round_robin")
    d0 = cluster.add("d0", script=Script(fail_after=2, fail_code=grpc.StatusCode.UNAVAILABLE))
    d1 = cluster.add("d1")
    chat = generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content="tell me")])
    request = generation_pb2.GenerateRequest(model=MODEL, chat=chat, echo=True,
                                             sampling=common_pb2.SamplingParams(max_tokens=4, prompt_logprobs=2))
    channel, stub = cluster.generation()
    with channel:
        responses = list(stub.Generate(request, timeout=WAIT_S))
        prompt_ids = TOKENIZER.encode("<|im_start|>user\ntell me<|im_end|>\n<|im_start|>assistant\n",
                                      add_special_tokens=False).ids
        assert responses[0].prompt_text == "<|im_start|>user\ntell me<|im_end|>\n<|im_start|>assistant\n"
        assert list(responses[0].prompt_token_ids) == prompt_ids
        assert [e.token_id for e in responses[0].prompt_logprobs] == prompt_ids[1:]
        assert [bool(r.prompt_token_ids or r.prompt_text or r.prompt_logprobs) for r in responses].count(True) == 1
        assert "".join(r.text for r in responses) == "Hello, world!"
        served = {d.requests[-1].request_id: d.requests[-1] for d in (d0, d1)}
        assert d0.requests[-1].sampling.prompt_logprobs == 2
        assert list(d1.requests[-1].resumed_token_ids) == [100, 101]
        assert not d1.requests[-1].sampling.HasField("prompt_logprobs") and len(served) == 1
        bad = generation_pb2.GenerateRequest(model=MODEL, prompt="x",
                                             sampling=common_pb2.SamplingParams(prompt_logprobs=21))
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(bad, timeout=WAIT_S))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_grpc_tools_constrain_the_answer_and_report_the_call(make_cluster, monkeypatch):
    """gRPC tools: listed for the model in a system message; "required" or a tool's name
    constrains the answer to a call, "auto" does not; an answer that is a call comes back as
    ToolCall on each choice's last message (its text streamed too); bad tools are
    INVALID_ARGUMENT."""
    import router_fakes

    monkeypatch.setattr(router_fakes, "MAX_MODEL_LEN", 512)  # room for the tool list (a word-level tokenizer)
    cluster = make_cluster()
    decode = cluster.add("d0", script=Script(pieces=('{"name": "get_weather", ', '"arguments": {"city": "Paris"}}')))
    weather = generation_pb2.Tool(name="get_weather", description="The weather in a city.",
                                  parameters_json=json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}))
    chat = generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content="tell me")])
    channel, stub = cluster.generation()
    with channel:
        for choice, constrained in (("required", True), ("get_weather", True), ("", False)):
            request = generation_pb2.GenerateRequest(model=MODEL, chat=chat, tools=[weather], tool_choice=choice, n=2,
                                                     sampling=common_pb2.SamplingParams(max_tokens=8))
            responses = list(stub.Generate(request, timeout=WAIT_S))
            lasts = [r for r in responses if r.finish_reason]
            assert sorted(r.index for r in lasts) == [0, 1]
            for last in lasts:
                (call,) = last.tool_calls
                assert call.name == "get_weather" and json.loads(call.arguments_json) == {"city": "Paris"}
                assert call.id.startswith("call_")
            assert decode.requests[-1].sampling.HasField("constraint") == constrained
        with_tools = len(decode.requests[-1].prompt_token_ids)
        plain = generation_pb2.GenerateRequest(model=MODEL, chat=chat, sampling=common_pb2.SamplingParams(max_tokens=8))
        assert not any(r.tool_calls for r in stub.Generate(plain, timeout=WAIT_S))
        assert len(decode.requests[-1].prompt_token_ids) < with_tools  # the tool list is in the prompt
        for bad in (generation_pb2.GenerateRequest(model=MODEL, prompt="x", tools=[weather]),
                    generation_pb2.GenerateRequest(model=MODEL, chat=chat, tools=[weather], tool_choice="nope"),
                    generation_pb2.GenerateRequest(model=MODEL, chat=chat, tools=[
                        generation_pb2.Tool(name="f", parameters_json="{nope")])):
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(bad, timeout=WAIT_S))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_grpc_generate_with_n_and_best_of(make_cluster):
    """gRPC `n`: each choice its own generation (seeds seed + k, ids request_id-k), their
    messages interleaved and tagged with their index. `best_of` > n: every generation runs
    with logprobs for the ranking, the kept n arrive whole, without logprobs unless asked.
    Bad counts are INVALID_ARGUMENT."""
    cluster = make_cluster()
    decode = cluster.add("d0")
    channel, stub = cluster.generation()
    with channel:
        request = generation_pb2.GenerateRequest(model=MODEL, prompt="hello", request_id="many", n=3,
                                                 sampling=common_pb2.SamplingParams(max_tokens=8, seed=5))
        responses = list(stub.Generate(request, timeout=WAIT_S))
        by_index = {i: [r for r in responses if r.index == i] for i in range(3)}
        assert all("".join(r.text for r in msgs) == "Hello, world!" for msgs in by_index.values())
        assert all(msgs[-1].finish_reason == common_pb2.FINISH_REASON_STOP for msgs in by_index.values())
        sent = decode.requests[-3:]
        assert sorted({r.request_id for r in responses}) == ["many-0", "many-1", "many-2"]  # the labels
        assert len({r.request_id for r in sent}) == 3 and not {r.request_id for r in sent} & {"many-0", "many-1", "many-2"}
        assert sorted(r.sampling.seed for r in sent) == [5, 6, 7]

        best = generation_pb2.GenerateRequest(model=MODEL, prompt="hello", n=1, best_of=3,
                                              sampling=common_pb2.SamplingParams(max_tokens=8))
        responses = list(stub.Generate(best, timeout=WAIT_S))
        assert {r.index for r in responses} == {0} and "".join(r.text for r in responses) == "Hello, world!"
        assert all(r.sampling.logprobs for r in decode.requests[-3:])
        assert not any(r.logprobs for r in responses)
        for bad in (generation_pb2.GenerateRequest(model=MODEL, prompt="x", n=3, best_of=2),
                    generation_pb2.GenerateRequest(model=MODEL, prompt="x", n=200)):
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(bad, timeout=WAIT_S))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_cache_salt_reaches_the_decode_in_its_block_hashes_and_is_bounded(make_cluster):
    """Issue 25, items 2 and 6: the client's ModelInfo gives no block-hash salt; a request's
    cache_salt goes to the decode and changes every block hash the router computes (the same
    salt gives the same hashes); an over-long one is INVALID_ARGUMENT naming cache_salt."""
    from pdserve.common.block_hash import hash_prompt_blocks
    from router_fakes import BLOCK_SIZE, SALT

    cluster = make_cluster()
    worker = cluster.add("d0")
    channel, stub = cluster.generation()
    prompt = words(40)
    with channel:
        assert stub.ModelInfo(common_pb2.ModelInfoRequest(), timeout=WAIT_S).block_hash_salt == 0
        for salt in ("", "tenant-a", "tenant-a", "tenant-b"):
            list(stub.Generate(generation_pb2.GenerateRequest(
                model=MODEL, prompt=prompt, cache_salt=salt, sampling=common_pb2.SamplingParams(max_tokens=2)),
                timeout=WAIT_S))
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(generation_pb2.GenerateRequest(
                model=MODEL, prompt=prompt, cache_salt="x" * 257), timeout=WAIT_S))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in caught.value.details()
    assert dict(caught.value.trailing_metadata() or ()).get("pdserve-error-param") == "cache_salt"
    sent = worker.requests
    assert [r.cache_salt for r in sent] == ["", "tenant-a", "tenant-a", "tenant-b"]
    hashes = [tuple(r.block_hashes) for r in sent]
    assert hashes[0] == tuple(hash_prompt_blocks(sent[0].prompt_token_ids, BLOCK_SIZE, SALT))
    assert hashes[1] == hashes[2] and len(set(hashes[0]) | set(hashes[1]) | set(hashes[3])) == 3 * len(hashes[0])
