"""The router end to end on 127.0.0.1: real HTTP and gRPC listeners, real Registry, and
small in-test decode / prefill workers (real grpc.aio servers) that register, heartbeat
and stream a scripted reply. The fakes isolate the router: they never run a model.

Everything async runs on one event loop in a background thread, so the tests themselves
use ordinary blocking clients (openai, httpx, grpc).
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import openai
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from pdserve.common.block_hash import hash_prompt_blocks
from pdserve.common.auth import CREDENTIAL_HEADER, CallSigner, CallVerifier, ClusterSecret
from pdserve.rpc.credentials import INTERNAL_SERVER_NAME, InternalTLS, bind
from pdserve.worker.registry_client import RegistryClient
from pdserve.proto.pdserve.v1 import (common_pb2, decode_pb2, decode_pb2_grpc, generation_pb2,
                                      generation_pb2_grpc, prefill_pb2_grpc, registry_pb2,
                                      registry_pb2_grpc)
from pdserve.router.app import RouterApp
from pdserve.router.config import Role, RouterConfig, StaticWorker

MODEL = "tiny-chat"
MAX_MODEL_LEN = 64
BLOCK_SIZE = 4
SALT = 1234
WAIT_S = 10.0  # every wait in these tests ends by then
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ["system", "user", "assistant", "tell", "me", "a", "joke", "about", "cats", "hello"] + [f"w{i}" for i in range(200)]
REPLY = ("Hello", ",", " world", "!")


def tiny_tokenizer_json() -> bytes:
    """A word-level tokenizer: one token per word, so prompt lengths are easy to reason about."""
    vocab = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for word in WORDS:
        vocab[word] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return tokenizer.to_str().encode()


TOKENIZER_JSON = tiny_tokenizer_json()
TOKENIZER = Tokenizer.from_str(TOKENIZER_JSON.decode())
VOCAB_SIZE = TOKENIZER.get_vocab_size()


def model_info(include_tokenizer: bool) -> common_pb2.ModelInfoResponse:
    return common_pb2.ModelInfoResponse(
        model_name=MODEL, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, block_hash_salt=SALT,
        eos_token_ids=[2], vocab_size=VOCAB_SIZE, chat_template=TEMPLATE, bos_token="<|im_start|>",
        eos_token="<|im_end|>", special_tokens={"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"},
        tokenizer_json=TOKENIZER_JSON if include_tokenizer else b"")


def words(n: int, start: int = 0) -> str:
    return " ".join(f"w{i}" for i in range(start, start + n))


class LoopThread:
    """An asyncio loop in a daemon thread; `run` executes a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="router-test-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Any, timeout: float = WAIT_S) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(WAIT_S)
        self.loop.close()


@dataclass
class Script:
    """What a fake decode worker streams: one token per piece, optionally holding after
    `hold_after` tokens until the request is aborted or cancelled."""

    pieces: tuple[str, ...] = REPLY
    delay_s: float = 0.0
    hold_after: int | None = None
    fail_after: int | None = None  # end the call with `fail_code` after this many tokens
    fail_code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
    prefill_status_code: str = ""  # report the prefill leg failed with this code (then recomputed)


@dataclass
class FakeWorker:
    role: int  # registry_pb2.WORKER_ROLE_*
    worker_id: str
    script: Script = field(default_factory=Script)
    cached_hashes: list[int] = field(default_factory=list)
    compatibility_hash: int = 77
    requests: list[decode_pb2.DecodeRequest] = field(default_factory=list)
    requests_metadata: list = field(default_factory=list)  # each Decode call's invocation metadata
    aborts: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    address: str = ""
    _server: Any = None
    client: RegistryClient | None = None
    _abort_events: dict = field(default_factory=dict)

    async def start(self, tls: InternalTLS | None = None) -> None:
        server = grpc.aio.server()
        if self.role == registry_pb2.WORKER_ROLE_DECODE:
            decode_pb2_grpc.add_DecodeServicer_to_server(_FakeDecode(self), server)
        else:
            prefill_pb2_grpc.add_PrefillServicer_to_server(_FakePrefill(self), server)
        port = bind(server, "127.0.0.1:0", tls)
        await server.start()
        self._server, self.address = server, f"127.0.0.1:{port}"

    def info(self) -> registry_pb2.WorkerInfo:
        return registry_pb2.WorkerInfo(worker_id=self.worker_id, role=self.role, grpc_address=self.address,
                                       model_name=MODEL, compatibility_hash=self.compatibility_hash,
                                       block_size=BLOCK_SIZE, capacity=registry_pb2.WorkerCapacity(num_total_blocks=64))

    def load(self) -> common_pb2.WorkerLoad:
        return common_pb2.WorkerLoad(num_free_blocks=64, num_total_blocks=64, cached_block_hashes=self.cached_hashes)

    async def register(self, router_address: str, signer: CallSigner | None = None,
                       tls: InternalTLS | None = None) -> None:
        """Through the real worker-side client (register, heartbeat, re-register on NOT_FOUND)."""
        self.client = RegistryClient(router_address, self.info(), self.load, rpc_timeout_s=WAIT_S, retry_s=0.05,
                                     signer=signer, tls=tls)
        self.client.start()
        await self.client.wait_registered(WAIT_S)

    async def kill(self) -> None:
        """Gone without a word: no more heartbeats, the server stops."""
        if self.client is not None:
            await self.client.stop(deregister=False)
        if self._server is not None:
            await self._server.stop(0)


