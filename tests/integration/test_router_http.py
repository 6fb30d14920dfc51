"""The router's OpenAI HTTP front: the official client, the API's options, bad input and its
error shapes, limits, disconnects.
Real router listeners on 127.0.0.1, in-test workers (`router_fakes`)."""
from __future__ import annotations

import json

import grpc
import httpx
import pytest

from pdserve.common.errors import InvalidRequestError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto.pdserve.v1 import common_pb2, generation_pb2

from router_fakes import MAX_MODEL_LEN, MODEL, REPLY, TOKENIZER, WAIT_S, Script, chat_body, wait_until, words


def test_openai_client_chat_and_completions_stream_and_not(make_cluster):
    cluster = make_cluster()
    decode = cluster.add("d0")
    client = cluster.openai()

    assert [m.id for m in client.models.list().data] == [MODEL]

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "tell me a joke"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == "Hello, world!"
    assert chat.choices[0].finish_reason == "stop"
    expected_prompt = TOKENIZER.encode("<|im_start|>user\ntell me a joke<|im_end|>\n<|im_start|>assistant\n",
                                       add_special_tokens=False).ids
    assert list(decode.requests[-1].prompt_token_ids) == expected_prompt
    assert chat.usage.prompt_tokens == len(expected_prompt) and chat.usage.completion_tokens == 4
    verdict = chat.model_extra["pdserve"]["transfer"]
    assert verdict["outcome"] == "local" and verdict["reason"] == "no_prefill_worker"
    assert decode.requests[-1].sampling.temperature == 0.0
    assert decode.requests[-1].sampling.max_tokens == 8

    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                                 max_tokens=8, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello, world!"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].model_extra["pdserve"]["routing"]["decode_worker_id"] == "d0"
    assert chunks[-1].usage.completion_tokens == 4 and not chunks[-1].choices

    completion = client.completions.create(model=MODEL, prompt="hello world", max_tokens=2)
    assert completion.choices[0].text == "Hello,"
    assert completion.choices[0].finish_reason == "length"
    assert list(decode.requests[-1].prompt_token_ids) == TOKENIZER.encode("hello world").ids

    pieces = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt=[[5, 6, 7]], max_tokens=3,
                                                                   stream=True)]
    assert "".join(pieces) == "Hello, world"
    assert list(decode.requests[-1].prompt_token_ids) == [5, 6, 7]
    assert cluster.metric("pdserve_router_requests_total", api="http_chat", outcome="ok") == 2
    assert cluster.metric("pdserve_router_ttft_seconds_count") == 4


def test_logprobs_stop_and_sampling_reach_decode(make_cluster):
    cluster = make_cluster()
    decode = cluster.add("d0")
    chat = cluster.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0.5, top_p=0.9,
        seed=7, stop=["cats", "dogs"], logprobs=True, top_logprobs=2, extra_body={"top_k": 5, "min_tokens": 1})
    sent = decode.requests[-1].sampling
    assert (sent.top_k, sent.seed, list(sent.stop), sent.min_tokens) == (5, 7, ["cats", "dogs"], 1)
    assert abs(sent.temperature - 0.5) < 1e-6 and abs(sent.top_p - 0.9) < 1e-6
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == list(REPLY)
    assert len(content[0].top_logprobs) == 2 and content[0].logprob == -0.25

    completion = cluster.openai().completions.create(model=MODEL, prompt="hello", max_tokens=2, logprobs=1)
    assert completion.choices[0].logprobs.tokens == ["Hello", ","]
    assert completion.choices[0].logprobs.token_logprobs == [-0.25, -0.25]


