"""End-to-end harness: real router/prefill/decode processes on 127.0.0.1, the official
OpenAI client, and transformers' greedy output as the oracle."""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Iterator

import grpc

from pdserve.deploy import up
from pdserve.security.credentials import CREDENTIAL_HEADER, CallKey, CallSigner
from pdserve.security.secret import ClusterSecret


def pick_free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

MODEL = "SmolLM2-135M-Instruct"
READY_TIMEOUT_S = 240.0


@dataclass
class Deployment:
    children: list
    http_port: int
    grpc_port: int
    secret_path: str = ""  # the deployment's cluster secret: tests sign their internal calls with it

    def credentials(self, method: str, caller: str = "test-operator") -> list[tuple[str, str]]:
        """gRPC metadata that authenticates one internal call to `method` with the cluster
        secret: enough for the admission calls (Register, ModelInfo, Load; "/pdserve.v1.Decode/Load"),
        refused for any other (those need a registered caller's own key: `registered_decode`)."""
        if not self.secret_path:
            return []
        signer = CallSigner(ClusterSecret.load(self.secret_path), caller)
        return [(CREDENTIAL_HEADER, signer.credential(method))]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def worker_addresses(self, role: str) -> dict[str, str]:
        """worker name -> gRPC address, from each worker's ready line."""
        out = {}
        for child in self.children:
            if child.name.startswith(role):
                for line in child.lines:
                    if "ready on" in line:
                        out[child.name] = line.split("ready on ")[1].split()[0]
        return out

    def child(self, name: str):
        return next(c for c in self.children if c.name == name)

    def openai(self):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key="unused", timeout=120, max_retries=0)

    def metric(self, sample: str) -> float:
        """One sample of the router's /metrics, by its exact name and labels (0 when absent)."""
        import httpx

        text = httpx.get(self.base_url.replace("/v1", "/metrics"), timeout=10).text
        return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith(sample + " ")), 0.0)

    def assert_ttft_phases(self, timings: dict, transfer: bool) -> None:
        """A response's TTFT phases are all there: the prefill took time, a transfer only when
        one ran, and the router's phase histogram counted each phase."""
        assert timings["prefill_ms"] > 0 and timings["first_decode_ms"] > 0 and timings["queue_ms"] >= 0, timings
        assert (timings["transfer_ms"] > 0) == transfer, timings
        for phase in ("queue", "prefill", "transfer", "first_decode"):
            assert self.metric(f'pdserve_router_ttft_phase_seconds_count{{phase="{phase}"}}') >= 1

    def load(self, name: str):
        """Worker `name`'s Load report (queued, running, free and total KV blocks), asked now."""
        from pdserve.proto.pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

        role = "decode" if name.startswith("decode") else "prefill"
        stub_cls = decode_pb2_grpc.DecodeStub if role == "decode" else prefill_pb2_grpc.PrefillStub
        with grpc.insecure_channel(self.worker_addresses(role)[name]) as channel:
            method = f"/pdserve.v1.{role.capitalize()}/Load"
            return stub_cls(channel).Load(common_pb2.LoadRequest(), timeout=5, metadata=self.credentials(method))

    def wait_until(self, condition, what: str, timeout_s: float = 60.0) -> None:
        """Poll `condition()` until it holds; fail naming `what` after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
            time.sleep(0.02)

    def assert_no_leaks(self, timeout_s: float = 20.0) -> None:
        """Every KV block back in every worker's pool (polled: frees land asynchronously)."""
        deadline = time.monotonic() + timeout_s
        for role in ("decode", "prefill"):
            for name in self.worker_addresses(role):
                if self.child(name).proc.poll() is not None:
                    continue
                while True:
                    load = self.load(name)
                    if load.num_free_blocks == load.num_total_blocks and load.num_running == 0:
                        break
                    if time.monotonic() > deadline:
                        raise AssertionError(
                            f"{name}: {load.num_total_blocks - load.num_free_blocks} KV blocks "
                            f"still held, {load.num_running} running")
                    time.sleep(0.2)