class _FakeDecode(decode_pb2_grpc.DecodeServicer):
    def __init__(self, worker: FakeWorker) -> None:
        self.w = worker

    async def Decode(self, request, context):
        w, script = self.w, self.w.script
        w.requests.append(request)
        w.requests_metadata.append(tuple(context.invocation_metadata()))
        aborted = w._abort_events.setdefault(request.request_id, asyncio.Event())
        local = not request.prefill.address
        verdict = common_pb2.TransferVerdict(
            outcome=common_pb2.TRANSFER_OUTCOME_LOCAL if local else common_pb2.TRANSFER_OUTCOME_TRANSFERRED,
            reason=request.prefill.reason if local else "", backend="" if local else "ucx",
            prefill_worker_id=request.prefill.worker_id, num_blocks=len(request.block_hashes))
        if script.prefill_status_code and not local:
            verdict = common_pb2.TransferVerdict(outcome=common_pb2.TRANSFER_OUTCOME_RECOMPUTED,
                                                 reason="prefill_unavailable: connection refused",
                                                 prefill_worker_id=request.prefill.worker_id,
                                                 prefill_status_code=script.prefill_status_code)
        n = min(request.sampling.max_tokens, len(script.pieces))
        try:
            for i in range(len(request.resumed_token_ids), n):  # a migrated request goes on after them
                if script.fail_after is not None and i == script.fail_after:
                    await context.abort(script.fail_code, "scripted failure",
                                        trailing_metadata=(("pdserve-error-param", "stop"),))
                if script.hold_after is not None and i == script.hold_after:
                    await asyncio.wait_for(aborted.wait(), WAIT_S)
                    yield decode_pb2.DecodeResponse(request_id=request.request_id,
                                                    finish_reason=common_pb2.FINISH_REASON_ABORT, transfer=verdict)
                    return
                if script.delay_s:
                    await asyncio.sleep(script.delay_s)
                message = decode_pb2.DecodeResponse(request_id=request.request_id, token_ids=[100 + i],
                                                    text=script.pieces[i])
                if request.sampling.logprobs:
                    entry = message.logprobs.add(token_id=100 + i, logprob=-0.25, token=script.pieces[i])
                    for k in range(request.sampling.top_logprobs):
                        entry.top_logprobs.add(token_id=100 + i + k, logprob=-0.25 - k, token=f"t{k}")
                if i == len(request.resumed_token_ids):
                    message.transfer.CopyFrom(verdict)
                    if request.sampling.HasField("prompt_logprobs"):  # text left to the router
                        for j, token in enumerate(request.prompt_token_ids[1:]):
                            message.prompt_logprobs.add(token_id=token, logprob=-1.0 - j)
                if i == n - 1:
                    message.finish_reason = (common_pb2.FINISH_REASON_LENGTH if n == request.sampling.max_tokens
                                             else common_pb2.FINISH_REASON_STOP)
                    message.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                                            completion_tokens=n))
                    message.transfer.CopyFrom(verdict)
                    message.timings.CopyFrom(common_pb2.RequestTimings(queue_ms=1, prefill_ms=2, first_decode_ms=1))
                yield message
        except asyncio.CancelledError:
            w.cancelled.append(request.request_id)
            raise

    async def Abort(self, request, context):
        self.w.aborts.append(request.request_id)
        event = self.w._abort_events.get(request.request_id)
        if event is not None:
            event.set()
        return common_pb2.AbortResponse(found=event is not None)

    async def ModelInfo(self, request, context):
        return model_info(request.include_tokenizer)

    async def Load(self, request, context):
        return self.w.load()


