"""`pdserve up`: router + prefill + decode services on this machine, one command.

Each role runs as its own process (`python -m pdserve.deploy.cli <role> ...`), exactly as in
a cluster. Workers pick free ports and register with the router. `up` waits until every
service is ready (restarting one that dies, see `supervisor`), prints the URL and a curl line, keeps every
process running (a worker or router that exits is restarted with back-off; one that keeps
failing stops `up` with a line that says which and why), and on Ctrl-C (or SIGTERM) stops
every process: SIGTERM, then SIGKILL after a grace period or a second Ctrl-C.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from pdserve.common import envs
from pdserve.deploy.supervisor import GaveUp, RestartPolicy, Supervisor
from pdserve.router.config import ROUTER_GRPC_PORT, ROUTER_HTTP_PORT, ROUTER_REGISTRY_PORT
from pdserve.security.enrollment import ANY_HOST, EnrollmentIssuer
from pdserve.security.secret import ROUTER_USES, ClusterSecret, write_key_ring
from pdserve.worker.settings import WorkerSettings

GRACE_S = 10.0
_OUTPUT = threading.Lock()
# passed to every process, the router included
SECURITY_FLAGS = ("cluster_secret_file", "insecure_internal", "internal_tls_cert", "internal_tls_key",
                  "internal_tls_ca")
NUM_PREFILL = 1
NUM_DECODE = 1
READY_TIMEOUT_S = 300.0
DRAIN_TIMEOUT_S = 2.0  # how long a dead child's remaining output is waited for
@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    lines: list[str] = field(default_factory=list)
    drained: threading.Event = field(default_factory=threading.Event)  # its output read to the end
    env: dict[str, str] = field(default_factory=dict)  # added to the environment (secrets stay out of argv)


def _flags(settings: dict[str, Any], names) -> list[str]:
    out = []
    for name in names:
        value = settings.get(name)
        if value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, (list, tuple)):  # a repeated flag: once per value
            out += [part for item in value for part in (flag, str(item))]
            continue
        out += [flag] if value is True else [flag, str(value)]
    return out


def plan(settings: dict[str, Any], issuer: EnrollmentIssuer | None = None) -> tuple[list[Child], int]:
    """The processes of this deployment. `settings["cluster_secret_file"]` is the secret
    every child authenticates internal calls with (`main` makes one when none is given)."""
    from pdserve.deploy.cli import router_pass_through  # the flags' one table

    host = settings.get("host") or "127.0.0.1"
    http_port = int(settings.get("http_port") or ROUTER_HTTP_PORT)
    grpc_port = int(settings.get("router_grpc_port") or ROUTER_GRPC_PORT)
    registry_port = int(settings.get("router_registry_port") or ROUTER_REGISTRY_PORT)
    # the router reads a key ring of the keys it needs (security.secret.ROUTER_USES) where `start` made one
    router_security = _flags(dict(settings, cluster_secret_file=settings.get("router_key_ring_file")
                                  or settings.get("cluster_secret_file")), SECURITY_FLAGS)
    local = bool(settings.get("local_prefill"))
    num_prefill = 0 if local else int(settings.get("num_prefill") or NUM_PREFILL)
    num_decode = int(settings.get("num_decode") or NUM_DECODE)
    py = [sys.executable, "-m", "pdserve.deploy.cli"]
    # each worker joins with a token of its own, signed by a key that lives only in this process
    # (security.enrollment): the router gets the public half, the cluster secret alone admits no one
    issuer = issuer or EnrollmentIssuer()
    # the workers and the registry stay on loopback unless asked: only the client ports follow --host
    internal = settings.get("internal_host") or "127.0.0.1"
    router = [*py, "router", "--host", host, "--internal-host", internal, "--http-port", str(http_port),
              "--grpc-port", str(grpc_port), "--registry-port", str(registry_port),
              "--enrollment-public-key", issuer.public_key.hex(), *router_security,
              *_flags(settings, router_pass_through())]
    if settings.get("log_level"):
        router += ["--log-level", str(settings["log_level"])]
    if settings.get("enable_lora"):  # the workers' flag turns on the router's adapter endpoints too
        router += ["--enable-lora"]
    children = [Child("router", router, env={"PDSERVE_API_KEY": settings["api_key"]} if settings.get("api_key") else {})]
    make = worker_maker(settings, num_prefill, num_decode, issuer)
    children += [make("prefill", i) for i in range(num_prefill)] + [make("decode", i) for i in range(num_decode)]
    return children, http_port


def worker_maker(settings: dict[str, Any], num_prefill: int, num_decode: int, issuer: EnrollmentIssuer):
    """`make(role, i)`: the `Child` of worker `<role>-<i>`, enrolled by `issuer` (the one whose
    public key the router holds). The machine's cores and memory are split among the workers:
    those started now, or with the planner the most it may run."""
    from pdserve.deploy.cli import worker_pass_through  # the flags' one table

    registry_port = int(settings.get("router_registry_port") or ROUTER_REGISTRY_PORT)
    sharing = num_prefill + num_decode
    if settings.get("planner"):
        sharing = max(sharing, int(settings.get("planner_max_prefill") or 0) * (num_prefill > 0)
                      + int(settings.get("planner_max_decode") or 0))
    threads: list[str] = []
    if settings.get("num_threads") is None:
        # the engines split this machine's cores; with a core share, each takes them all
        # while every other engine is idle (worker.core_share)
        cores = os.cpu_count() or 1
        base = max(1, cores // (num_prefill + num_decode))
        settings = dict(settings, num_threads=base)
        if settings.get("core_share") and cores > base:
            threads = ["--core-share", str(settings["core_share"]), "--burst-threads", str(cores)]
    if settings.get("free_memory_fraction") is None:
        # ... and its memory: each KV cache takes an even share of the default fraction
        share = WorkerSettings("decode").free_memory_fraction / sharing
        settings = dict(settings, free_memory_fraction=round(share, 4))
    # the Redis URL may carry a password: it reaches the workers in their environment, never argv
    worker_env = {"PDSERVE_REDIS_URL": settings["redis_url"]} if settings.get("redis_url") else {}
    internal = settings.get("internal_host") or "127.0.0.1"
    registry = "127.0.0.1" if internal in ("0.0.0.0", "::") else internal
    token_host = ANY_HOST if internal in ("0.0.0.0", "::") else internal
    common = ["--host", internal, "--router", f"{registry}:{registry_port}", "--grpc-port", "0",
              *_flags(settings, SECURITY_FLAGS),
              *_flags(settings, [name for name in worker_pass_through() if name != "redis_url"])]
    if settings.get("local_prefill"):
        common += ["--kv-backends", ""]
    py = [sys.executable, "-m", "pdserve.deploy.cli"]

    def make(role: str, i: int) -> Child:
        # each worker joins with a token of its own (security.enrollment), this one's id and role
        token = {"PDSERVE_ENROLLMENT_TOKEN": issuer.issue(f"{role}-{i}", role, token_host)}
        return Child(f"{role}-{i}", [*py, role, *common, *threads, "--worker-id", f"{role}-{i}",
                                     "--transfer-port", "0"], env={**worker_env, **token})
    return make


def _pump(child: Child) -> None:
    assert child.proc is not None and child.proc.stdout is not None
    try:
        for line in child.proc.stdout:
            line = line.rstrip("\n")
            child.lines.append(line)
            del child.lines[:-200]
            if "ready on" in line or "Uvicorn running" in line or "router ready" in line:
                child.ready.set()
            with _OUTPUT:  # one write per line: two children's lines never run together
                sys.stdout.write(f"[{child.name}] {line}\n")
                sys.stdout.flush()
    finally:
        child.drained.set()


def _router_ready(base_url: str, num_workers: int, headers: dict[str, str] | None = None) -> bool:
    """The router answers /ready and has registered every worker we started (/health counts
    workers for a caller with the API key, `headers`, when the router asks for one)."""
    try:
        with _open(f"{base_url}/ready") as resp:
            if resp.status != 200:
                return False
        with _open(f"{base_url}/health", headers) as resp:
            body = json.loads(resp.read() or b"{}")
    except Exception:  # noqa: BLE001 - not up yet, whatever the reason: ask again
        return False
    return int(body.get("decode_workers", 0)) + int(body.get("prefill_workers", 0)) >= num_workers


def _open(url: str, headers: dict[str, str] | None = None):
    """GET `url` from our own router: over TLS its certificate names the host clients use, not
    necessarily this one, so this local check does not verify it."""
    import ssl

    context = ssl._create_unverified_context() if url.startswith("https:") else None
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=2, context=context)


def base_url(settings: dict[str, Any], http_port: int) -> str:
    host = settings.get("host") or "127.0.0.1"
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"{'https' if settings.get('tls_cert') else 'http'}://{host}:{http_port}"


def _die_with_parent() -> None:
    """In the child, before exec: its own session (a terminal's Ctrl-C reaches only `up`), and
    SIGKILL when `up` dies however it dies (Linux PR_SET_PDEATHSIG), so no worker outlives it."""
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)


def client_headers(settings: dict[str, Any]) -> dict[str, str]:
    """How `up` itself asks its router as a client: the API key, else the first tenant's key
    of --api-keys-file (the same user's file), else no key."""
    key = settings.get("api_key")
    if not key and settings.get("api_keys_file"):
        from pdserve.security.tenants import first_key

        key = first_key(settings["api_keys_file"])
    return {"Authorization": f"Bearer {key}"} if key else {}


def _served_model(url: str, settings: dict[str, Any]) -> str:
    """The model name clients must send: the router's /v1/models, else what was asked for."""
    headers = client_headers(settings)
    try:
        with _open(f"{url}/v1/models", headers) as resp:
            return json.loads(resp.read())["data"][0]["id"]
    except Exception:  # noqa: BLE001 - a banner with the asked-for name beats none
        return settings.get("served_model_name") or "SmolLM2-135M-Instruct"


def banner(url: str, model: str, api_key: bool) -> str:
    """What `up` prints once everything is ready: where, and a request that works as printed."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    auth = ' -H "Authorization: Bearer $PDSERVE_API_KEY"' if api_key else ""
    insecure = " -k" if url.startswith("https:") else ""
    return (f"\npdserve is up: {url}/v1  (OpenAI API)\n"
            f"  curl{insecure} {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'\n"
            "Ctrl-C stops every service.")


def spawn(child: Child) -> None:
    """Start (or start again) `child`'s process, its output pumped into `child.lines`."""
    child.ready.clear()
    child.drained.clear()
    env = dict(os.environ, PYTHONUNBUFFERED="1", **child.env)
    child.proc = subprocess.Popen(child.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env=env, preexec_fn=_die_with_parent)
    threading.Thread(target=_pump, args=(child,), daemon=True).start()


def start(settings: dict[str, Any], issuer: EnrollmentIssuer | None = None) -> tuple[list[Child], int]:
    if settings.get("cluster_secret_file") and not settings.get("router_key_ring_file"):
        settings = dict(settings, router_key_ring_file=router_key_ring(settings["cluster_secret_file"]))
    children, http_port = plan(settings, issuer)
    for child in children:
        spawn(child)
    return children, http_port


def wait_ready(children: list[Child], url: str, timeout_s: float, supervisor: Supervisor | None = None,
               stopping: threading.Event | None = None, headers: dict[str, str] | None = None) -> None:
    """Until every worker printed its ready line and the router at `url` registered them all.
    A child that exits meanwhile is restarted by `supervisor`, or (without one) fails the start."""
    stopping = stopping or threading.Event()
    deadline = time.monotonic() + timeout_s
    workers = [c for c in children if c.name != "router"]
    while time.monotonic() < deadline and not stopping.is_set():
        if supervisor is not None:
            supervisor.check()
        else:
            for child in children:
                if child.proc.poll() is not None:
                    child.drained.wait(DRAIN_TIMEOUT_S)  # its last words (a crash's stacks) too
                    tail = "\n".join(child.lines[-40:])
                    raise RuntimeError(f"{child.name} exited with {child.proc.returncode}:\n{tail}")
        if all(c.ready.is_set() for c in workers) and _router_ready(url, len(workers), headers):
            return
        stopping.wait(0.5)
    if stopping.is_set():
        return
    missing = [c.name for c in children if not c.ready.is_set()]
    raise TimeoutError(f"services not ready after {timeout_s:.0f} s: {missing or 'router registry'}")


def stop(children: list[Child], grace_s: float = GRACE_S, hurry: threading.Event | None = None) -> None:
    """SIGTERM every child, SIGKILL what is left after `grace_s` (or as soon as `hurry` is
    set: a second Ctrl-C). A stopped child (SIGSTOP, Ctrl-Z) is continued too, or it could not
    act on the SIGTERM."""
    hurry = hurry or threading.Event()
    live = [c for c in children if c.proc is not None and c.proc.poll() is None]
    for child in live:
        child.proc.send_signal(signal.SIGTERM)
        child.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    while live and time.monotonic() < deadline and not hurry.is_set():
        live = [c for c in live if c.proc.poll() is None]
        if live:
            hurry.wait(0.05)
    for child in live:
        if child.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait(5)


@contextlib.contextmanager
def cluster_secret(settings: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """`settings` with a cluster secret file: the user's; with a prefix store, the one `up`
    keeps beside its build cache (`kept_secret`: the store's keys derive from it, so a
    restarted deployment finds what it stored); else a new random one for this run (mode
    0600 in a private directory, deleted when `up` ends)."""
    if settings.get("cluster_secret_file"):
        yield settings
        return
    if settings.get("prefix_store") not in (None, "", "none"):
        yield dict(settings, cluster_secret_file=str(kept_secret(envs.cache_root())))
        return
    with tempfile.TemporaryDirectory(prefix="pdserve-up-") as private:  # 0700
        path = os.path.join(private, "cluster-secret")
        ClusterSecret.create(path)
        yield dict(settings, cluster_secret_file=path)


@contextlib.contextmanager
def core_share(settings: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """`settings` with the file through which this run's workers share the machine's cores
    (`worker.core_share`), in a private directory deleted when `up` ends."""
    with tempfile.TemporaryDirectory(prefix="pdserve-cores-") as private:  # 0700
        yield dict(settings, core_share=os.path.join(private, "core-share"))


def router_key_ring(secret_file: str) -> str:
    """A key ring of the secret's ROUTER_USES keys for the router (it never reads the secret
    itself), in a new private directory (0700; small, left for the OS's temp cleaning)."""
    path = os.path.join(tempfile.mkdtemp(prefix="pdserve-router-keys-"), "router-keys")
    write_key_ring(ClusterSecret.load(secret_file), ROUTER_USES, path)
    return path


def kept_secret(cache_root: Path) -> Path:
    """The cluster secret `up` keeps across its runs: `<cache root>/up/cluster-secret`,
    0600 in a 0700 directory, made on first use and checked like any secret file on each."""
    folder = cache_root / "up"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    path = folder / "cluster-secret"
    with contextlib.suppress(FileExistsError):
        ClusterSecret.create(path)
    ClusterSecret.load(path)  # owned by us, readable by nobody else, or refused
    return path


def main(settings: dict[str, Any]) -> int:
    if settings.get("planner"):  # a planner setting it cannot take stops `up` before anything starts
        from pdserve.planner.settings import PlannerSettings

        PlannerSettings.from_settings(settings)
    with cluster_secret(settings) as settings, core_share(settings) as settings:
        return _run(settings)


def _run(settings: dict[str, Any]) -> int:
    # SIGTERM and SIGINT stop everything at any moment, start-up included (SIGINT's handler is
    # set explicitly because a shell script starting `up` in the background ignores it); a
    # second one while stopping kills what is left at once. Neither raises: no traceback.
    stopping, hurry = threading.Event(), threading.Event()

    def on_signal(*_: Any) -> None:
        (hurry if stopping.is_set() else stopping).set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    check_planner_profile(settings)
    issuer = EnrollmentIssuer()  # enrolls the workers started now and those the planner adds
    children, http_port = start(settings, issuer)
    policy = RestartPolicy()
    if settings.get("max_restarts") is not None:
        policy = dataclasses.replace(policy, max_restarts=int(settings["max_restarts"]))
    supervisor = Supervisor(list(children), spawn, _say, policy)  # `children` also gets the planner's workers
    planner = None
    try:
        url = base_url(settings, http_port)
        headers = client_headers(settings)
        wait_ready(children, url, float(settings.get("ready_timeout_s") or READY_TIMEOUT_S), supervisor, stopping,
                   headers)
        if not stopping.is_set():
            print(banner(url, _served_model(url, settings), bool(settings.get("api_key"))), flush=True)
            planner = start_planner(settings, children, supervisor, url, issuer)
        while not stopping.is_set():
            supervisor.check()
            if planner is not None:
                planner[0].step()
            stopping.wait(0.5)
        return 0
    except (GaveUp, RuntimeError, TimeoutError) as exc:
        print(f"pdserve up: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        stopping.set()
        if planner is not None:
            planner[1].stop()
        stop(children, hurry=hurry)
        print("pdserve up: stopped", flush=True)


def check_planner_profile(settings: dict[str, Any]) -> None:
    """With `--planner --planner-profile`: ProfileError (before any worker starts) unless the
    profile was measured for the model and KV layout this `up` serves."""
    if not settings.get("planner") or not settings.get("planner_profile"):
        return
    from pdserve.planner.compat import model_compat_hash
    from pdserve.planner.profile import load_profile

    load_profile(settings["planner_profile"]).check_compatible(model_compat_hash(
        settings.get("model") or "default", dtype=settings.get("dtype") or "float32",
        block_size=int(settings.get("block_size") or 16), quantization=settings.get("quantization") or "auto"))


def start_planner(settings: dict[str, Any], children: list[Child], supervisor: Supervisor, url: str,
                  issuer: EnrollmentIssuer):
    """With `--planner`: (the process scaler, the running live planner); else None."""
    if not settings.get("planner"):
        return None
    from pdserve.deploy.scaler import ProcessScaler
    from pdserve.planner.runner import RunningPlanner, log_to
    from pdserve.planner.settings import PlannerSettings

    planner_settings = PlannerSettings.from_settings(settings)
    num_prefill = sum(1 for c in children if c.name.startswith("prefill-"))
    make = worker_maker(settings, num_prefill, sum(1 for c in children if c.name.startswith("decode-")), issuer)
    drain_s = float(settings.get("drain_timeout_s") or WorkerSettings("decode").drain_timeout_s)
    scaler = ProcessScaler(children, supervisor, make, spawn, _say, drain_timeout_s=drain_s,
                           ready_timeout_s=float(settings.get("ready_timeout_s") or READY_TIMEOUT_S))
    log_to(_say)
    running = RunningPlanner(planner_settings, scaler, url, settings.get("api_key") or "",
                             host=settings.get("host") or "127.0.0.1").start()
    limits = planner_settings.limits()
    _say(f"planner on: every {planner_settings.planner_interval_s:g} s toward TTFT {planner_settings.slo_ttft_ms:g} ms"
         f" / TPOT {planner_settings.slo_tpot_ms:g} ms; prefill {limits.min_prefill}-{limits.max_prefill}, "
         f"decode {limits.min_decode}-{limits.max_decode} (advisor: {getattr(running.planner.advisor, 'name', '?')})")
    return scaler, running


def _say(line: str) -> None:
    with _OUTPUT:
        print(f"pdserve up: {line}", flush=True)
