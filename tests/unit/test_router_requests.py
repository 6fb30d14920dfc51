"""Request checks shared by HTTP and gRPC (validation.py) and the OpenAI body parser."""
from __future__ import annotations

import math

import pytest

from pdserve.common.errors import EXPECTED_ERRORS, ErrorKind, to_service_error
from pdserve.common.sampling import COMPLETIONS_MAX_TOKENS
from pdserve.proto.pdserve.v1 import common_pb2, generation_pb2
from pdserve.router.openai_format import Collected, ResponseFormatter
from pdserve.router.openai_request import parse_chat, parse_completion
from pdserve.router.validation import check_prompt_fits, resolve_sampling

CTX, VOCAB = 100, 50


def resolve(prompt_len: int = 10, **fields) -> common_pb2.SamplingParams:
    return resolve_sampling(common_pb2.SamplingParams(**fields), prompt_len, CTX, VOCAB)


def test_defaults_are_resolved():
    sampling = resolve()
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k) == (90, 1.0, 1.0, 0)
    assert not sampling.HasField("seed")
    exact = resolve(max_tokens=90, temperature=0, top_p=1, seed=3)
    assert (exact.max_tokens, exact.temperature, exact.seed) == (90, 0.0, 3)


@pytest.mark.parametrize("fields, param", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=91), "max_tokens"),
    (dict(temperature=-0.01), "temperature"),
    (dict(temperature=2.01), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(stop=[""]), "stop"),
    (dict(stop=["x"] * 17), "stop"),
    (dict(stop_token_ids=[VOCAB]), "stop_token_ids"),
    (dict(max_tokens=5, min_tokens=6), "min_tokens"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"),
])
def test_bad_sampling_is_invalid_argument(fields, param):
    with pytest.raises(EXPECTED_ERRORS) as caught:
        resolve(**fields)
    assert caught.value.kind is ErrorKind.INVALID_ARGUMENT and caught.value.param == param


def test_prompt_must_leave_room_for_a_token():
    check_prompt_fits(CTX - 1, CTX, "prompt")
    with pytest.raises(EXPECTED_ERRORS) as caught:
        check_prompt_fits(CTX, CTX, "messages")
    assert caught.value.param == "messages"
    assert to_service_error(caught.value).openai_body()["error"]["code"] == "context_length_exceeded"


def test_chat_body_maps_onto_generate_request():
    parsed = parse_chat({"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                                    {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                 {"type": "text", "text": "b"}]}],
                         "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": -1, "seed": 1,
                         "stop": "END", "logprobs": True, "top_logprobs": 3, "user": "alice", "stream": True,
                         "stream_options": {"include_usage": True}, "presence_penalty": 0, "unknown_extra": 1})
    request = parsed.request
    assert [(m.role, m.content) for m in request.chat.messages] == [("system", "be brief"), ("user", "a\nb")]
    s = request.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, list(s.stop)) == (7, 0.0, 0.5, 0, 1, ["END"])
    assert (s.logprobs, s.top_logprobs, request.session_id) == (True, 3, "alice")
    assert parsed.stream and parsed.include_usage and parsed.model == "m"
    assert not parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]}).request.sampling.HasField(
        "max_tokens")  # chat default: the rest of the context


def test_penalties_and_logit_bias_map_onto_sampling():
    s = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5,
                    "frequency_penalty": -1, "repetition_penalty": 1.3, "logit_bias": {"7": -100, "9": 2.5}}
                   ).request.sampling
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, -1.0)
    assert s.repetition_penalty == pytest.approx(1.3) and dict(s.logit_bias) == {7: -100.0, 9: 2.5}


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -3),
                                          ("repetition_penalty", 0), ("logit_bias", {"10": 1}),
                                          ("logit_bias", {"1": 101})])
def test_out_of_range_penalties_are_refused(field, value):
    s = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], field: value}).request.sampling
    with pytest.raises(EXPECTED_ERRORS) as caught:
        resolve_sampling(s, 3, 64, vocab_size=10)
    assert caught.value.param == field


