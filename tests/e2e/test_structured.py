"""Structured output and tools as vLLM's users call them, through a disaggregated `pdserve up`
(router, prefill and decode processes, the default model) and the official OpenAI client:
vLLM's guided_* parameters and structured_outputs (plain and streamed, chat and completions),
schema-true tool calls with OpenAI's finish_reason, tool history in the prompt, parallel
calls, unknown fields listed, prompt_logprobs."""
from __future__ import annotations

import json
import re

import pytest
from harness import MODEL, deploy

pytestmark = pytest.mark.slow

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}  # no additionalProperties
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
                                            "parameters": CITY}}
ASK = [{"role": "system", "content": "You are a helpful assistant. Answer briefly and precisely. " * 3},
       {"role": "user", "content": "What is the weather in Paris?"}]
LARK = 'start: "The answer is " num "."\nnum: /[1-9][0-9]?/'
# a history with two calls and their results: the model answers the next question the same way
HISTORY = [{"role": "user", "content": "What is the weather in Oslo and Lima?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
               {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}]},
           {"role": "tool", "tool_call_id": "call_a", "content": "cold, 2 degrees"},
           {"role": "tool", "tool_call_id": "call_b", "content": "warm, 24 degrees"},
           {"role": "assistant", "content": "Oslo is cold and Lima is warm."},
           {"role": "user", "content": "What is the weather in Paris and Rome?"}]


@pytest.fixture(scope="module")
def cluster():
    d = deploy(static_routing=True)  # the tests assert a transfer: no TTFT prediction may keep a prompt local
    yield d
    from pdserve.deploy import up

    up.stop(d.children)


def _chat(client, stream: bool, **kwargs) -> tuple[str, list[dict], str | None, dict]:
    """(content, tool calls as {"id", "name", "arguments"}, finish_reason, pdserve) of one
    answer, whole or streamed (the calls then gathered from their deltas by index)."""
    if not stream:
        out = client.chat.completions.create(model=MODEL, **kwargs)
        choice = out.choices[0]
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls or []]
        return choice.message.content or "", calls, choice.finish_reason, out.model_extra["pdserve"]
    content, calls, finish, extra = [], {}, None, {}
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        extra = {**(chunk.model_extra.get("pdserve") or {}), **extra}
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += call.id or ""
            entry["name"] += (call.function.name or "") if call.function else ""
            entry["arguments"] += (call.function.arguments or "") if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return "".join(content), [calls[i] for i in sorted(calls)], finish, extra


def _complete(client, stream: bool, **kwargs) -> tuple[str, str | None]:
    if not stream:
        out = client.completions.create(model=MODEL, **kwargs)
        return out.choices[0].text, out.choices[0].finish_reason
    text, finish = [], None
    for chunk in client.completions.create(model=MODEL, stream=True, **kwargs):
        if chunk.choices:
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


def _lark_parses(text: str) -> bool:
    return re.fullmatch(r"The answer is [1-9][0-9]?\.", text) is not None  # LARK's language


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_each_guided_parameter_is_satisfied(cluster, stream):
    import jsonschema

    client = cluster.openai()
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"]}
    fresh = [{"role": "system", "content": f"Session {stream}. " + ASK[0]["content"]}, ASK[1]]  # nothing cached
    text, _, finish, extra = _chat(client, stream, messages=fresh, max_tokens=60, temperature=0,
                                   extra_body={"guided_json": person})
    assert finish == "stop" and extra["transfer"]["outcome"] == "transferred"
    value = json.loads(text)
    jsonschema.validate(value, person)
    assert set(value) == {"name", "age"} and " " not in text.replace(value["name"], "")  # closed, compact
    text, _, finish, _ = _chat(client, stream, messages=ASK, max_tokens=30, temperature=0.7, seed=3,
                               extra_body={"guided_regex": r"(sunny|rainy), [0-9]{1,2} degrees"})
    assert finish == "stop" and re.fullmatch(r"(sunny|rainy), [0-9]{1,2} degrees", text), text
    text, _, finish, _ = _chat(client, stream, messages=ASK, max_tokens=10, temperature=1.0, seed=5,
                               extra_body={"guided_choice": ["sunny", "rainy", "snowy"]})
    assert finish == "stop" and text in ("sunny", "rainy", "snowy")
    text, _, finish, _ = _chat(client, stream, messages=ASK, max_tokens=20, temperature=0,
                               extra_body={"guided_grammar": LARK})
    assert finish == "stop" and _lark_parses(text), text
    text, _, finish, _ = _chat(client, stream, messages=ASK, max_tokens=40, temperature=0,
                               extra_body={"structured_outputs": {"json": CITY}, "guided_whitespace_pattern": "[ ]?"})
    assert finish == "stop" and set(json.loads(text)) == {"city"}
    cluster.assert_no_leaks()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_guided_parameters_on_completions(cluster, stream):
    client = cluster.openai()
    prompt = "Q: Is the sky blue on a clear day?\nA:"
    text, finish = _complete(client, stream, prompt=prompt, max_tokens=5, temperature=0,
                             extra_body={"guided_choice": [" yes", " no"]})
    assert finish == "stop" and text in (" yes", " no")
    text, finish = _complete(client, stream, prompt=prompt, max_tokens=20, temperature=0,
                             extra_body={"structured_outputs": {"regex": r" [A-Z][a-z]+(, [a-z]+)?\."}})
    assert finish == "stop" and re.fullmatch(r" [A-Z][a-z]+(, [a-z]+)?\.", text), text
    text, finish = _complete(client, stream, prompt=prompt, max_tokens=20, temperature=0,
                             extra_body={"structured_outputs": {"grammar": LARK}})
    assert finish == "stop" and _lark_parses(text), text
    cluster.assert_no_leaks()