def test_return_tokens_as_token_ids_names_every_token_by_id(make_cluster):
    """vLLM's return_tokens_as_token_ids: each logprob token (chosen and top) reads
    "token_id:N", streamed or not, chat or completions, whatever text the worker sent."""
    cluster = make_cluster()
    cluster.add("d0")
    client = cluster.openai()
    ids = {"return_tokens_as_token_ids": True}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4,
                                          logprobs=True, top_logprobs=2, extra_body=ids)
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{100 + i}" for i in range(len(REPLY))]
    assert [t.token for t in content[0].top_logprobs] == ["token_id:100", "token_id:101"]
    assert content[0].bytes == list(b"token_id:100")
    streamed = [c.choices[0].logprobs.content[0].token
                for c in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=4, logprobs=True, stream=True, extra_body=ids)
                if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content]
    assert streamed == [f"token_id:{100 + i}" for i in range(len(REPLY))]
    completion = client.completions.create(model=MODEL, prompt="hello", max_tokens=2, logprobs=1, extra_body=ids)
    assert completion.choices[0].logprobs.tokens == ["token_id:100", "token_id:101"]
    plain = client.completions.create(model=MODEL, prompt="hello", max_tokens=2, logprobs=1)
    assert plain.choices[0].logprobs.tokens == ["Hello", ","]
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        bad = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "return_tokens_as_token_ids": 3})
    assert bad.status_code == 400 and "return_tokens_as_token_ids" in bad.json()["error"]["message"]


def test_n_best_of_and_prompt_lists_give_indexed_choices(make_cluster):
    cluster = make_cluster()
    decode = cluster.add("d0")
    client = cluster.openai()
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, n=3, seed=5)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert all(c.message.content == "Hello, world!" for c in chat.choices)
    assert sorted(r.sampling.seed for r in decode.requests[-3:]) == [5, 6, 7]
    assert chat.usage.completion_tokens == 12 and chat.usage.prompt_tokens == len(decode.requests[-1].prompt_token_ids)

    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=8, n=2, stream=True,
                                                 stream_options={"include_usage": True}))
    for index in (0, 1):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == index)
        assert text == "Hello, world!"
    assert chunks[-1].usage.completion_tokens == 8

    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:  # a bad stream still gets its status
        answer = http.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "stream": True,
                                                    "max_tokens": MAX_MODEL_LEN})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "max_tokens"
    listed = client.completions.create(model=MODEL, prompt=["hello", [5, 6, 7]], max_tokens=2, n=2)
    assert [c.index for c in listed.choices] == [0, 1, 2, 3]
    assert all(c.text == "Hello," for c in listed.choices)
    best = client.completions.create(model=MODEL, prompt="hello", max_tokens=2, n=1, best_of=3)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert all(r.sampling.logprobs for r in decode.requests[-3:])  # asked for the ranking


def test_echo_puts_the_prompt_first(make_cluster):
    cluster = make_cluster()
    cluster.add("d0")
    client = cluster.openai()
    assert client.completions.create(model=MODEL, prompt="hello", max_tokens=2, echo=True).choices[0].text == "hello" + "Hello,"
    pieces = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt="hi", max_tokens=2, echo=True,
                                                                   stream=True)]
    assert pieces[0].startswith("hi") and "".join(pieces) == "hiHello,"
    ids = TOKENIZER.encode("well then", add_special_tokens=False).ids
    listed = client.completions.create(model=MODEL, prompt=["a", ids], max_tokens=2, echo=True)
    assert [c.text for c in listed.choices] == ["aHello,", TOKENIZER.decode(ids, skip_special_tokens=False) + "Hello,"]