class _FakePrefill(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, worker: FakeWorker) -> None:
        self.w = worker

    async def ModelInfo(self, request, context):
        return model_info(request.include_tokenizer)

    async def Load(self, request, context):
        return self.w.load()


class Cluster:
    """A router plus fake workers, all on the test loop."""

    def __init__(self, loop: LoopThread, config: RouterConfig) -> None:
        self.loop = loop
        self.router = RouterApp(config)
        self.workers: dict[str, FakeWorker] = {}
        loop.run(self.router.start())
        self.http = f"http://127.0.0.1:{self.router.http_port}"
        self.grpc_address = f"127.0.0.1:{self.router.grpc_port}"
        self.registry_address = f"127.0.0.1:{self.router.registry_port}"

    def add(self, worker_id: str, role: int = registry_pb2.WORKER_ROLE_DECODE, signer: CallSigner | None = None,
            tls: InternalTLS | None = None, **kwargs: Any) -> FakeWorker:
        worker = FakeWorker(role, worker_id, **kwargs)

        async def up() -> None:
            await worker.start(tls)
            await worker.register(self.registry_address, signer, tls)

        self.loop.run(up())
        self.workers[worker_id] = worker
        return worker

    def openai(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.http}/v1", api_key=api_key, max_retries=0, timeout=WAIT_S)

    def generation(self) -> tuple[grpc.Channel, generation_pb2_grpc.GenerationStub]:
        channel = grpc.insecure_channel(self.grpc_address)
        return channel, generation_pb2_grpc.GenerationStub(channel)

    def metric(self, name: str, **labels: str) -> float:
        value = self.router.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def close(self) -> None:
        async def down() -> None:
            for worker in self.workers.values():
                await worker.kill()
            await self.router.stop(grace_s=0.5)

        self.loop.run(down(), timeout=30)


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


def wait_until(predicate, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "tell me a joke"}], **extra}


# ---------------------------------------------------------------------------------------------
# Happy paths: the official openai client, streaming and not; gRPC streams the same.


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


# ---------------------------------------------------------------------------------------------
# Bad input: 4xx in OpenAI's shape (HTTP) and INVALID_ARGUMENT / NOT_FOUND (gRPC); still healthy.

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


# ---------------------------------------------------------------------------------------------
# Queue bound, disconnects, dead workers.


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


def test_grpc_cancel_and_abort_rpc_reach_decode(make_cluster):
    cluster = make_cluster()
    decode = cluster.add("d0", script=Script(hold_after=1))
    channel, stub = cluster.generation()
    with channel:
        call = stub.Generate(generation_pb2.GenerateRequest(model=MODEL, prompt="hello", request_id="r1"),
                             timeout=WAIT_S)
        assert next(call).text == "Hello"
        call.cancel()
        wait_until(lambda: "r1" in decode.aborts, "Abort after the gRPC cancel")

        call = stub.Generate(generation_pb2.GenerateRequest(model=MODEL, prompt="hello", request_id="r2"),
                             timeout=WAIT_S)
        assert next(call).text == "Hello"
        with pytest.raises(grpc.RpcError) as caught:  # the id is taken while r2 runs
            list(stub.Generate(generation_pb2.GenerateRequest(model=MODEL, prompt="hello", request_id="r2"),
                               timeout=WAIT_S))
        assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert stub.Abort(common_pb2.AbortRequest(request_id="r2"), timeout=WAIT_S).found
        rest = list(call)
        assert rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        assert not stub.Abort(common_pb2.AbortRequest(request_id="r2"), timeout=WAIT_S).found


def test_dead_worker_is_not_routed_to(make_cluster):
    cluster = make_cluster(decode_policy="round_robin")
    alive, dead = cluster.add("d0"), cluster.add("d1")
    cluster.loop.run(dead.kill())
    served_by = []
    for _ in range(4):  # at once: the failed call marks d1 suspect and the request moves on
        chat = cluster.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=2)
        assert chat.choices[0].message.content == "Hello,"
        served_by.append(chat.model_extra["pdserve"]["routing"]["decode_worker_id"])
    assert served_by == ["d0"] * 4 and len(alive.requests) == 4
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        assert http.get("/health").json()["decode_workers"] == 1
        wait_until(lambda: 'pdserve_router_workers{role="decode",state="dead"} 1.0' in http.get("/metrics").text,
                   "d1 declared dead by heartbeat timeout")