@contextlib.contextmanager
def registered_decode(cluster: Deployment, worker_id: str, port: int) -> Iterator[CallSigner]:
    """A signer of a decode id registered at the router with a key of the test's own (the
    cluster secret admits its Register), as a worker joining would: a prefill finds that key
    at the registry. Only the router may call a decode, so no test can call one directly. The
    registration ends on exit. `port`: its (unused) address's, one per id (a live
    registration keeps its address)."""
    from pdserve.proto.pdserve.v1 import registry_pb2, registry_pb2_grpc

    signer = CallSigner(ClusterSecret.load(cluster.secret_path), worker_id, CallKey())
    argv = next(c.argv for c in cluster.children if "--router" in c.argv)
    info = registry_pb2.WorkerInfo(worker_id=worker_id, role=registry_pb2.WORKER_ROLE_DECODE,
                                   grpc_address=f"127.0.0.1:{port}", model_name=MODEL, block_size=16)

    def metadata(method: str) -> list[tuple[str, str]]:
        return [(CREDENTIAL_HEADER, signer.credential(f"/pdserve.v1.Registry/{method}"))]

    with grpc.insecure_channel(argv[argv.index("--router") + 1]) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        reply = stub.Register(registry_pb2.RegisterRequest(worker=info, public_key=signer.public_key),
                              timeout=30, metadata=metadata("Register"))
        try:
            yield signer
        finally:
            stub.Deregister(registry_pb2.DeregisterRequest(worker_id=worker_id, lease=reply.lease),
                            timeout=30, metadata=metadata("Deregister"))


def signed_metadata(signer: CallSigner, method: str, address: str, request) -> list[tuple[str, str]]:
    """gRPC metadata of one call of `method` with `request` to the worker at `address`, as the
    services make it: a v2 credential bound to that server and that request."""
    from pdserve.security.credentials import AUDIENCE_HEADER, DIGEST_HEADER, MEMBER_HEADER, request_digest

    digest = request_digest(request)
    credential = signer.credential(method, address, digest)
    return [(DIGEST_HEADER, digest), (AUDIENCE_HEADER, address), (CREDENTIAL_HEADER, credential),
            (MEMBER_HEADER, signer.member_proof(credential))]


def secret_file() -> str:
    """A cluster secret for one test deployment (as `pdserve up` makes one per run)."""
    path = os.path.join(tempfile.mkdtemp(prefix="pdserve-test-"), "cluster-secret")
    ClusterSecret.create(path)
    return path


def deploy(**settings) -> Deployment:
    http_port, grpc_port, registry_port = pick_free_port(), pick_free_port(), pick_free_port()
    settings = {"http_port": http_port, "router_grpc_port": grpc_port, "router_registry_port": registry_port,
                "num_threads": 1, "transfer_timeout_s": 20, "cluster_secret_file": secret_file(), **settings}
    secret_path = settings["cluster_secret_file"]
    children, port = up.start(settings)
    key = settings.get("api_key")
    try:
        up.wait_ready(children, f"http://127.0.0.1:{port}", READY_TIMEOUT_S,
                      headers={"Authorization": f"Bearer {key}"} if key else None)
    except BaseException:
        up.stop(children)
        raise
    return Deployment(children, http_port, grpc_port, secret_path)