def test_n_and_prompt_lists_fan_out_into_choices():
    parsed = parse_completion({"model": "m", "prompt": ["a", [5, 6]], "n": 2, "seed": 9})
    choices = parsed.choices()
    assert [(c.prompt_index, c.copy_index) for c in choices] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [c.request.prompt for c in choices[:2]] == ["a", "a"]
    assert list(choices[2].request.token_ids.ids) == [5, 6]
    assert [c.request.sampling.seed for c in choices] == [9, 10, 9, 10]  # distinct, reproducible
    best = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2, "best_of": 4})
    assert (best.n, best.best_of, len(best.choices())) == (2, 4, 4)


def test_response_format_and_tools_become_constraints():
    import json

    user = [{"role": "user", "content": "x"}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    s = parse_chat({"model": "m", "messages": user, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}).request.sampling
    assert json.loads(s.constraint.json_schema) == schema
    assert parse_chat({"model": "m", "messages": user, "response_format": {"type": "json_object"}}
                      ).request.sampling.constraint.json_object
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    required = parse_chat({"model": "m", "messages": user, "tools": [tool], "tool_choice": "required"})
    assert required.tool_mode.mode == "required" and required.tool_mode.names == ("f",)
    calls = json.loads(required.request.sampling.constraint.json_schema)  # required: a list of calls
    assert calls["type"] == "array" and calls["minItems"] == 1
    assert calls["items"]["properties"] == {"name": {"const": "f"}, "arguments": schema}
    assert [t.name for t in required.request.tools] == ["f"]  # the prompt builder lists them
    named = parse_chat({"model": "m", "messages": user, "tools": [tool],
                        "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert named.tool_mode.named and json.loads(named.request.sampling.constraint.json_schema)["properties"][
        "name"] == {"const": "f"}
    auto = parse_chat({"model": "m", "messages": user, "tools": [tool]})
    assert auto.tool_mode.mode == "auto" and not auto.request.sampling.HasField("constraint")
    assert parse_chat({"model": "m", "messages": user, "tools": [tool], "tool_choice": "none"}).tool_mode.mode == ""


def test_tool_call_answers_are_formatted_as_tool_calls():
    import json

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    parsed = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [tool],
                         "tool_choice": "required"})
    done = generation_pb2.GenerateResponse(request_id="r", text='{"name":"f","arguments":{"k":1}}',
                                           finish_reason=common_pb2.FINISH_REASON_STOP)
    collected = Collected()
    collected.add(done)
    choice = ResponseFormatter(True, "m", "c", False, str, tool_mode=parsed.tool_mode).whole(collected)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "f" and json.loads(call["function"]["arguments"]) == {"k": 1}
    streamer = ResponseFormatter(True, "m", "c", False, str, tool_mode=parsed.tool_mode)
    first = streamer.chunk(generation_pb2.GenerateResponse(request_id="r", text='{"name":"f",'), False)
    assert "content" not in first["choices"][0]["delta"]  # held back until the call is whole
    last = streamer.chunk(generation_pb2.GenerateResponse(request_id="r", text='"arguments":{}}',
                                                          finish_reason=common_pb2.FINISH_REASON_STOP), False)
    assert last["choices"][0]["finish_reason"] == "tool_calls"
    assert last["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "f"


def _stream(formatter: ResponseFormatter, pieces: list[str]) -> list[dict]:
    """The chunks' (delta, finish_reason) of a streamed answer given as text pieces."""
    out = []
    for i, piece in enumerate(pieces):
        finish = common_pb2.FINISH_REASON_STOP if i == len(pieces) - 1 else common_pb2.FINISH_REASON_UNSPECIFIED
        chunk = formatter.chunk(generation_pb2.GenerateResponse(request_id="r", text=piece, finish_reason=finish),
                                False)["choices"][0]
        out.append((chunk["delta"], chunk["finish_reason"]))
    return out


def test_streamed_auto_tool_choice_sends_a_call_as_a_call_and_text_as_it_comes():
    """tool_choice auto, streamed: an answer that starts as a JSON object is held back and
    becomes a tool call when it is one (its text when not); any other answer streams as it
    comes, from its first visible character on."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    mode = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [tool]}).tool_mode
    call = _stream(ResponseFormatter(True, "m", "c", False, str, tool_mode=mode),
                   [" ", '{"name": "f", ', '"arguments": {"a": 1}}'])
    assert [d.get("content") for d, _ in call[:2]] == [None, None]
    assert call[2][1] == "tool_calls" and call[2][0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    text = _stream(ResponseFormatter(True, "m", "c", False, str, tool_mode=mode), ["\n", "Paris", " is", " sunny"])
    assert [d.get("content") for d, _ in text] == [None, "\nParis", " is", " sunny"]
    assert text[-1][1] == "stop"
    braces = _stream(ResponseFormatter(True, "m", "c", False, str, tool_mode=mode), ["{not", " json}"])
    assert [d.get("content") for d, _ in braces] == [None, "{not json}"] and braces[-1][1] == "stop"


def test_completion_body_maps_onto_generate_request():
    parsed = parse_completion({"model": "m", "prompt": ["hi"], "logprobs": 2})
    assert parsed.request.prompt == "hi"
    assert parsed.request.sampling.max_tokens == COMPLETIONS_MAX_TOKENS == 16  # OpenAI's completions default
    assert parsed.request.sampling.logprobs and parsed.request.sampling.top_logprobs == 2
    ids = parse_completion({"model": "m", "prompt": [[1, 2, 3]], "max_tokens": 2}).request
    assert list(ids.token_ids.ids) == [1, 2, 3]


@pytest.mark.parametrize("parse, body, param", [
    (parse_chat, {"messages": [{"role": "user", "content": "x"}]}, "model"),
    (parse_chat, {"model": "m", "messages": "hi"}, "messages"),
    (parse_chat, {"model": "m", "messages": [{"content": "x"}]}, "messages"),
    (parse_chat, {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    (parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    (parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2, "best_of": 3,
                  "stream": True}, "best_of"),
    (parse_completion, {"model": "m", "prompt": ["a"] * 65, "n": 2}, "n"),
    (parse_completion, {"model": "m", "prompt": ["a", []]}, "prompt"),
    (parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format"),
    (parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                  "tools": [{"type": "function", "function": {"name": "f"}}],
                  "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    (parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}, "max_tokens"),
    (parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "max_tokens"),
    (parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    (parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    (parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": [1]}, "stop"),
    (parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"x": 1}]}, "tools"),
    (parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {}}, "stream_options"),
    (parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_k": -2}, "top_k"),
    (parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": 2**64}, "seed"),
    (parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"x": 1}}, "logit_bias"),
    (parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": "big"}}, "logit_bias"),
    (parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "presence_penalty": "x"}, "presence_penalty"),
    (parse_completion, {"model": "m", "prompt": [1, -2]}, "prompt"),
    (parse_completion, {"model": "m", "prompt": "x", "logprobs": 21}, "logprobs"),
    (parse_completion, {"model": "m", "prompt": "x", "max_tokens": 2**40}, "max_tokens"),
])
def test_malformed_openai_fields_name_the_field(parse, body, param):
    with pytest.raises(EXPECTED_ERRORS) as caught:
        parse(body)
    assert caught.value.kind is ErrorKind.INVALID_ARGUMENT and caught.value.param == param


def test_formatter_builds_openai_shapes():
    first = generation_pb2.GenerateResponse(request_id="r", token_ids=[5], text="Hi")
    first.routing.decode_worker_id = "d0"
    first.transfer.outcome = common_pb2.TRANSFER_OUTCOME_RECOMPUTED
    last = generation_pb2.GenerateResponse(request_id="r", token_ids=[6], text="!",
                                           finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                           usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=2,
                                                                  cached_prompt_tokens=1))
    collected = Collected()
    collected.add(first)
    collected.add(last)
    whole = ResponseFormatter(True, "m", "chatcmpl-1", False, str).whole(collected)
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "Hi!"}
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                              "prompt_tokens_details": {"cached_tokens": 1}}
    assert whole["pdserve"]["transfer"]["outcome"] == "recomputed"
    assert whole["pdserve"]["routing"]["decode_worker_id"] == "d0"
    chunks = ResponseFormatter(False, "m", "cmpl-1", False, str)
    assert chunks.chunk(first, include_usage=True)["choices"][0] == {"index": 0, "finish_reason": None,
                                                                      "logprobs": None, "text": "Hi"}
    assert chunks.usage_chunk(last.usage)["choices"] == []