def _stream_chat(cluster: "Cluster", **extra: Any) -> list[str]:
    """The SSE data lines of one streamed chat (keep-alives never show)."""
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        with http.stream("POST", "/v1/chat/completions", json=chat_body(stream=True, **extra)) as streamed:
            return [line.removeprefix("data: ") for line in streamed.iter_lines() if line]


def _contents(events: list[str]) -> str:
    return "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events
                   if e != "[DONE]" and "choices" in json.loads(e) and json.loads(e)["choices"])


@pytest.mark.parametrize("how", ["dies", "hangs", "declared_dead"])
def test_a_stream_whose_decode_is_lost_migrates_and_continues(make_cluster, how):
    """The decode serving a stream dies (UNAVAILABLE), hangs (silent past the inactivity
    deadline) or stops heartbeating (declared dead by the registry, the stream still open):
    the router resubmits to the other decode with the tokens already sent; the client sees
    every piece once, in order, and the usage of the whole answer."""
    idle_s = 0.6 if how == "hangs" else WAIT_S  # declared_dead: cut off by the registry, not the deadline
    cluster = make_cluster(decode_policy="round_robin", stream_idle_timeout_s=idle_s, worker_timeout_s=1.0)
    first_script = {"dies": Script(fail_after=2, fail_code=grpc.StatusCode.UNAVAILABLE),
                    "hangs": Script(hold_after=2), "declared_dead": Script(hold_after=2)}[how]
    d0 = cluster.add("d0", script=first_script)
    d1 = cluster.add("d1")
    if how == "declared_dead":
        cluster.loop.run(d0.client.stop(deregister=False))  # heartbeats stop; its server keeps the stream open
    started = time.monotonic()
    events = _stream_chat(cluster, stream_options={"include_usage": True})
    assert _contents(events) == "Hello, world!" and events[-1] == "[DONE]"
    assert all("error" not in json.loads(e) for e in events[:-1])
    assert list(d1.requests[-1].resumed_token_ids) == [100, 101]
    assert d1.requests[-1].prompt_token_ids == d0.requests[-1].prompt_token_ids
    assert not d1.requests[-1].prefill.address and d1.requests[-1].prefill.reason == "migrated"
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 4
    assert cluster.metric("pdserve_router_migrations_total", outcome="migrated") == 1
    if how != "dies":
        assert time.monotonic() - started < WAIT_S / 2  # not held for the abort's or worker's WAIT_S
        wait_until(lambda: d0.aborts == [d0.requests[0].request_id], "the lost stream aborted on d0")


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
    monkeypatch.setitem(globals(), "MAX_MODEL_LEN", 512)  # room for the tool list (a word-level tokenizer)
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


def test_a_lost_stream_with_nowhere_to_go_ends_with_a_clear_error(make_cluster):
    """No other decode (or no migrations allowed): an error event, then [DONE]; the lost
    worker is not used again until it heartbeats."""
    cluster = make_cluster(stream_idle_timeout_s=0.6, max_migrations=1)
    cluster.add("d0", script=Script(hold_after=2))
    events = _stream_chat(cluster)
    assert _contents(events) == "Hello,"
    error = json.loads(events[-2])["error"]
    assert events[-1] == "[DONE]" and "no decode worker" in error["message"]
    cluster.workers["d0"].script = Script()
    wait_until(lambda: cluster.router.registry.routable(Role.DECODE, MODEL), "d0 routable after its heartbeat")
    assert _contents(_stream_chat(cluster)) == "Hello, world!"


# ---------------------------------------------------------------------------------------------
# Registry protocol and routing policies.


def test_registry_protocol(make_cluster):
    cluster = make_cluster()
    cluster.add("d0", compatibility_hash=77)
    with grpc.insecure_channel(cluster.registry_address) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Heartbeat(registry_pb2.HeartbeatRequest(worker_id="stranger"), timeout=WAIT_S)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as caught:
            stub.Register(registry_pb2.RegisterRequest(worker=registry_pb2.WorkerInfo(
                worker_id="x", role=registry_pb2.WORKER_ROLE_DECODE, grpc_address="nowhere")), timeout=WAIT_S)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        other = FakeWorker(registry_pb2.WORKER_ROLE_PREFILL, "p-bad", compatibility_hash=78, address="127.0.0.1:9")
        with pytest.raises(grpc.RpcError) as caught:
            stub.Register(registry_pb2.RegisterRequest(worker=other.info()), timeout=WAIT_S)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        gone = stub.Deregister(registry_pb2.DeregisterRequest(worker_id="d0"), timeout=WAIT_S)
        assert gone.found
    # d0's next heartbeat is answered NOT_FOUND, so it registers again.
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        wait_until(lambda: http.get("/health").json()["decode_workers"] == 1, "d0 to re-register")