def spawn(child) -> None:
    """Start (or start again) one `up.Child` in its own session, its output pumped into
    `child.lines` and its ready line setting `child.ready`."""
    import subprocess
    import threading

    child.ready.clear()
    child.drained.clear()
    child.proc = subprocess.Popen(child.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    threading.Thread(target=up._pump, args=(child,), daemon=True).start()


def deploy_workers(workers: list[tuple[str, str, list[str]]], router_args: list[str] = (),
                   common: list[str] = (), secret_path: str | None = None) -> Deployment:
    """A router plus the given workers, each (name, role, extra flags), as real processes.
    `secret_path`: the cluster secret to use (a restarted deployment keeps its own)."""
    http_port, grpc_port, registry_port = pick_free_port(), pick_free_port(), pick_free_port()
    secret_path = secret_path or secret_file()
    secret = ["--cluster-secret-file", secret_path]
    py = [sys.executable, "-m", "pdserve.deploy.cli"]
    children = [up.Child("router", [*py, "router", "--host", "127.0.0.1", "--http-port", str(http_port),
                                    "--grpc-port", str(grpc_port), "--registry-port", str(registry_port),
                                    *secret, *router_args])]
    base = ["--host", "127.0.0.1", "--router", f"127.0.0.1:{registry_port}", "--grpc-port", "0",
            "--transfer-port", "0", "--num-threads", "1", "--heartbeat-s", "0.5",
            "--free-memory-fraction", "0.15", *secret, *common]  # a share of the OS's available memory each
    for name, role, extra in workers:
        children.append(up.Child(name, [*py, role, *base, "--worker-id", name, *extra]))
    for child in children:
        spawn(child)
    key = os.environ.get("PDSERVE_API_KEY")  # the router's, from the environment the children inherit
    try:
        up.wait_ready(children, f"http://127.0.0.1:{http_port}", READY_TIMEOUT_S,
                      headers={"Authorization": f"Bearer {key}"} if key else None)
    except BaseException:
        up.stop(children)
        raise
    return Deployment(children, http_port, grpc_port, secret_path)


def stream_and_disrupt(client, messages, max_tokens: int, disrupt,
                       seen: list[dict] | None = None) -> tuple[str, str, float]:
    """Stream one greedy chat through the OpenAI `client`; after its third content chunk call
    `disrupt(worker_id)` for the decode serving it. Returns (the text, that decode, the
    longest gap between chunks in seconds); `seen` gets each chunk's `pdserve` object."""
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                            temperature=0, stream=True)
    text, worker, chunks, longest, last = "", "", 0, 0.0, time.monotonic()
    for chunk in stream:
        now = time.monotonic()
        longest, last = max(longest, now - last), now
        extra = (chunk.model_extra or {}).get("pdserve") or {}
        if seen is not None:
            seen.append(extra)
        worker = worker or extra.get("routing", {}).get("decode_worker_id", "")
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            chunks += 1
            if chunks == 3:
                assert worker, "the first chunk names the decode worker"
                disrupt(worker)
    return text, worker, longest


def children_of(pid: int) -> list[int]:
    """Live (not zombie) child processes of `pid`, from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


class UpProcess:
    """`pdserve up` as a user starts it, in its own process, on free ports; its output lines
    are collected as they come."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None) -> None:
        import queue
        import subprocess
        import threading

        self.ports = [pick_free_port() for _ in range(3)]
        argv = [sys.executable, "-m", "pdserve.deploy.cli", "up", "--port", str(self.ports[0]),
                "--router-grpc-port", str(self.ports[1]), "--router-registry-port", str(self.ports[2]), *flags]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self._queue.put(line) for line in self.proc.stdout], daemon=True).start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.ports[0]}/v1"

    def openai(self):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key="unused", timeout=120, max_retries=0)

    def wait_for(self, text: str, timeout_s: float = READY_TIMEOUT_S, since: int = 0) -> int:
        """Index of the first line from `since` on that contains `text` (waiting for it)."""
        import queue

        deadline = time.monotonic() + timeout_s
        while True:
            for i in range(since, len(self.lines)):
                if text in self.lines[i]:
                    return i
            since = len(self.lines)
            try:
                self.lines.append(self._queue.get(timeout=max(0.01, min(1.0, deadline - time.monotonic()))))
            except queue.Empty:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"no line with {text!r} in {timeout_s:.0f} s:\n" + "".join(self.lines[-30:]))
            if self.proc.poll() is not None and self._queue.empty():
                raise AssertionError(f"pdserve up exited ({self.proc.returncode}) before {text!r}:\n"
                                     + "".join(self.lines[-30:]))

    def pid_of(self, worker_id: str) -> int:
        for pid in children_of(self.proc.pid):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f"\0--worker-id\0{worker_id}\0".encode() in f.read():
                    return pid
        raise AssertionError(f"pdserve up runs no {worker_id}")

    def stop(self, timeout_s: float = 30.0) -> str:
        """SIGINT (Ctrl-C), wait for it to end; its whole output."""
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout_s)
        while not self._queue.empty():
            self.lines.append(self._queue.get())
        return "".join(self.lines)
