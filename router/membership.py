"""Workers joining and leaving: Register / Heartbeat / Deregister, and polling of
--static-workers (which never register; the router calls their Load instead).

Register checks the newcomer against the live workers of its model (same compatibility
hash and block size) and, for a decode worker of a model the router cannot tokenize for
yet, fetches the model (ModelInfo with the tokenizer) from it before answering. With keys
required (a cluster secret), a registration binds its id to the worker's public key, and no
worker may take the routers' caller id.
"""
from __future__ import annotations

import asyncio
import logging
import re
import math
from typing import Callable

import grpc

from pdserve.common.errors import (EXPECTED_ERRORS, IncompatiblePeerError, InvalidRequestError,
                                   NotFoundError, UnavailableError)
from pdserve.proto.pdserve.v1 import common_pb2, registry_pb2
from pdserve.router.catalog import ModelCatalog
from pdserve.rpc.channels import WorkerChannels
from pdserve.router.config import Role, RouterConfig, StaticWorker
from pdserve.router.worker_registry import KVBackendState, Load, Worker, WorkerRegistry
from pdserve.security.registration import check_worker_key

log = logging.getLogger("pdserve.router.membership")

_ROLES = {registry_pb2.WORKER_ROLE_PREFILL: Role.PREFILL, registry_pb2.WORKER_ROLE_DECODE: Role.DECODE}


# What a registrant's names may be: they reach logs and metric labels as they are.
_NAME = re.compile(r"[\w.:/@+=\[\]-]{1,256}")


def _check_name(value: str, param: str) -> None:
    if not _NAME.fullmatch(value):
        raise InvalidRequestError(f"{param} must be 1-256 of letters, digits and . _ : / @ + = - [ ]",
                                  param=param)


def worker_from_proto(info: registry_pb2.WorkerInfo) -> Worker:
    """INVALID_ARGUMENT unless every required field is present and sane (its names: labels
    that can forge no log line or metric series, `_NAME`)."""
    if not info.worker_id:
        raise InvalidRequestError("worker_id is required", param="worker_id")
    _check_name(info.worker_id, "worker_id")
    for backend in info.kv_backends:
        _check_name(backend, "kv_backends")
    if info.role not in _ROLES:
        raise InvalidRequestError("role must be PREFILL or DECODE", param="role")
    host, _, port = info.grpc_address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidRequestError(f"grpc_address {info.grpc_address!r} is not host:port",
                                  param="grpc_address")
    if not info.model_name:
        raise InvalidRequestError("model_name is required", param="model_name")
    _check_name(info.model_name, "model_name")
    if info.block_size < 1:
        raise InvalidRequestError("block_size must be >= 1", param="block_size")
    return Worker(worker_id=info.worker_id, role=_ROLES[info.role], address=info.grpc_address,
                  model_name=info.model_name, compatibility_hash=info.compatibility_hash,
                  block_size=info.block_size, num_total_blocks=info.capacity.num_total_blocks,
                  max_model_len=info.capacity.max_model_len, kv_backends=tuple(info.kv_backends))


MAX_REPORTED_REQUESTS = 1 << 20  # a load report's counts are clamped to these bounds
MAX_REPORTED_TOKENS = 1 << 40
MAX_REPORTED_BACKENDS = 16
MAX_REPORTED_ADAPTERS = 1024


def load_from_proto(load: common_pb2.WorkerLoad) -> Load:
    """A load report as the router uses it: every count clamped to a sane bound and the
    free blocks to the total (a report cannot make a worker look emptier than empty), at most
    MAX_REPORTED_BACKENDS backends. What the router itself sent a worker still counts however
    little it reports (`WorkerRecord.load_score`)."""
    requests = lambda n: min(int(n), MAX_REPORTED_REQUESTS)  # noqa: E731
    total = min(int(load.num_total_blocks), MAX_REPORTED_TOKENS)
    return Load(requests(load.num_queued), requests(load.num_running), min(int(load.num_free_blocks), total), total,
                tuple(KVBackendState(b.name, b.usable, b.detail[:256])
                      for b in load.kv_backends[:MAX_REPORTED_BACKENDS]),
                load.counters if load.HasField("counters") else None,
                min(int(load.queued_prompt_tokens), MAX_REPORTED_TOKENS), _rate(load.prefill_tokens_per_s),
                requests(load.num_decoding), load.draining,
                tuple(a for a in load.lora_adapters[:MAX_REPORTED_ADAPTERS] if 0 < len(a.name) <= 128))


def _rate(value: float) -> float:
    """A reported rate as the planner may use it: finite and positive, else 0 (unknown)."""
    return value if math.isfinite(value) and 0 < value < 1e12 else 0.0