def test_round_robin_spreads_and_session_affinity_sticks(make_cluster):
    cluster = make_cluster(decode_policy="round_robin")
    workers = [cluster.add("d0"), cluster.add("d1")]
    client = cluster.openai()
    for _ in range(4):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert [len(w.requests) for w in workers] == [2, 2]
    assert cluster.metric("pdserve_router_routing_decisions_total", pool="decode", policy="round_robin",
                          reason="round_robin") == 4

    sticky = make_cluster(decode_policy="session_affinity")
    sticky_workers = [sticky.add("s0"), sticky.add("s1")]
    for user in ("alice", "bob", "carol"):
        for _ in range(3):
            sticky.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=1, user=user)
        counts = [sum(1 for r in w.requests) for w in sticky_workers]
        assert sorted(counts)[-1] % 3 == 0  # all three requests of a user landed together
        for w in sticky_workers:
            w.requests.clear()


def test_prefix_aware_routes_a_repeated_prefix_to_the_worker_holding_it(make_cluster):
    cluster = make_cluster(decode_policy="prefix_aware", prefill_policy="round_robin")
    prompt = words(24)
    cached = hash_prompt_blocks(TOKENIZER.encode(prompt).ids, BLOCK_SIZE, SALT)
    cluster.add("d0")
    holder = cluster.add("d1", cached_hashes=cached)  # reports the prompt's blocks cached
    prefill = cluster.add("p0", role=registry_pb2.WORKER_ROLE_PREFILL)
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        answer = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt + " w100 w101", "max_tokens": 1})
        routing = answer.json()["pdserve"]["routing"]
        assert (routing["decode_worker_id"], routing["decode_reason"]) == ("d1", "prefix_match")
        assert routing["matched_prefix_tokens"] == 24
        # Conditional disaggregation: 2 uncached tokens (<= 4) -> decode prefills locally.
        assert routing["prefill_reason"] == "short_uncached_prompt"
        assert answer.json()["pdserve"]["transfer"]["outcome"] == "local"
        assert len(holder.requests) == 1 and holder.requests[0].prefill.address == ""
        # A fresh long prompt goes anywhere, with a prefill worker; repeating its prefix follows it there.
        fresh = words(20, start=150)
        first = http.post("/v1/completions", json={"model": MODEL, "prompt": fresh, "max_tokens": 1}).json()
        assert first["pdserve"]["routing"]["decode_reason"] == "no_prefix_match"
        assert first["pdserve"]["routing"]["prefill_worker_id"] == "p0"
        assert first["pdserve"]["transfer"]["outcome"] == "transferred"
        chosen = cluster.workers[first["pdserve"]["routing"]["decode_worker_id"]]
        sent = chosen.requests[-1]
        assert sent.prefill.address == prefill.address and sent.prefill.worker_id == "p0"
        assert list(sent.block_hashes) == hash_prompt_blocks(sent.prompt_token_ids, BLOCK_SIZE, SALT)
        again = http.post("/v1/completions", json={"model": MODEL, "prompt": fresh + " w1", "max_tokens": 1}).json()
        assert again["pdserve"]["routing"]["decode_worker_id"] == chosen.worker_id
        assert again["pdserve"]["routing"]["decode_reason"] == "prefix_match"
    assert cluster.metric("pdserve_router_routing_decisions_total", pool="decode", policy="prefix_aware",
                          reason="prefix_match") == 2
    assert cluster.metric("pdserve_router_routing_decisions_total", pool="prefill", policy="round_robin",
                          reason="short_uncached_prompt") == 2


def test_metrics_endpoint_uses_its_own_registry(make_cluster):
    cluster = make_cluster()
    cluster.add("d0")
    cluster.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        text = http.get("/metrics").text
    assert 'pdserve_router_requests_total{api="http_chat",outcome="ok"} 1.0' in text
    assert "pdserve_router_inter_token_latency_seconds_count 3.0" in text
    assert 'pdserve_router_transfer_outcomes_total{backend="none",outcome="local"} 1.0' in text
    assert "python_gc_objects_collected_total" not in text  # not the global default registry


