"""LoRA adapters at the router: which names the deployment serves (by the workers' reports),
what a request's `model` resolves to, and the admin's load and unload on every worker.

A name is served while some live worker reports it, loaded or loadable on first use
(`WorkerLoad.lora_adapters`); its parent is that worker's served model. A request naming it
runs on the parent model under the adapter. Runtime loads and unloads reach every live worker
of every role (`pdserve.v1.Adapters`, the router's own credential) and succeed only when all
of them do: a half-loaded adapter would be routed to workers that cannot serve it.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from pdserve.common.errors import ErrorKind, InvalidRequestError, NotFoundError, ServiceError, to_service_error
from pdserve.proto.pdserve.v1 import adapters_pb2, common_pb2
from pdserve.router.worker_registry import WorkerRecord, WorkerRegistry
from pdserve.rpc.channels import WorkerChannels

log = logging.getLogger("pdserve.router.adapters")

ADMIN_TIMEOUT_S = 120.0  # one worker's load of one adapter (read, checked, installed)


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    name: str
    model_name: str  # the served model it runs on
    parent: str  # what /v1/models shows: its base_model_name, else model_name
    digest: str = ""  # as a worker that loaded it reports it (empty: none has yet)


def adapters_of(record: WorkerRecord) -> dict[str, common_pb2.LoraAdapterState]:
    return {a.name: a for a in record.load.lora_adapters}


def holds(record: WorkerRecord, lora_name: str) -> bool:
    """Whether the worker's engine has the adapter loaded now (by its last report)."""
    state = adapters_of(record).get(lora_name)
    return state is not None and state.loaded


def serves(record: WorkerRecord, lora_name: str) -> bool:
    """Whether the worker may run the adapter (loaded, or loadable on first use)."""
    return not lora_name or lora_name in adapters_of(record)


class AdapterDirectory:
    """The adapters the live workers report, for resolving requests and /v1/models."""

    def __init__(self, registry: WorkerRegistry | None) -> None:
        """`registry` None: no workers, no adapters."""
        self._registry = registry

    def served(self) -> list[ServedAdapter]:
        found: dict[str, ServedAdapter] = {}
        records = self._registry.alive() if self._registry is not None else []
        for record in sorted(records, key=lambda r: r.worker_id):
            for state in record.load.lora_adapters:
                model = record.worker.model_name
                known = found.get(state.name)
                if known is None or (not known.digest and state.digest):
                    found[state.name] = ServedAdapter(state.name, model, state.base_model_name or model, state.digest)
        return [found[name] for name in sorted(found)]

    def find(self, name: str) -> ServedAdapter | None:
        """The adapter `name`, when a live worker serves it."""
        if not name:
            return None
        return next((a for a in self.served() if a.name == name), None)


class AdapterAdmin:
    """/v1/load_lora_adapter and /v1/unload_lora_adapter: the same call on every live worker."""

    def __init__(self, registry: WorkerRegistry, channels: WorkerChannels, enabled: bool,
                 timeout_s: float = ADMIN_TIMEOUT_S) -> None:
        self._registry = registry
        self._channels = channels
        self.enabled = enabled
        self._timeout_s = timeout_s

    async def load(self, body: dict) -> dict:
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        request = adapters_pb2.LoadAdapterRequest(lora_name=name, lora_path=path)
        answers, error = await self._on_every_worker(lambda r: self._channels.adapters(r.worker.address).LoadAdapter(
            request, timeout=self._timeout_s))
        for record, answer in answers:  # routed to at once, before their next report
            self._registry.note_adapter(record.worker_id, answer.adapter)
        if error is not None:
            raise error
        log.info("loaded LoRA adapter %r from %r on %d workers", name, path, len(answers))
        return {"object": "lora_adapter", "lora_name": name, "lora_path": path, "workers": len(answers)}

    async def unload(self, body: dict) -> dict:
        """Workers where a request still runs under the adapter refuse (the engine's rule:
        FAILED_PRECONDITION, code adapter_in_use) and keep serving it; the others drop it.
        Routing follows each worker's own answer, so no request is sent where it is gone."""
        name = _field(body, "lora_name")
        request = adapters_pb2.UnloadAdapterRequest(lora_name=name)
        answers, error = await self._on_every_worker(lambda r: self._channels.adapters(r.worker.address).UnloadAdapter(
            request, timeout=self._timeout_s))
        for record, _ in answers:
            self._registry.note_adapter_gone(record.worker_id, name)
        if error is not None:
            raise error
        if not any(answer.found for _, answer in answers):
            raise NotFoundError(f"The LoRA adapter `{name}` is not loaded", param="lora_name")
        log.info("unloaded LoRA adapter %r on %d workers", name, len(answers))
        return {"object": "lora_adapter", "lora_name": name, "unloaded": True, "workers": len(answers)}

    async def _on_every_worker(self, call) -> tuple[list, BaseException | None]:
        """((record, answer) of each live worker where `call` succeeded, the first failure as
        its worker raised it, or None)."""
        if not self.enabled:
            raise NotFoundError("LoRA adapters are not enabled on this router (--enable-lora)")
        records = [r for r in self._registry.alive() if not r.suspect]
        if not records:
            raise ServiceError(ErrorKind.UNAVAILABLE, "no live worker to call", retry_after_s=1)
        results = await asyncio.gather(*(call(r) for r in records), return_exceptions=True)
        answers, error = [], None
        for record, result in zip(records, results):
            if not isinstance(result, BaseException):
                answers.append((record, result))
                continue
            if isinstance(result, grpc.aio.AioRpcError):
                log.warning("LoRA admin call on %s: %s %s", record.worker_id, result.code().name, result.details())
                result = to_service_error(result)
            error = error or result
        return answers, error


def _field(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"'{name}' is required (a string)", param=name)
    return value
