"""What the router's integration tests (test_router_*.py) run against: real HTTP and gRPC
listeners, real Registry, and small in-test decode / prefill workers (real grpc.aio servers)
that register, heartbeat and stream a scripted reply. The fakes isolate the router: they
never run a model.

Everything async runs on one event loop in a background thread, so the tests themselves
use ordinary blocking clients (openai, httpx, grpc).
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

import grpc
import openai
import support
from tokenizers import Tokenizer, models, pre_tokenizers

from pdserve.proto.pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    generation_pb2_grpc,
    prefill_pb2_grpc,
    registry_pb2,
)
from pdserve.router.app import RouterApp
from pdserve.router.config import RouterConfig
from pdserve.rpc.credentials import InternalTLS, bind
from pdserve.security.credentials import CallSigner
from pdserve.security.key_directory import PeerKeys
from pdserve.worker.kv_events import KVEventFanout, KVEventLog, with_kv_events_service
from pdserve.worker.registry_client import RegistryClient

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
    first_delay_s: float = 0.0  # silence before the first token (a queue, a recompute)
    hold_after: int | None = None
    fail_after: int | None = None  # end the call with `fail_code` after this many tokens
    fail_code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
    prefill_status_code: str = ""  # report the prefill leg failed with this code (then recomputed)
    verdict_names: str = ""  # the prefill its verdicts name (empty: the one the router planned)
    # on the first delta of each call and on the last, as a decode reports its first token's phases
    timings: common_pb2.RequestTimings = field(
        default_factory=lambda: common_pb2.RequestTimings(queue_ms=1, prefill_ms=2, first_decode_ms=1))


@dataclass
class FakeWorker:
    role: int  # registry_pb2.WORKER_ROLE_*
    worker_id: str
    script: Script = field(default_factory=Script)
    kv: KVEventLog = field(default_factory=KVEventLog)  # what it holds: a Decode call stores its prompt's blocks
    probe_s: float = 0.5  # its KV event stream's probe interval when idle
    compatibility_hash: int = 77
    requests: list[decode_pb2.DecodeRequest] = field(default_factory=list)
    requests_metadata: list = field(default_factory=list)  # each Decode call's invocation metadata
    aborts: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    address: str = ""
    report: common_pb2.WorkerLoad | None = None  # what its heartbeats report (None: an idle worker)
    chat_template: str = TEMPLATE  # what its ModelInfo answers
    _server: Any = None
    client: RegistryClient | None = None
    _abort_events: dict = field(default_factory=dict)
    _fanout: KVEventFanout | None = None

    async def start(self, tls: InternalTLS | None = None, address: str = "127.0.0.1:0") -> None:
        server = grpc.aio.server()
        if self.role == registry_pb2.WORKER_ROLE_DECODE:
            add = lambda s: decode_pb2_grpc.add_DecodeServicer_to_server(_FakeDecode(self), s)  # noqa: E731
        else:
            add = lambda s: prefill_pb2_grpc.add_PrefillServicer_to_server(_FakePrefill(self), s)  # noqa: E731
        with_kv_events_service(add, [], self.kv)[0](server)
        port = bind(server, address, tls)
        await server.start()
        self._server, self.address = server, f"127.0.0.1:{port}"

    def info(self) -> registry_pb2.WorkerInfo:
        return registry_pb2.WorkerInfo(worker_id=self.worker_id, role=self.role, grpc_address=self.address,
                                       model_name=MODEL, compatibility_hash=self.compatibility_hash,
                                       block_size=BLOCK_SIZE, capacity=registry_pb2.WorkerCapacity(num_total_blocks=64))

    def load(self) -> common_pb2.WorkerLoad:
        if self.report is not None:
            return self.report
        return common_pb2.WorkerLoad(num_free_blocks=64, num_total_blocks=64)

    async def register(self, router_address: str, signer: CallSigner | None = None,
                       tls: InternalTLS | None = None, enrollment_token: str = "") -> None:
        """Through the real worker-side client (register, heartbeat, re-register on NOT_FOUND);
        `peers` learns the router's key; its KV events go to the router as a worker's do."""
        self.peers = PeerKeys()
        self.client = RegistryClient(router_address, self.info(), self.load, rpc_timeout_s=WAIT_S, retry_s=0.05,
                                     signer=signer, tls=tls, peers=self.peers, enrollment_token=enrollment_token)
        self.client.start()
        self._fanout = KVEventFanout(self.kv, flush_s=0.02, probe_s=self.probe_s)
        self._fanout.start()
        self._fanout.attach(router_address, self.client)
        await self.client.wait_registered(WAIT_S)

    async def kill(self) -> None:
        """Gone without a word: no more heartbeats, the server stops."""
        if self._fanout is not None:
            await self._fanout.stop()
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
        w.kv.on_event("device", "stored", list(request.block_hashes))  # as its pool would cache the prompt
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
                                                 prefill_worker_id=script.verdict_names or request.prefill.worker_id,
                                                 prefill_status_code=script.prefill_status_code)
        n = min(request.sampling.max_tokens, len(script.pieces))
        try:
            if script.first_delay_s:
                await asyncio.sleep(script.first_delay_s)
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
                    message.timings.CopyFrom(script.timings)
                    if request.sampling.HasField("prompt_logprobs"):  # text left to the router
                        for j, token in enumerate(request.prompt_token_ids[1:]):
                            message.prompt_logprobs.add(token_id=token, logprob=-1.0 - j)
                if i == n - 1:
                    message.finish_reason = (common_pb2.FINISH_REASON_LENGTH if n == request.sampling.max_tokens
                                             else common_pb2.FINISH_REASON_STOP)
                    message.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                                            completion_tokens=n))
                    message.transfer.CopyFrom(verdict)
                    message.timings.CopyFrom(script.timings)
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
        info = model_info(request.include_tokenizer)
        info.chat_template = self.w.chat_template
        return info

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


def wait_until(predicate, what: str, timeout: float = WAIT_S) -> None:
    support.wait_until(predicate, what, timeout, poll_s=0.02)


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "tell me a joke"}], **extra}
