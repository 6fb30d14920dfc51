"""The OpenAI API surface through a disaggregated `pdserve up` (one prefill, one decode, the
default local-prefill threshold): sampling identical on both paths, and the API's options."""
from __future__ import annotations

import json

import pytest
from harness import MODEL, deploy

pytestmark = pytest.mark.slow

LIGHTHOUSE = ("A short story about a lighthouse keeper who finds a message in a bottle. "
              "It begins on a stormy night, when")
STORY = ("Write a short story about a fox who learns to read, set in a small village at the edge "
         "of a great forest, told from the point of view of the village librarian.")


@pytest.fixture(scope="module")
def cluster():
    d = deploy(static_routing=True)  # the tests assert a transfer: no TTFT prediction may keep a prompt local
    yield d
    from pdserve.deploy import up

    up.stop(d.children)


def _generate(cluster, prompt_ids: list[int], seed: int) -> tuple[str, int]:
    """One Generate call through the router's gRPC API: (the text, the transfer outcome). Only
    the router may call a decode (its own key signs the call), so the router chooses: a prompt
    the decode has not cached goes to the prefill service (its uncached part is over the
    local-prefill threshold), the same prompt again is prefilled on the decode."""
    import grpc

    from pdserve.proto.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    sampling = common_pb2.SamplingParams(max_tokens=20, min_tokens=3, temperature=1.0, top_p=1.0, top_k=0,
                                         seed=seed, repetition_penalty=1.0)
    request = generation_pb2.GenerateRequest(request_id=f"seed-{seed}", model=MODEL, sampling=sampling,
                                             token_ids=generation_pb2.TokenIds(ids=prompt_ids))
    text, outcome = [], None
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
        for message in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120):
            text.append(message.text)
            if message.HasField("transfer"):
                outcome = message.transfer.outcome
    return "".join(text), outcome


def test_seeded_sampling_gives_the_same_text_disaggregated_and_local(cluster, hf_reference):
    """Each seed through the prefill service and then prefilled on decode itself (the second
    run reuses decode's cached prompt blocks but samples every token there)."""
    from pdserve.proto.pdserve.v1 import common_pb2

    tok, _ = hf_reference
    for seed in (1, 7, 42, 1234):
        prompt_ids = tok.encode(f"Draft {seed}. {STORY}", add_special_tokens=False)
        remote_text, remote_path = _generate(cluster, prompt_ids, seed)
        local_text, local_path = _generate(cluster, prompt_ids, seed)
        assert (remote_path, local_path) == (common_pb2.TRANSFER_OUTCOME_TRANSFERRED,
                                             common_pb2.TRANSFER_OUTCOME_LOCAL)
        assert remote_text == local_text, seed
    cluster.assert_no_leaks()


def test_logit_bias_and_penalties_reach_the_prefill_and_decode(cluster, hf_reference):
    tok, _ = hf_reference
    client = cluster.openai()
    banana = tok.encode(" banana", add_special_tokens=False)
    assert len(banana) == 1
    out = client.completions.create(model=MODEL, prompt=f"Draft 0. {STORY}", max_tokens=6, temperature=0,
                                    logit_bias={str(banana[0]): 100})
    assert out.choices[0].text == " banana" * 6  # the prefill's first token is biased too
    assert out.model_extra["pdserve"]["transfer"]["outcome"] == "transferred"
    plain = client.completions.create(model=MODEL, prompt=LIGHTHOUSE, max_tokens=24, temperature=0)
    penalised = client.completions.create(model=MODEL, prompt=LIGHTHOUSE, max_tokens=24, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=2.0,
                                          extra_body={"repetition_penalty": 1.5})
    assert plain.choices[0].text and penalised.choices[0].text != plain.choices[0].text
    cluster.assert_no_leaks()


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
# long enough to be prefilled by the prefill service (over the local-prefill threshold)
ASK_PERSON = [{"role": "system", "content": "You are a helpful assistant that answers in JSON. " * 3},
              {"role": "user", "content": "Describe a fictional person with a name and an age."}]
ASK_WEATHER = [{"role": "system", "content": "You are a helpful assistant with access to tools. " * 3},
               {"role": "user", "content": "What is the weather like in Paris today?"}]