class Membership:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry, catalog: ModelCatalog,
                 channels: WorkerChannels, kv_sync: Callable[[str], None] = lambda worker_id: None) -> None:
        """`kv_sync(worker_id)`: ask a worker for its KV snapshot (after each registration, and
        at each poll of a static worker, which sends no events)."""
        self._kv_sync = kv_sync
        self._config = config
        self._registry = registry
        self._catalog = catalog
        self._channels = channels
        self._lock = asyncio.Lock()  # one registration at a time: checks and catalog stay consistent

    async def register(self, worker: Worker, load: Load, lease: bytes = b"", public_key: bytes = b"", require_key: bool = False) -> bytes:
        """The new registration's lease (WorkerRegistry.register); `lease`: the worker's
        live one, when it registers again; `public_key`: what verifies its calls (with
        `require_key`, INVALID_ARGUMENT unless it is one)."""
        async with self._lock:
            self._registry.check_free(worker, lease, public_key)  # before anything reaches out to its address
            if require_key:
                check_worker_key(worker.worker_id, public_key)
            self._check_compatible(worker)
            if worker.role is Role.DECODE and self._needs_model_info(worker):
                info = await self._fetch_model_info(worker)
                if info.model_name != worker.model_name or info.block_size != worker.block_size:
                    raise IncompatiblePeerError(f"worker {worker.worker_id}: ModelInfo says model {info.model_name!r} "
                                                f"block_size {info.block_size}, registration says "
                                                f"{worker.model_name!r} {worker.block_size}")
                await self._catalog.learn(info)
            new_lease = self._registry.register(worker, load, lease=lease, leased=True, public_key=public_key)
        self._kv_sync(worker.worker_id)  # this router, or the worker, may have restarted: learn what it holds
        return new_lease

    def heartbeat(self, worker_id: str, load: Load, lease: bytes) -> None:
        """NOT_FOUND when the worker is unknown: it must register again."""
        if not self._registry.heartbeat(worker_id, load, lease=lease):
            raise NotFoundError(f"worker {worker_id!r} is not registered; register again",
                                param="worker_id")

    def check_lease(self, worker_id: str, lease: bytes) -> None:
        """NOT_FOUND when the worker is unknown (register again); UNAUTHENTICATED unless `lease`
        is its registration's."""
        if not self._registry.check_lease(worker_id, lease):
            raise NotFoundError(f"worker {worker_id!r} is not registered; register again", param="worker_id")

    def deregister(self, worker_id: str, lease: bytes) -> bool:
        return self._registry.deregister(worker_id, lease=lease)

    def lookup(self, worker_id: str) -> registry_pb2.LookupResponse:
        """The role and key of `worker_id`'s registration, until it is forgotten (as the
        router's own `RegistryKeys`); found=False when there is none."""
        record = self._registry.get(worker_id)
        if record is None or not record.public_key:
            return registry_pb2.LookupResponse(found=False)
        role = next(number for number, role in _ROLES.items() if role is record.worker.role)
        return registry_pb2.LookupResponse(found=True, role=role, public_key=record.public_key)

    async def poll_static_workers(self) -> None:
        """Forever: Load (and at first ModelInfo) of every static worker, once per
        heartbeat interval. A worker that does not answer simply ages out."""
        while True:
            await asyncio.gather(*(self._poll(w) for w in self._config.static_workers))
            await asyncio.sleep(self._config.heartbeat_interval_s)

    async def _poll(self, static: StaticWorker) -> None:
        worker_id = f"{static.role.value}@{static.address}"
        stub = (self._channels.decode if static.role is Role.DECODE else self._channels.prefill)(static.address)
        timeout = min(self._config.rpc_timeout_s, self._config.worker_timeout_s)
        try:
            load_msg = await stub.Load(common_pb2.LoadRequest(), timeout=timeout)
            load = load_from_proto(load_msg)
            if self._registry.get(worker_id) is not None:
                self._registry.heartbeat(worker_id, load)
                self._kv_sync(worker_id)
                return
            info = await stub.ModelInfo(common_pb2.ModelInfoRequest(), timeout=timeout)
            worker = Worker(worker_id, static.role, static.address, info.model_name,
                            block_size=info.block_size, num_total_blocks=load.num_total_blocks,
                            max_model_len=info.max_model_len)
            await self.register(worker, load)
        except grpc.aio.AioRpcError as err:
            log.debug("static worker %s: %s %s", worker_id, err.code().name, err.details())
        except EXPECTED_ERRORS as err:
            log.warning("static worker %s refused: %s", worker_id, err)

    def _check_compatible(self, worker: Worker) -> None:
        for record in self._registry.alive():
            other = record.worker
            if other.model_name != worker.model_name or other.worker_id == worker.worker_id:
                continue
            if worker.compatibility_hash and other.compatibility_hash \
                    and worker.compatibility_hash != other.compatibility_hash:
                raise IncompatiblePeerError(f"worker {worker.worker_id}: compatibility hash {worker.compatibility_hash} "
                                            f"differs from live worker {other.worker_id}'s {other.compatibility_hash}",
                                            param="compatibility_hash")
            if worker.block_size != other.block_size:
                raise IncompatiblePeerError(f"worker {worker.worker_id}: block_size {worker.block_size} differs from "
                                            f"live worker {other.worker_id}'s {other.block_size}", param="block_size")

    def _needs_model_info(self, worker: Worker) -> bool:
        """Unknown model, or no other live decode worker vouches for what we know."""
        if not self._catalog.knows(worker.model_name):
            return True
        return not any(r.worker.model_name == worker.model_name and r.worker_id != worker.worker_id
                       for r in self._registry.alive(Role.DECODE))

    async def _fetch_model_info(self, worker: Worker) -> common_pb2.ModelInfoResponse:
        stub = self._channels.decode(worker.address)
        try:
            return await stub.ModelInfo(common_pb2.ModelInfoRequest(include_tokenizer=True),
                                        timeout=self._config.rpc_timeout_s)
        except grpc.aio.AioRpcError as err:
            raise UnavailableError(f"router could not fetch ModelInfo from {worker.address}: "
                                   f"{err.code().name} {err.details()}") from None