def test_bad_constraints_are_400s_and_unknown_fields_are_listed(cluster):
    import openai

    client = cluster.openai()
    for bad in ({"guided_regex": "a(b"}, {"guided_grammar": "start: nowhere"}, {"guided_choice": "yes"},
                {"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as caught:
                _chat(client, stream, messages=ASK, max_tokens=4, extra_body=bad)
            assert caught.value.body["param"] and caught.value.body["type"] == "invalid_request_error"
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0,
                                         extra_body={"guided_regexp": "typo", "chat_template_kwargs": {}})
    assert out.choices[0].message.content
    assert out.model_extra["pdserve"]["ignored_fields"] == ["chat_template_kwargs", "guided_regexp"]
    _, _, _, extra = _chat(client, True, messages=ASK, max_tokens=3, extra_body={"guided_regexp": "typo"})
    assert extra["ignored_fields"] == ["guided_regexp"]
    cluster.assert_no_leaks()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_tool_call_validates_with_no_other_keys_and_finishes_with_stop(cluster, stream):
    """The issue's case: parameters {"city": string} with no additionalProperties, max_tokens 64,
    greedy. The call completes, its arguments validate and name no other key."""
    import jsonschema

    client = cluster.openai()
    named = {"type": "function", "function": {"name": "get_weather"}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    text, calls, finish, _ = _chat(client, stream, messages=messages, max_tokens=64, temperature=0,
                                   tools=[WEATHER], tool_choice=named)
    assert finish == "stop" and text == ""
    (call,) = calls
    arguments = json.loads(call["arguments"])
    jsonschema.validate(arguments, {**CITY, "additionalProperties": False})
    assert call["name"] == "get_weather" and call["id"].startswith("call_") and list(arguments) == ["city"]
    text, calls, finish, _ = _chat(client, stream, messages=messages, max_tokens=64, temperature=0,
                                   tools=[WEATHER], tool_choice="required")
    assert finish == "tool_calls" and calls and all(c["name"] == "get_weather" for c in calls)
    cluster.assert_no_leaks()


def test_tool_history_is_rendered_into_the_prompt(cluster, hf_reference):
    """An assistant turn's tool_calls and the tool results reach the prompt: SmolLM2's template
    renders no tool_calls, so the calls are the assistant's text (the JSON the tool note asks
    for); the token count equals transformers' rendering of exactly that conversation."""
    import httpx

    tok, _ = hf_reference
    client = cluster.openai()
    out = client.chat.completions.create(model=MODEL, messages=HISTORY, max_tokens=2, temperature=0)
    calls = [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_weather", "arguments": {"city": "Lima"}}]
    expected = [dict(m) for m in HISTORY]
    expected[1] = {"role": "assistant", "content": json.dumps(calls)}
    expected[2:4] = [{"role": "tool", "content": m["content"]} for m in HISTORY[2:4]]
    ids = tok.apply_chat_template(expected, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert out.usage.prompt_tokens == len(ids)
    tokenized = httpx.post(f"http://127.0.0.1:{cluster.http_port}/tokenize",
                           json={"model": MODEL, "messages": HISTORY}, timeout=30).json()
    assert tokenized["count"] == len(ids) and tokenized["tokens"] == list(ids)
    text = tok.decode(tokenized["tokens"])
    assert json.dumps(calls) in text and "<|im_start|>tool\ncold, 2 degrees<|im_end|>" in text
    assert "warm, 24 degrees" in text
    cluster.assert_no_leaks()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_two_parallel_calls_each_validate(cluster, stream):
    import jsonschema

    client = cluster.openai()
    text, calls, finish, _ = _chat(client, stream, messages=HISTORY, max_tokens=80, temperature=0,
                                   tools=[WEATHER], tool_choice="required")
    assert finish == "tool_calls" and text == "" and len(calls) == 2
    for call in calls:
        assert call["name"] == "get_weather" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), {**CITY, "additionalProperties": False})
    assert len({c["id"] for c in calls}) == 2
    one = client.chat.completions.create(model=MODEL, messages=HISTORY, max_tokens=80, temperature=0,
                                         tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1
    cluster.assert_no_leaks()


def test_http_prompt_logprobs(cluster, hf_model):
    """vLLM's prompt_logprobs on HTTP: None first, then each prompt token's logprob (and the
    top N) as transformers computes them; computed by the prefill service."""
    import torch

    tok, model = hf_model
    prompt = ("Prompt logprobs. The quick brown fox jumps over the lazy dog, twice over, and then the dog "
              "wakes up, looks around the quiet farmyard and decides that it is time to chase the fox.")
    out = cluster.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                              extra_body={"prompt_logprobs": 1})
    assert out.model_extra["pdserve"]["transfer"]["outcome"] == "transferred"
    got = out.choices[0].model_extra["prompt_logprobs"]
    ids = tok(prompt).input_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert got[0] is None and len(got) == len(ids)
    for pos in range(1, len(ids)):
        assert got[pos][str(ids[pos])]["logprob"] == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=1e-3)
        assert str(int(torch.argmax(ref[pos - 1]))) in got[pos]
    streamed = [c.choices[0].model_extra.get("prompt_logprobs") for c in cluster.openai().completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True, extra_body={"prompt_logprobs": 1})]
    # whole, on the first chunk; the same numbers up to float32 summation order (this prompt's
    # blocks are cached on decode now, which may recompute it through its own kernels)
    assert not any(streamed[1:]) and streamed[0][0] is None and len(streamed[0]) == len(got)
    for first, again in zip(got[1:], streamed[0][1:]):
        assert first.keys() == again.keys()
        assert all(again[k]["logprob"] == pytest.approx(v["logprob"], abs=1e-4) for k, v in first.items())
    chat = cluster.openai().chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, temperature=0,
                                                    extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    cluster.assert_no_leaks()