def test_echo_with_logprobs_lists_the_prompt_tokens_first(make_cluster):
    """OpenAI's echo + logprobs: the prompt's tokens come first in the logprobs (the first
    with none), then the generated ones, offsets counted through the echoed text; streamed
    the same. A migrated request would not ask its second decode for them again."""
    cluster = make_cluster()
    decode = cluster.add("d0")
    client = cluster.openai()
    whole = client.completions.create(model=MODEL, prompt="tell me a joke", max_tokens=2, echo=True, logprobs=0)
    lp = whole.choices[0].logprobs
    assert whole.choices[0].text == "tell me a jokeHello,"
    assert lp.tokens == ["tell", "me", "a", "joke", "Hello", ","]
    assert lp.token_logprobs == [None, -1.0, -2.0, -3.0, -0.25, -0.25]
    assert lp.text_offset == [0, 4, 6, 7, 14, 19]
    assert decode.requests[-1].sampling.prompt_logprobs == 0
    chunks = list(client.completions.create(model=MODEL, prompt="tell me", max_tokens=2, echo=True, logprobs=1,
                                            stream=True))
    first = chunks[0].choices[0]
    assert first.text == "tell meHello" and first.logprobs.tokens == ["tell", "me", "Hello"]
    assert first.logprobs.token_logprobs == [None, -1.0, -0.25] and first.logprobs.top_logprobs[0] is None
    assert chunks[1].choices[0].logprobs.tokens == [","] and chunks[1].choices[0].logprobs.text_offset == [12]
    plain = client.completions.create(model=MODEL, prompt="tell me", max_tokens=2, logprobs=0)
    assert plain.choices[0].logprobs.tokens == ["Hello", ","]
    assert not decode.requests[-1].sampling.HasField("prompt_logprobs")


def test_tokenize_and_detokenize(make_cluster):
    cluster = make_cluster()
    cluster.add("d0")
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        text = http.post("/tokenize", json={"model": MODEL, "prompt": "hello world", "return_token_strs": True}).json()
        ids = TOKENIZER.encode("hello world").ids
        assert text["tokens"] == ids and text["count"] == len(ids) and text["max_model_len"] == MAX_MODEL_LEN
        assert text["token_strs"] == [TOKENIZER.id_to_token(i) for i in ids]
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "tell me a joke"}]}).json()
        expected = TOKENIZER.encode("<|im_start|>user\ntell me a joke<|im_end|>\n<|im_start|>assistant\n",
                                    add_special_tokens=False).ids
        assert chat["tokens"] == expected and chat["token_strs"] is None
        back = http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()
        assert back == {"prompt": TOKENIZER.decode(ids, skip_special_tokens=False)}
        for path, body, param in (("/detokenize", {"tokens": [10**7]}, "tokens"), ("/tokenize", {"prompt": 3}, "prompt"),
                                  ("/tokenize", {"model": "nope", "prompt": "x"}, "model")):
            answer = http.post(path, json=body)
            assert answer.status_code in (400, 404) and answer.json()["error"]["param"] == param


def test_tokenize_detokenize_and_stop_token_ids_are_bounded_before_any_work(make_cluster):
    """/tokenize takes the raw-size bound generation applies (no tokenizing of a prompt that
    cannot fit), /detokenize at most a context of ids, a request at most 256 stop_token_ids;
    each is refused with a 400 naming the field, and the router serves on."""
    cluster = make_cluster(max_body_bytes=1 << 20)
    decode = cluster.add("d0")
    huge = "w1 " * (MAX_MODEL_LEN * 32)  # over 32 characters per token of context
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        for path, body, param in (
                ("/tokenize", {"model": MODEL, "prompt": huge}, "prompt"),
                ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": huge}]}, "messages"),
                ("/detokenize", {"model": MODEL, "tokens": [1] * (MAX_MODEL_LEN + 1)}, "tokens"),
                ("/v1/chat/completions", chat_body(max_tokens=2, stop_token_ids=[1] * 257), "stop_token_ids")):
            answer = http.post(path, json=body)
            assert answer.status_code == 400, (path, answer.text)
            assert answer.json()["error"]["param"] == param, (path, answer.json())
        assert not decode.requests
        ok = http.post("/v1/chat/completions", json=chat_body(max_tokens=2, stop_token_ids=[1] * 256))
        assert ok.status_code == 200 and len(decode.requests) == 1