def test_static_workers_are_polled_without_registration(loop_thread, make_cluster):
    static = FakeWorker(registry_pb2.WORKER_ROLE_DECODE, "unused-id")
    loop_thread.run(static.start())
    try:
        cluster = make_cluster(static_workers=(StaticWorker(Role.DECODE, static.address),))
        client = cluster.openai()
        with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
            wait_until(lambda: http.get("/ready").status_code == 200, "the static worker to be polled")
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        assert chat.model_extra["pdserve"]["routing"]["decode_worker_id"] == f"decode@{static.address}"
    finally:
        loop_thread.run(static.kill())


def test_pdserve_router_command_serves_and_stops_on_sigterm():
    """The real entry point: `pdserve router` in its own process, stopped by SIGTERM."""
    import select
    import signal
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "pdserve.deploy.cli", "router", "--http-port", "0",
                                "--grpc-port", "0", "--log-level", "WARNING"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([process.stdout], [], [], 3 * WAIT_S)
        assert ready, "no ready line within the deadline"
        line = process.stdout.readline()
        assert line.startswith("pdserve router ready http://127.0.0.1:"), (line, process.stderr.read())
        http_url = line.split()[3]
        assert httpx.get(f"{http_url}/health", timeout=WAIT_S).json()["status"] == "no_workers"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=WAIT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=WAIT_S)


def test_workers_register_again_after_a_router_restart(loop_thread, make_cluster):
    cluster = make_cluster()
    worker = cluster.add("d0")
    ports = dict(grpc_port=cluster.router.grpc_port, registry_port=cluster.router.registry_port)
    loop_thread.run(cluster.router.stop(grace_s=0.1))
    restarted = make_cluster(**ports)  # same addresses, empty registry
    with httpx.Client(base_url=restarted.http, timeout=WAIT_S) as http:
        wait_until(lambda: http.get("/ready").status_code == 200, "d0 to register with the new router")
    assert worker.client.num_registrations == 2
    chat = restarted.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=1)
    assert chat.choices[0].message.content == "Hello"


def test_worker_errors_reach_the_client_and_refusals_move_on(make_cluster):
    # Liveness is not under test here: with the fixture's 1 s heartbeat timeout, a loaded CI
    # machine once stalled the shared loop past it, both workers were dropped, and the
    # retry found none (503). 5 s keeps every worker alive through such a stall.
    cluster = make_cluster(decode_policy="round_robin", worker_timeout_s=5.0)
    cluster.add("d0", script=Script(fail_after=0))  # refuses every request as invalid
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        refused = http.post("/v1/chat/completions", json=chat_body())
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "stop"
        cluster.workers["d0"].script = Script(fail_after=2, fail_code=grpc.StatusCode.INTERNAL)
        with http.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as streamed:
            events = [line.removeprefix("data: ") for line in streamed.iter_lines() if line]
        assert [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:2]] == ["Hello", ","]
        assert json.loads(events[2])["error"]["type"] == "server_error" and events[3] == "[DONE]"
        # A worker that is busy (RESOURCE_EXHAUSTED) before its first token: the next one serves.
        cluster.workers["d0"].script = Script(fail_after=0, fail_code=grpc.StatusCode.RESOURCE_EXHAUSTED)
        cluster.add("d1")
        answers = [http.post("/v1/chat/completions", json=chat_body(max_tokens=1)) for _ in range(2)]
        assert [a.status_code for a in answers] == [200, 200]
        assert {a.json()["pdserve"]["routing"]["decode_worker_id"] for a in answers} == {"d1"}


def test_a_prefill_worker_decode_could_not_reach_is_not_proposed_again(make_cluster):
    cluster = make_cluster(local_prefill_threshold=0, worker_timeout_s=5.0)
    cluster.add("d0", script=Script(prefill_status_code="UNAVAILABLE"))
    prefill = cluster.add("p0", role=registry_pb2.WORKER_ROLE_PREFILL)
    cluster.loop.run(prefill.kill())  # gone; its heartbeat would time out only after 5 s
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        first = http.post("/v1/completions", json={"model": MODEL, "prompt": words(10), "max_tokens": 1}).json()
        assert first["pdserve"]["routing"]["prefill_worker_id"] == "p0"
        assert first["pdserve"]["transfer"]["outcome"] == "recomputed"  # never a silent fallback
        second = http.post("/v1/completions", json={"model": MODEL, "prompt": words(10), "max_tokens": 1}).json()
        assert second["pdserve"]["routing"]["prefill_reason"] == "no_prefill_worker"
    assert cluster.metric("pdserve_router_transfer_outcomes_total", outcome="recomputed", backend="none") == 1


