"""Backends by name, imported only when chosen (ucxx, torch.distributed and redis are heavy
or optional).

A transport module `pdserve.kvtransfer.backends.<name>` provides
`create_transport(config: KVTransferConfig) -> KVTransport`; failing that, its `KVTransport`
subclass whose `name` matches is built with the keyword arguments it accepts among `host`,
`port` and `config`. A store module of the same place provides
`create_store(config: KVTransferConfig) -> BlockStore`; its `StoreSpec` (config.STORE_SPECS)
says which setting locates it.
"""
from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass, field

from pdserve.kvtransfer.base import BlockStore, KVTransport
from pdserve.kvtransfer.config import STORE_SPECS, STORES, TRANSPORTS, KVTransferConfig

log = logging.getLogger(__name__)


class BackendUnavailable(RuntimeError):
    """A backend cannot be opened here (module or dependency missing, not configured)."""


class NotConfigured(BackendUnavailable):
    """A store in the chain without its location (no --redis-url, no --disk-store)."""


def open_transport(name: str, config: KVTransferConfig) -> KVTransport:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; known: {TRANSPORTS}")
    module = _import(name)
    factory = getattr(module, "create_transport", None)
    if factory is not None:
        return factory(config)
    for obj in vars(module).values():
        if (inspect.isclass(obj) and issubclass(obj, KVTransport) and obj is not KVTransport
                and getattr(obj, "name", "") == name):
            offered = {"host": config.host, "port": config.transfer_port, "config": config}
            params = inspect.signature(obj).parameters
            return obj(**{k: v for k, v in offered.items() if k in params})
    raise BackendUnavailable(f"{module.__name__} has no create_transport() or {name} KVTransport")


def open_store(name: str, config: KVTransferConfig) -> BlockStore:
    if name not in STORES:
        raise ValueError(f"unknown store {name!r}; known: {STORES}")
    if not config.store_configured(name):
        raise NotConfigured(f"set {STORE_SPECS[name].flag}")
    module = _import(name)
    factory = getattr(module, "create_store", None)
    if factory is None:
        raise BackendUnavailable(f"{module.__name__} has no create_store()")
    return factory(config)


@dataclass(slots=True)
class OpenedBackends:
    transports: dict[str, KVTransport] = field(default_factory=dict)
    stores: dict[str, BlockStore] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)  # name -> why not


def open_backends(config: KVTransferConfig) -> OpenedBackends:
    """Every backend of the chain (and the prefix-cache store) that can be opened here. One
    that cannot is recorded with its reason; the chain then skips it, saying why."""
    opened = OpenedBackends()
    names = list(config.backends)
    if config.prefix_cache and config.prefix_cache not in names:
        names.append(config.prefix_cache)
    for name in names:
        if name not in TRANSPORTS + STORES:
            continue
        try:
            if name in TRANSPORTS:
                opened.transports[name] = open_transport(name, config)
            else:
                opened.stores[name] = store = open_store(name, config)
                if not store.probe():  # configured, but nothing answers there (yet): say so now
                    log.warning("kv backend %s is configured but does not answer: %s", name,
                                store.health.last_error or "probe failed")
        except NotConfigured as exc:  # left out on purpose: not worth a warning
            opened.unavailable[name] = f"not configured: {exc}"
            log.info("kv backend %s not configured (%s)", name, exc)
        except Exception as exc:  # one broken backend must not stop the worker: say why
            opened.unavailable[name] = f"unavailable here: {exc}"
            log.warning("kv backend %s unavailable: %s", name, exc)
    return opened


def is_importable(name: str) -> tuple[bool, str]:
    """Whether backend `name`'s module (and its dependency) imports here, and if not why."""
    try:
        _import(name)
    except (BackendUnavailable, ImportError) as exc:
        return False, str(exc)
    return True, ""


def _import(name: str):
    module_name = f"pdserve.kvtransfer.backends.{name}"
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise BackendUnavailable(f"{module_name} is not built yet") from exc
        raise