def test_grpc_constraints(cluster):
    """The same forms on gRPC: Constraint regex / choice / grammar / json_schema on
    GenerateRequest.sampling (json_schema closed as on HTTP); a malformed one is INVALID_ARGUMENT."""
    import grpc
    import jsonschema

    from pdserve.proto.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    chat = generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(**m) for m in ASK])

    def generate(constraint: common_pb2.Constraint, **kwargs) -> tuple[str, int]:
        sampling = common_pb2.SamplingParams(max_tokens=40, temperature=0, constraint=constraint)
        request = generation_pb2.GenerateRequest(model=MODEL, chat=chat, sampling=sampling, **kwargs)
        with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
            responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120))
        return "".join(r.text for r in responses), responses[-1].finish_reason

    text, finish = generate(common_pb2.Constraint(regex=r"(sunny|rainy), [0-9]{1,2} degrees"))
    assert finish == common_pb2.FINISH_REASON_STOP and re.fullmatch(r"(sunny|rainy), [0-9]{1,2} degrees", text)
    text, _ = generate(common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=["sunny", "rainy"])))
    assert text in ("sunny", "rainy")
    text, _ = generate(common_pb2.Constraint(grammar=LARK))
    assert _lark_parses(text), text
    text, _ = generate(common_pb2.Constraint(json_schema=json.dumps(CITY)))
    jsonschema.validate(json.loads(text), {**CITY, "additionalProperties": False})
    for bad in (common_pb2.Constraint(regex="a(b"), common_pb2.Constraint(grammar="start: nowhere"),
                common_pb2.Constraint(choice=common_pb2.ChoiceList())):
        with pytest.raises(grpc.RpcError) as caught:
            generate(bad)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    cluster.assert_no_leaks()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_auto_answer_that_is_calls_finishes_with_tool_calls(cluster, stream):
    """tool_choice auto: the model writes freely; after three questions each answered with a
    call (the history) it answers the fourth with a call, which comes back as tool_calls (no
    JSON leaks out as content), finish "tool_calls"."""
    def call(city: str) -> dict:
        return {"role": "assistant", "content": "", "tool_calls": [{"id": f"call_{city}", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": city})}}]}

    shots = [turn for city in ("Oslo", "Lima", "Rome") for turn in ({"role": "user", "content": f"Weather in {city}?"},
                                                                     call(city))]
    client = cluster.openai()
    text, calls, finish, _ = _chat(client, stream, messages=[*shots, {"role": "user", "content": "Weather in Paris?"}],
                                   max_tokens=60, temperature=0, tools=[WEATHER], tool_choice="auto")
    assert (text, finish) == ("", "tool_calls") and [c["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    cluster.assert_no_leaks()