# ---------------------------------------------------------------------------------------------
# Security: with a cluster secret, the registry (on its own port) takes only workers that prove
# they belong to the deployment, and a worker id is bound to the credential that names it.


def test_registry_refuses_anonymous_and_impersonating_callers(make_cluster, tmp_path):
    secret_path = tmp_path / "cluster-secret"
    secret = ClusterSecret.create(secret_path)
    cluster = make_cluster(cluster_secret_file=str(secret_path))
    cluster.add("d0", signer=CallSigner(secret, "d0"))
    impostor = FakeWorker(registry_pb2.WORKER_ROLE_DECODE, "d0", script=Script(pieces=("pwned",)))
    cluster.loop.run(impostor.start())
    cluster.workers["impostor"] = impostor

    def call(method: str, request, caller: str | None):
        metadata = [(CREDENTIAL_HEADER, CallSigner(secret, caller).credential(f"/pdserve.v1.Registry/{method}"))] \
            if caller else []
        with grpc.insecure_channel(cluster.registry_address) as channel:
            getattr(registry_pb2_grpc.RegistryStub(channel), method)(request, timeout=WAIT_S, metadata=metadata)

    takeover = registry_pb2.RegisterRequest(worker=impostor.info())
    for method, request, caller, code in (
            ("Register", takeover, None, grpc.StatusCode.UNAUTHENTICATED),  # anonymous
            ("Register", takeover, "evil", grpc.StatusCode.UNAUTHENTICATED),  # another id's credential
            ("Register", takeover, "d0", grpc.StatusCode.ALREADY_EXISTS),  # d0 is alive elsewhere
            ("Deregister", registry_pb2.DeregisterRequest(worker_id="d0"), None, grpc.StatusCode.UNAUTHENTICATED),
            ("Deregister", registry_pb2.DeregisterRequest(worker_id="d0"), "evil", grpc.StatusCode.UNAUTHENTICATED),
            ("Heartbeat", registry_pb2.HeartbeatRequest(worker_id="d0"), None, grpc.StatusCode.UNAUTHENTICATED)):
        with pytest.raises(grpc.RpcError) as caught:
            call(method, request, caller)
        assert caught.value.code() == code, (method, caller)
        assert "cluster-secret" not in (caught.value.details() or "")
    # garbage that is not even a protobuf is refused before it is parsed
    with grpc.insecure_channel(cluster.registry_address) as channel:
        raw = channel.unary_unary("/pdserve.v1.Registry/Register", request_serializer=None,
                                  response_deserializer=None)
        with pytest.raises(grpc.RpcError) as caught:
            raw(b"\xff\x00garbage", timeout=WAIT_S)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert cluster.metric("pdserve_router_auth_refused_total", reason="no credential") >= 4
    # the real worker still gets the traffic, and stays registered
    chat = cluster.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=8)
    assert chat.choices[0].message.content == "".join(REPLY) and not impostor.requests
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        assert http.get("/health").status_code == 200


def test_router_calls_workers_with_its_credential(make_cluster, tmp_path):
    secret_path = tmp_path / "cluster-secret"
    secret = ClusterSecret.create(secret_path)
    cluster = make_cluster(cluster_secret_file=str(secret_path))
    worker = cluster.add("d0", signer=CallSigner(secret, "d0"))
    cluster.openai().completions.create(model=MODEL, prompt="hello", max_tokens=4)
    (credential,) = [v for k, v in worker.requests_metadata[-1] if k == CREDENTIAL_HEADER]
    assert CallVerifier(secret).verify("/pdserve.v1.Decode/Decode", credential) == "router"


def _self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 made here (cryptography), and its key, as PEM files."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    import ipaddress

    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def test_tls_on_the_client_ports_and_metrics_behind_the_api_key(make_cluster, tmp_path):
    cert, key = _self_signed(tmp_path)
    cluster = make_cluster(tls_cert=cert, tls_key=key, api_key="sesame", metrics_auth=True)
    cluster.add("d0")
    https = cluster.http.replace("http://", "https://")
    with httpx.Client(base_url=https, verify=cert, timeout=WAIT_S) as client:
        assert client.get("/health").status_code == 200 and client.get("/ready").status_code == 200
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers={"Authorization": "Bearer sesame"}).status_code == 200
        chat = openai.OpenAI(base_url=f"{https}/v1", api_key="sesame", http_client=client, max_retries=0)
        answer = chat.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8)
        assert answer.choices[0].message.content == "".join(REPLY)
    with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on a TLS port
        httpx.get(f"{cluster.http}/health", timeout=WAIT_S)
    with open(cert, "rb") as f:
        credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
    with grpc.secure_channel(cluster.grpc_address, credentials) as channel:
        info = generation_pb2_grpc.GenerationStub(channel).ModelInfo(
            common_pb2.ModelInfoRequest(model=MODEL), timeout=WAIT_S, metadata=[("authorization", "Bearer sesame")])
    assert info.model_name == MODEL