def test_cache_salt_is_bounded_and_passed_on(make_cluster):
    """Issue 25, item 6: cache_salt is a string of at most 256 characters (else a 400 naming
    it, nothing sent to a worker); a valid one reaches the decode with the request."""
    cluster = make_cluster()
    decode = cluster.add("d0")
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        for path, body in (("/v1/chat/completions", chat_body(max_tokens=2, cache_salt="x" * 257)),
                           ("/v1/completions", {"model": MODEL, "prompt": "hi", "cache_salt": 7}),
                           ("/v1/completions", {"model": MODEL, "prompt": "hi", "cache_salt": ["a"]})):
            answer = http.post(path, json=body)
            assert answer.status_code == 400, (path, answer.text)
            assert answer.json()["error"]["param"] == "cache_salt", answer.json()
        assert not decode.requests
        for path, body in (("/v1/chat/completions", chat_body(max_tokens=2, cache_salt="t" * 256)),
                           ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "cache_salt": "t1"})):
            assert http.post(path, json=body).status_code == 200
    assert [r.cache_salt for r in decode.requests] == ["t" * 256, "t1"]

BAD_HTTP = [
    ("malformed json", "/v1/chat/completions", b'{"model": ', 400, None),
    ("non-object body", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("unknown model", "/v1/chat/completions", chat_body(model="nope"), 404, "model"),
    ("max_tokens < 1", "/v1/chat/completions", chat_body(max_tokens=0), 400, "max_tokens"),
    ("max_tokens beyond context", "/v1/chat/completions", chat_body(max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
    ("temperature < 0", "/v1/chat/completions", chat_body(temperature=-0.1), 400, "temperature"),
    ("temperature > 2", "/v1/chat/completions", chat_body(temperature=2.5), 400, "temperature"),
    ("top_p = 0", "/v1/chat/completions", chat_body(top_p=0), 400, "top_p"),
    ("top_p > 1", "/v1/chat/completions", chat_body(top_p=1.5), 400, "top_p"),
    ("n too large", "/v1/chat/completions", chat_body(n=1000), 400, "n"),
    ("best_of < n", "/v1/chat/completions", chat_body(n=3, best_of=2), 400, "best_of"),
    ("string max_tokens", "/v1/chat/completions", chat_body(max_tokens="8"), 400, "max_tokens"),
    ("empty messages", "/v1/chat/completions", chat_body(messages=[]), 400, "messages"),
    ("bad role", "/v1/chat/completions", chat_body(messages=[{"role": "wizard", "content": "x"}]), 400, "messages"),
    ("prompt longer than context", "/v1/completions", {"model": MODEL, "prompt": words(MAX_MODEL_LEN)}, 400, "prompt"),
    ("token id outside vocab", "/v1/completions", {"model": MODEL, "prompt": [1, 10**6]}, 400, "prompt"),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("oversized body", "/v1/completions", {"model": MODEL, "prompt": "w1 " * 2000}, 413, None),
    ("lone surrogate in a prompt", "/v1/completions", b'{"model": "' + MODEL.encode() + b'", "prompt": "a\\ud800b"}',
     400, None),
    ("lone surrogate in a message", "/v1/chat/completions",
     b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "\\udfff"}]}', 400, None),
    ("JSON nested past the recursion limit", "/v1/completions", b"[" * 2_040 + b"]" * 2_040, 400, None),
    ("raw prompt that can never fit", "/v1/completions",
     {"model": MODEL, "prompt": "x" * (MAX_MODEL_LEN * 32 + 1)}, 400, "prompt"),
]


@pytest.mark.parametrize("case", BAD_HTTP, ids=[c[0] for c in BAD_HTTP])
def test_bad_http_input_gets_openai_error(make_cluster, case):
    _, path, body, status, param = case
    cluster = make_cluster()
    decode = cluster.add("d0")
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        answer = http.post(path, content=content, headers={"content-type": "application/json"})
        assert answer.status_code == status, answer.text
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param
        assert http.get("/health").status_code == 200
        ok = http.post("/v1/chat/completions", json=chat_body(max_tokens=2))
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "Hello,"
    assert len(decode.requests) == 1  # the bad request never reached the worker


def test_sampling_values_are_refused_as_the_engine_refuses_them(make_cluster):
    """The router applies the engine's sampling table (common.sampling): a value the engine
    refuses is a 400 in OpenAI's shape with the engine's message and param."""
    cluster = make_cluster()
    decode = cluster.add("d0")
    cases = [({"temperature": 2.5}, dict(temperature=2.5)), ({"top_p": 0}, dict(top_p=0.0)),
             ({"logprobs": True, "top_logprobs": 21}, dict(logprobs=21)),
             ({"prompt_logprobs": 21}, dict(prompt_logprobs=21)),
             ({"repetition_penalty": 0}, dict(repetition_penalty=0.0)),
             ({"presence_penalty": -2.5}, dict(presence_penalty=-2.5)),
             ({"logit_bias": {"1": 101}}, dict(logit_bias={1: 101.0})), ({"max_tokens": 0}, dict(max_tokens=0)),
             ({"max_tokens": 2, "min_tokens": 3}, dict(max_tokens=2, min_tokens=3))]
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        for body, engine in cases:
            with pytest.raises(InvalidRequestError) as caught:
                SamplingParams(**engine)
            answer = http.post("/v1/chat/completions", json=chat_body(**body))
            assert answer.status_code == 400, body
            assert answer.json()["error"] == {"message": str(caught.value), "type": "invalid_request_error",
                                              "param": caught.value.param, "code": None}
    assert not decode.requests


def test_oversized_chunked_body_is_413_while_reading(make_cluster):
    cluster = make_cluster()
    cluster.add("d0")

    def body():  # no Content-Length: the limit must hold while reading
        yield b'{"model": "tiny-chat", "prompt": "'
        for _ in range(10):
            yield b"w1 " * 200
        yield b'"}'

    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        answer = http.post("/v1/completions", content=body(), headers={"content-type": "application/json"})
        assert answer.status_code == 413
        assert answer.json()["error"]["code"] == "payload_too_large"
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        assert http.get("/health").status_code == 200


def test_no_worker_is_503_and_api_key_is_enforced(make_cluster):
    cluster = make_cluster(api_key="sekret")
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        assert http.get("/ready").status_code == 503
        no_worker = http.post("/v1/chat/completions", json=chat_body(), headers={"authorization": "Bearer sekret"})
        assert no_worker.status_code == 503
        assert no_worker.json()["error"]["type"] == "server_error"
        cluster.add("d0")
        assert http.get("/ready").status_code == 200
        assert http.post("/v1/chat/completions", json=chat_body()).status_code == 401
        wrong = http.post("/v1/chat/completions", json=chat_body(), headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/v1/models").status_code == 401
    assert cluster.openai("sekret").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=1).choices[0].message.content == "Hello"
    channel, stub = cluster.generation()
    with channel:
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(generation_pb2.GenerateRequest(model=MODEL, prompt="hello"), timeout=WAIT_S))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = list(stub.Generate(generation_pb2.GenerateRequest(model=MODEL, prompt="hello"), timeout=WAIT_S,
                                metadata=[("authorization", "Bearer sekret")]))
    assert ok[-1].finish_reason == common_pb2.FINISH_REASON_STOP