def _stream_chat(client, **kwargs) -> tuple[str, list, str | None, dict]:
    content, calls, finish, extra = [], {}, None, {}
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        extra = chunk.model_extra.get("pdserve") or extra
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += (call.function.name or "") if call.function else ""
            entry["arguments"] += (call.function.arguments or "") if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return "".join(content), [calls[i] for i in sorted(calls)], finish, extra


def test_json_schema_answers_validate_stream_and_not(cluster):
    import jsonschema

    client = cluster.openai()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in (0, 5):
        chat = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=60, temperature=0.8,
                                              seed=seed, response_format=fmt)
        assert chat.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)
        if seed == 0:  # the first time: through the prefill service (later ones may hit decode's cache)
            assert chat.model_extra["pdserve"]["transfer"]["outcome"] == "transferred"
    text, _, finish, _ = _stream_chat(client, messages=ASK_PERSON, max_tokens=60, temperature=0,
                                      response_format=fmt)
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    obj = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=60, temperature=0,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    cluster.assert_no_leaks()


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calls_are_well_formed_stream_and_not(cluster, tool_choice):
    import jsonschema

    client = cluster.openai()
    # a prompt of its own, so that decode has none of it cached and the prefill service runs
    messages = [{"role": "system", "content": f"Session {json.dumps(tool_choice)}."}, *ASK_WEATHER]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                          tools=[WEATHER], tool_choice=tool_choice)
    choice = chat.choices[0]
    want_finish = "tool_calls" if tool_choice == "required" else "stop"  # OpenAI's: "stop" for a named function
    assert choice.finish_reason == want_finish and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert chat.model_extra["pdserve"]["transfer"]["outcome"] == "transferred"

    text, calls, finish, _ = _stream_chat(client, messages=messages, max_tokens=60, temperature=0,
                                          tools=[WEATHER], tool_choice=tool_choice)
    assert finish == want_finish and text == ""
    assert [c["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)
    cluster.assert_no_leaks()


def test_auto_tool_choice_answers_the_same_streamed_and_whole(cluster):
    """tool_choice auto, greedy: the streamed answer is what the whole one is — a call sent as
    a call (no JSON leaks out as content), or the same text."""
    client = cluster.openai()
    messages = [{"role": "system", "content": "Session auto."}, *ASK_WEATHER]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                          tools=[WEATHER], tool_choice="auto")
    text, calls, finish, _ = _stream_chat(client, messages=messages, max_tokens=60, temperature=0,
                                          tools=[WEATHER], tool_choice="auto")
    whole = chat.choices[0]
    assert finish == whole.finish_reason
    if whole.message.tool_calls:
        assert text == "" and [c["name"] for c in calls] == [whole.message.tool_calls[0].function.name]
    else:
        assert calls == [] and text == whole.message.content
    cluster.assert_no_leaks()


def test_n_choices_through_the_deployment(cluster):
    client = cluster.openai()
    chat = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=12, temperature=1.0,
                                          n=3, seed=21)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert len({c.message.content for c in chat.choices}) > 1  # seeds 21, 22, 23
    again = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=12, temperature=1.0,
                                           n=3, seed=21)
    assert [c.message.content for c in again.choices] == [c.message.content for c in chat.choices]
    cluster.assert_no_leaks()


def test_echo_with_logprobs_gives_transformers_prompt_logprobs_through_the_prefill(cluster, hf_model):
    """The prompt's logprobs are computed by the prefill service (the request is transferred,
    not prefilled on decode) and equal transformers' over the whole prompt, top 2 included."""
    import torch

    tok, model = hf_model
    prompt = f"Echo. {STORY}"
    out = cluster.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                              echo=True, logprobs=2)
    assert out.model_extra["pdserve"]["transfer"]["outcome"] == "transferred"
    ids = tok(prompt).input_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens[:len(ids)]) == prompt
    for pos in range(1, len(ids)):
        assert lp.token_logprobs[pos] == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=1e-3)
        want = [tok.decode([t]) for t in torch.topk(ref[pos - 1], 2).indices.tolist()]
        assert sorted(lp.top_logprobs[pos]) == sorted(want)
    assert len(lp.tokens) == len(ids) + out.usage.completion_tokens
    cluster.assert_no_leaks()


def test_an_unsupported_schema_is_a_400_and_the_service_stays_healthy(cluster):
    import openai

    client = cluster.openai()
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=8, response_format=bad)
    ok = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=4, temperature=0)
    assert ok.choices[0].message.content
    cluster.assert_no_leaks()