def _internal_pki(tmp_path) -> dict[str, str]:
    """A CA and the deployment's certificate (SAN pdserve-internal) signed by it; and a second
    CA's certificate, as an outsider would have. PEM paths."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(subject: str, key, issuer: str, issuer_key, ca: bool):
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(INTERNAL_SERVER_NAME)]),
                                            critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    out = {}
    for name in ("ours", "theirs"):
        ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
        ca = cert(f"{name}-ca", ca_key, f"{name}-ca", ca_key, True)
        leaf = cert(INTERNAL_SERVER_NAME, leaf_key, f"{name}-ca", ca_key, False)
        for kind, data in (("ca", ca.public_bytes(serialization.Encoding.PEM)),
                           ("cert", leaf.public_bytes(serialization.Encoding.PEM)),
                           ("key", leaf_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))):
            path = tmp_path / f"{name}-{kind}.pem"
            path.write_bytes(data)
            out[f"{name}_{kind}"] = str(path)
    return out


def test_internal_grpc_over_mutual_tls(make_cluster, tmp_path, loop_thread):
    pki = _internal_pki(tmp_path)
    secret_path = tmp_path / "cluster-secret"
    secret = ClusterSecret.create(secret_path)
    ours = InternalTLS.load(pki["ours_cert"], pki["ours_key"], pki["ours_ca"])
    cluster = make_cluster(cluster_secret_file=str(secret_path), internal_tls_cert=pki["ours_cert"],
                           internal_tls_key=pki["ours_key"], internal_tls_ca=pki["ours_ca"])
    cluster.add("d0", signer=CallSigner(secret, "d0"), tls=ours)  # registry and router -> d0 both over mTLS
    chat = cluster.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=8)
    assert chat.choices[0].message.content == "".join(REPLY)
    # plaintext, and TLS with a certificate of another CA, never reach the registry
    theirs = InternalTLS.load(pki["theirs_cert"], pki["theirs_key"], pki["theirs_ca"])
    mixed = InternalTLS(theirs.cert, theirs.key, ours.ca)  # trusts us, but is not trusted
    for tls in (None, mixed):
        async def try_register() -> None:
            client = RegistryClient(cluster.registry_address, FakeWorker(registry_pb2.WORKER_ROLE_DECODE, "d9",
                                                                          address="127.0.0.1:9").info(),
                                    lambda: common_pb2.WorkerLoad(), rpc_timeout_s=2.0, retry_s=0.05,
                                    signer=CallSigner(secret, "d9"), tls=tls)
            client.start()
            try:
                with pytest.raises(TimeoutError):
                    await client.wait_registered(1.5)
                assert client.num_refused >= 1
            finally:
                await client.stop(deregister=False)

        loop_thread.run(try_register())
    assert cluster.router.registry.get("d9") is None


def test_bench_abuse_reports_oversized_prompts_refused_and_workers_kept(make_cluster, capsys):
    """`pdserve bench abuse` on a small scale: every big prompt is refused (413 over HTTP,
    RESOURCE_EXHAUSTED over gRPC), small chats keep answering, no worker is lost."""
    from pdserve.bench import abuse

    cluster = make_cluster()
    cluster.add("d0")
    assert abuse.main(["--url", cluster.http, "--grpc", cluster.grpc_address, "--model", MODEL, "--clients", "2",
                       "--big-mb", "0.05", "--grpc-mb", "0.1", "--chats", "5", "--settle-s", "0"]) == 0
    out = capsys.readouterr().out
    assert "p99 ratio" in out and "inf" not in out.split("p99 ratio")[1].split()[0], out
    statuses = dict(part.rsplit(": ", 1) for part in out.split("gRPC: ")[1].splitlines()[0].split(", "))
    assert set(statuses) == {"http 413", "grpc RESOURCE_EXHAUSTED"}, out
    assert "before 1/0, during 1/0, after 1/0" in out, out


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
        assert sorted(r.request_id for r in sent) == ["many-0", "many-1", "many-2"]
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