def test_queue_bound_gives_429_with_retry_after(make_cluster):
    cluster = make_cluster(max_queue=1)
    decode = cluster.add("d0", script=Script(hold_after=1))
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        with http.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as held:
            assert held.status_code == 200
            lines = held.iter_lines()
            assert next(lines).startswith("data: ")  # the request is in flight, holding
            refused = http.post("/v1/chat/completions", json=chat_body())
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "rate_limit_error"
            channel, stub = cluster.generation()
            with channel, pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(generation_pb2.GenerateRequest(model=MODEL, prompt="hello"), timeout=WAIT_S))
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(caught.value.trailing_metadata())["retry-after"] == "1"
        # Leaving the stream early aborted it; the slot is free again.
        wait_until(lambda: decode.aborts, "the abort")
        wait_until(lambda: cluster.metric("pdserve_router_in_flight_requests") == 0, "in-flight back to 0")
    decode.script = Script()
    assert cluster.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=1).choices[0].message.content == "Hello"


def test_http_client_disconnect_mid_stream_aborts_on_decode(make_cluster):
    cluster = make_cluster()
    decode = cluster.add("d0", script=Script(hold_after=2))
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "hello", "stream": True,
                                                          "max_tokens": 4}) as response:
            lines = response.iter_lines()
            assert json.loads(next(lines).removeprefix("data: "))["choices"][0]["text"] == "Hello"
        # The client hung up after the first token.
    wait_until(lambda: decode.aborts == [decode.requests[0].request_id], "Abort at the decode worker")
    wait_until(lambda: cluster.metric("pdserve_router_requests_total", api="http_completions",
                                      outcome="aborted") == 1, "the aborted outcome")


