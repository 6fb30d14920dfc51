"""What each caller sees (issue 38, reproduction 8), through a real `pdserve router` process:
with an API key and an admin key, a client gets the OpenAI answer, usage with cached tokens
and the request id; only the admin key shows routing (worker ids, matched prefix tokens),
transfer verdicts, timings, /health's per-worker backends and errors as workers raised them.
Anonymous /health says the status only. Transfer errors reach a client without the internal
address they name. A router with no key at all shows everyone everything on loopback only.

The router is a real process on 127.0.0.1; its workers are in-test gRPC servers that
register through the real Registry and stream a scripted reply whose verdict and errors
name an internal address."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Iterator

import grpc
import httpx
import pytest
from router_fakes import MODEL, TOKENIZER, WAIT_S, FakeWorker, chat_body, model_info, wait_until

from pdserve.proto.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, generation_pb2, generation_pb2_grpc
from pdserve.proto.pdserve.v1 import registry_pb2
from pdserve.rpc.credentials import bind

API_KEY = "client-key-5b1e"
ADMIN_KEY = "admin-key-9c44"
SECRET_ADDRESS = "10.1.2.3:50100"  # what a worker's error and verdict name; never a client's to see
INTERNALS = ("routing", "transfer", "timings")
FAIL_MARK = "w17 w18"  # a prompt holding it ends like a prefill leg failing under policy "fail"
FAIL_MARK_IDS = set(TOKENIZER.encode(FAIL_MARK, add_special_tokens=False).ids)


def _verdict() -> common_pb2.TransferVerdict:
    return common_pb2.TransferVerdict(
        outcome=common_pb2.TRANSFER_OUTCOME_RECOMPUTED, reason=f"transfer_failed: ucx: {SECRET_ADDRESS} refused",
        fallbacks=[common_pb2.FallbackStep(backend="ucx", reason=f"connect to ipv4:{SECRET_ADDRESS}: refused")],
        prefill_worker_id="prefill-7f9c")


class _ScriptedDecode(decode_pb2_grpc.DecodeServicer):
    """Two tokens with a verdict naming an internal address; or, for a prompt holding
    FAIL_MARK's tokens, the prefill leg's failure as decode reports it (status ABORTED)."""

    async def Decode(self, request, context):
        if _holds_fail_mark(request):
            await context.abort(grpc.StatusCode.ABORTED, "prefill failed and failure policy is 'fail': "
                                f"prefill_unavailable: UNAVAILABLE ipv4:{SECRET_ADDRESS}: Connection refused")
        first = decode_pb2.DecodeResponse(request_id=request.request_id, token_ids=[100], text="Hello",
                                          transfer=_verdict())
        yield first
        yield decode_pb2.DecodeResponse(
            request_id=request.request_id, token_ids=[101], text="!", finish_reason=common_pb2.FINISH_REASON_STOP,
            usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=2,
                                   cached_prompt_tokens=4, cached_tokens_by_tier={"device": 3, "host": 1}),
            transfer=_verdict(), timings=common_pb2.RequestTimings(queue_ms=1, prefill_ms=2, first_decode_ms=1))

    async def ModelInfo(self, request, context):
        return model_info(request.include_tokenizer)


def _holds_fail_mark(request: decode_pb2.DecodeRequest) -> bool:
    return FAIL_MARK_IDS <= set(request.prompt_token_ids)


@dataclass
class ScriptedWorker(FakeWorker):
    """A registered decode worker serving `_ScriptedDecode`, whose load reports a backend
    unusable for a reason that names an internal address."""

    async def start(self, tls=None) -> None:
        server = grpc.aio.server()
        decode_pb2_grpc.add_DecodeServicer_to_server(_ScriptedDecode(), server)
        port = bind(server, "127.0.0.1:0", tls)
        await server.start()
        self._server, self.address = server, f"127.0.0.1:{port}"

    def load(self) -> common_pb2.WorkerLoad:
        load = super().load()
        load.kv_backends.add(name="ucx", usable=False, detail=f"cannot listen: {SECRET_ADDRESS} in use")
        return load


@dataclass
class RouterProcess:
    process: subprocess.Popen
    http: str
    grpc_address: str
    registry_address: str

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=WAIT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=WAIT_S)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_router(tmp_path, api_key: str | None, admin_key: str | None) -> RouterProcess:
    registry_port = _free_port()
    argv = [sys.executable, "-m", "pdserve.deploy.cli", "router", "--host", "127.0.0.1", "--http-port", "0",
            "--grpc-port", "0", "--registry-port", str(registry_port), "--worker-timeout-s", "2",
            "--log-level", "WARNING"]
    if admin_key is not None:
        key_file = tmp_path / "admin-key"
        key_file.write_text(admin_key + "\n")
        key_file.chmod(0o600)
        argv += ["--admin-api-key-file", str(key_file)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    if api_key is not None:
        env["PDSERVE_API_KEY"] = api_key
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    ready, _, _ = select.select([process.stdout], [], [], 6 * WAIT_S)
    line = process.stdout.readline() if ready else ""
    if not line.startswith("pdserve router ready "):
        process.kill()
        pytest.fail(f"router not ready: {line!r} {process.stderr.read()}")
    words = line.split()
    return RouterProcess(process, words[3], words[5], f"127.0.0.1:{registry_port}")


@pytest.fixture(scope="module")
def router(tmp_path_factory, loop_thread) -> Iterator[RouterProcess]:
    """A router with an API key and an admin key, and one scripted decode worker."""
    proc = start_router(tmp_path_factory.mktemp("scope"), API_KEY, ADMIN_KEY)
    worker = ScriptedWorker(registry_pb2.WORKER_ROLE_DECODE, "decode-7f9c")

    async def up() -> None:
        await worker.start()
        await worker.register(proc.registry_address)

    try:
        loop_thread.run(up())
        with httpx.Client(base_url=proc.http, timeout=WAIT_S) as http:
            wait_until(lambda: http.get("/ready").status_code == 200, "the worker to register")
        yield proc
    finally:
        loop_thread.run(worker.kill())
        proc.stop()


def _bearer(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


def _chat(router: RouterProcess, key: str, **extra) -> httpx.Response:
    return httpx.post(f"{router.http}/v1/chat/completions", json=chat_body(**extra), headers=_bearer(key),
                      timeout=WAIT_S)


def _sse_chunks(response: httpx.Response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def test_a_client_gets_the_answer_and_no_internals(router) -> None:
    answer = _chat(router, API_KEY)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["choices"][0]["message"]["content"] == "Hello!"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 4  # as OpenAI reports it
    assert set(body["pdserve"]) == {"request_id"} and body["pdserve"]["request_id"] == body["id"]
    streamed = _chat(router, API_KEY, stream=True, stream_options={"include_usage": True})
    chunks = _sse_chunks(streamed)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "Hello!"
    assert all(not set(INTERNALS) & set(c.get("pdserve", {})) for c in chunks), chunks
    assert "decode-7f9c" not in answer.text + streamed.text and SECRET_ADDRESS not in answer.text + streamed.text


def test_the_admin_key_shows_routing_transfer_and_timings(router) -> None:
    body = _chat(router, ADMIN_KEY).json()
    extra = body["pdserve"]
    assert extra["routing"]["decode_worker_id"] == "decode-7f9c"
    assert extra["routing"]["prompt_tokens"] > 0 and "matched_prefix_tokens" in extra["routing"]
    assert extra["cached_tokens_by_tier"] == {"device": 3, "host": 1}  # where the 4 cached tokens were found
    assert SECRET_ADDRESS in extra["transfer"]["reason"] and extra["timings"]["prefill_ms"] == 2
    chunks = _sse_chunks(_chat(router, ADMIN_KEY, stream=True))
    assert chunks[0]["pdserve"]["routing"]["decode_worker_id"] == "decode-7f9c"


def test_a_transfer_error_reaches_a_client_without_the_internal_address(router) -> None:
    prompt = [{"role": "user", "content": FAIL_MARK}]
    client = httpx.post(f"{router.http}/v1/chat/completions", json={"model": MODEL, "messages": prompt},
                        headers=_bearer(API_KEY), timeout=WAIT_S)
    assert client.status_code == 502 and client.json()["error"]["code"] == "prefill_failed"
    assert SECRET_ADDRESS not in client.text and "10.1.2.3" not in client.text
    admin = httpx.post(f"{router.http}/v1/chat/completions", json={"model": MODEL, "messages": prompt},
                       headers=_bearer(ADMIN_KEY), timeout=WAIT_S)
    assert admin.status_code == 502 and SECRET_ADDRESS in admin.json()["error"]["message"]
    streamed = httpx.post(f"{router.http}/v1/chat/completions", headers=_bearer(API_KEY), timeout=WAIT_S,
                          json={"model": MODEL, "messages": prompt, "stream": True})
    assert streamed.status_code == 502 and SECRET_ADDRESS not in streamed.text


def test_grpc_generate_shows_internals_only_to_the_admin(router) -> None:
    request = generation_pb2.GenerateRequest(model=MODEL, prompt="hello", request_id="mine-1")
    failing = generation_pb2.GenerateRequest(model=MODEL, prompt=FAIL_MARK)
    with grpc.insecure_channel(router.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        client = list(stub.Generate(request, timeout=WAIT_S, metadata=[("authorization", f"Bearer {API_KEY}")]))
        admin = list(stub.Generate(request, timeout=WAIT_S, metadata=[("authorization", f"Bearer {ADMIN_KEY}")]))
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(failing, timeout=WAIT_S, metadata=[("authorization", f"Bearer {API_KEY}")]))
    assert "".join(r.text for r in client) == "Hello!" and client[-1].usage.cached_prompt_tokens == 4
    assert all(r.request_id == "mine-1" and not any(r.HasField(f) for f in INTERNALS) for r in client)
    assert admin[0].routing.decode_worker_id == "decode-7f9c" and admin[-1].HasField("timings")
    assert not client[-1].usage.cached_tokens_by_tier and dict(admin[-1].usage.cached_tokens_by_tier) == {
        "device": 3, "host": 1}
    assert refused.value.code() == grpc.StatusCode.ABORTED and SECRET_ADDRESS not in refused.value.details()


def test_health_says_the_status_to_anyone_and_details_to_the_admin(router) -> None:
    anonymous = httpx.get(f"{router.http}/health", timeout=WAIT_S).json()
    assert anonymous == {"status": "ok"}
    assert httpx.get(f"{router.http}/health", headers=_bearer("wrong"), timeout=WAIT_S).json() == {"status": "ok"}
    client = httpx.get(f"{router.http}/health", headers=_bearer(API_KEY), timeout=WAIT_S).json()
    assert client == {"status": "ok", "models": [MODEL], "decode_workers": 1, "prefill_workers": 0}
    admin = httpx.get(f"{router.http}/health", headers=_bearer(ADMIN_KEY), timeout=WAIT_S).json()
    assert admin["kv_backends"] == {"decode-7f9c": {"ucx": f"unusable: cannot listen: {SECRET_ADDRESS} in use"}}
    ready = httpx.get(f"{router.http}/ready", timeout=WAIT_S)
    assert ready.status_code == 200 and ready.json() == {"status": "ok"}


def test_without_any_key_everyone_sees_everything(make_cluster) -> None:
    """`pdserve up` on a laptop: no API key, no admin key, loopback: everyone sees everything."""
    cluster = make_cluster()
    cluster.add("d0")
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        body = http.post("/v1/chat/completions", json=chat_body()).json()
        health = http.get("/health").json()
    assert body["pdserve"]["routing"]["decode_worker_id"] == "d0" and "transfer" in body["pdserve"]
    assert health["decode_workers"] == 1 and "kv_backends" in health


def test_an_admin_key_alone_keeps_the_api_open_and_the_internals_closed(make_cluster, tmp_path) -> None:
    key_file = tmp_path / "admin"
    key_file.write_text(ADMIN_KEY)
    key_file.chmod(0o600)
    cluster = make_cluster(admin_api_key_file=str(key_file))
    cluster.add("d0")
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        anyone = http.post("/v1/chat/completions", json=chat_body()).json()
        admin = http.post("/v1/chat/completions", json=chat_body(), headers=_bearer(ADMIN_KEY)).json()
        assert http.get("/health").json()["decode_workers"] == 1
        assert "kv_backends" not in http.get("/health").json()
    assert set(anyone["pdserve"]) == {"request_id"}
    assert admin["pdserve"]["routing"]["decode_worker_id"] == "d0"