def test_http_non_streaming_disconnect_aborts_on_decode(make_cluster):
    cluster = make_cluster()
    decode = cluster.add("d0", script=Script(hold_after=1))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{cluster.http}/v1/chat/completions", json=chat_body(), timeout=0.5)
    wait_until(lambda: decode.aborts == [decode.requests[0].request_id], "Abort at the decode worker")


def _sse_lines(cluster, body: dict) -> tuple[int, list[str]]:
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            return response.status_code, [line for line in response.iter_lines() if line]


def test_a_slow_first_token_keeps_the_stream_alive_and_a_late_error_is_an_event(make_cluster, monkeypatch):
    """A first token slower than the router's hold commits the answer to 200 and keeps the
    connection alive with SSE comments (a client's read timeout must not cut a request that
    is still on its way); an error after that arrives as an error event, then [DONE]."""
    from pdserve.router import http_api

    monkeypatch.setattr(http_api, "FIRST_MESSAGE_HOLD_S", 0.1)
    monkeypatch.setattr(http_api, "KEEPALIVE_S", 0.05)
    cluster = make_cluster()
    decode = cluster.add("d0", script=Script(first_delay_s=0.6))
    status, lines = _sse_lines(cluster, chat_body(max_tokens=8, stream=True))
    assert status == 200
    assert lines[0].startswith(": waiting")
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in data if c["choices"]) == "Hello, world!"
    assert lines[-1] == "data: [DONE]"

    decode.script = Script(first_delay_s=0.6, fail_after=0)
    status, lines = _sse_lines(cluster, chat_body(max_tokens=8, stream=True))
    assert status == 200 and lines[0].startswith(": waiting")
    errors = [json.loads(line[6:])["error"] for line in lines if line.startswith("data: {")]
    assert errors and errors[0]["message"], lines
    assert lines[-1] == "data: [DONE]"

    decode.script = Script()  # a fast first token still answers as before, with no comment
    status, lines = _sse_lines(cluster, chat_body(max_tokens=8, stream=True))
    assert status == 200 and lines[0].startswith("data: ")
    assert cluster.metric("pdserve_router_requests_total", api="http_chat", outcome="ok") == 2


def test_a_client_gone_while_the_first_token_is_slow_aborts_the_request(make_cluster, monkeypatch):
    from pdserve.router import http_api

    monkeypatch.setattr(http_api, "FIRST_MESSAGE_HOLD_S", 0.1)
    monkeypatch.setattr(http_api, "KEEPALIVE_S", 0.05)
    cluster = make_cluster()
    decode = cluster.add("d0", script=Script(first_delay_s=5.0))
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        with http.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=8, stream=True)) as response:
            assert response.status_code == 200
            assert next(line for line in response.iter_lines() if line).startswith(": waiting")
    wait_until(lambda: decode.cancelled or decode.aborts, "the decode call cancelled or aborted")
