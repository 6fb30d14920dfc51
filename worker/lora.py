"""The LoRA adapters of one worker, at the service's edge: which it may serve
(--lora-modules), which its engine holds, loading on first use, and what the heartbeat says.

The engine owns the adapters' weights (`engine.lora`); this object decides when to ask it,
on the engine thread, and keeps the rule of the hand-off: a request runs under the adapter
its name resolves to here, and KV computed under one adapter (one digest) is never used
under another.
"""
from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

from pdserve.common.errors import IncompatiblePeerError, InvalidRequestError, LoraInUseError, NotFoundError
from pdserve.proto.pdserve.v1 import common_pb2

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")
LOAD_TIMEOUT_S = 120.0  # reading and installing one adapter on the engine thread


class LoraDisabledError(IncompatiblePeerError):
    """A LoRA operation on a worker started without --enable-lora."""


def check_lora_name(name: str, param: str = "lora_name") -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequestError(f"{param} must be 1-128 characters of letters, digits and ._:/@+- "
                                  f"(got {name!r:.80})", param=param)
    return name


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One adapter a worker may serve: --lora-modules NAME=PATH or its JSON form."""

    name: str
    path: str
    base_model_name: str = ""

    @classmethod
    def parse(cls, entry: str) -> "LoraModule":
        text = entry.strip()
        if text.startswith("{"):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"--lora-modules {text!r:.80}: not JSON ({exc.msg})") from None
            unknown = set(data) - {"name", "path", "base_model_name"} if isinstance(data, dict) else {"?"}
            if unknown or not isinstance(data.get("name"), str) or not isinstance(data.get("path"), str):
                raise InvalidRequestError(f"--lora-modules {text!r:.80}: expected {{\"name\": ..., \"path\": ..., "
                                          "\"base_model_name\": ...}")
            base = data.get("base_model_name") or ""
            if not isinstance(base, str):
                raise InvalidRequestError(f"--lora-modules {text!r:.80}: base_model_name must be a string")
            return cls(check_lora_name(data["name"]), data["path"], base)
        name, sep, path = text.partition("=")
        if not sep or not path:
            raise InvalidRequestError(f"--lora-modules {text!r:.80}: expected NAME=PATH or JSON")
        return cls(check_lora_name(name.strip()), path.strip())


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """The worker's LoRA settings, validated once."""

    enabled: bool = False
    modules: tuple[LoraModule, ...] = ()
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int = 0
    allowed_root: str = ""

    @classmethod
    def from_worker(cls, settings) -> "LoraSettings":
        modules = tuple(LoraModule.parse(entry) for entry in settings.lora_modules)
        names = [m.name for m in modules]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise InvalidRequestError(f"--lora-modules names {', '.join(duplicated)} more than once")
        if modules and not settings.enable_lora:
            raise InvalidRequestError("--lora-modules needs --enable-lora")
        if settings.max_loras < 1 or settings.max_lora_rank < 1 or settings.max_cpu_loras < 0:
            raise InvalidRequestError("--max-loras and --max-lora-rank must be >= 1, --max-cpu-loras >= 0")
        if 0 < settings.max_cpu_loras < settings.max_loras:
            raise InvalidRequestError("--max-cpu-loras must be at least --max-loras (0: the same)")
        return cls(settings.enable_lora, modules, settings.max_loras, settings.max_lora_rank,
                   settings.max_cpu_loras or settings.max_loras, settings.lora_allowed_root)

    def engine_fields(self) -> dict[str, Any]:
        """EngineConfig's LoRA fields (none when LoRA is off: the engine's defaults)."""
        if not self.enabled:
            return {}
        return {"enable_lora": True, "max_loras": self.max_loras, "max_lora_rank": self.max_lora_rank,
                "max_cpu_loras": self.max_cpu_loras, "lora_allowed_root": self.allowed_root or None}


class WorkerAdapters:
    """The adapters of one worker's engine. Engine mutations run on the engine thread
    (`EngineLoop.call`); its registry is read from here (`lora_names`, `lora_digest`: any
    thread). Loads of one name are serialized, so a burst of first requests loads it once."""

    def __init__(self, loop, settings: LoraSettings, check_with=None) -> None:
        """`check_with`: the model's config, to read every --lora-modules adapter once now
        (`check_modules`)."""
        self.loop = loop
        self.settings = settings
        self._modules = {m.name: m for m in settings.modules}  # what may be loaded on first use
        self._locks: dict[str, asyncio.Lock] = {}
        if check_with is not None:
            self.check_modules(check_with)

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    def check_modules(self, model_config) -> None:
        """Read every --lora-modules adapter once, at start: a malformed one stops the worker
        with the problem named (InvalidRequestError)."""
        if not self._modules:
            return
        from pdserve.engine.lora import load_peft_adapter

        for module in self._modules.values():
            try:
                load_peft_adapter(module.path, model_config, max_rank=self.settings.max_lora_rank,
                                  allowed_root=self.settings.allowed_root or None, name=module.name)
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"--lora-modules {module.name}: {exc}") from None

    def _loaded(self) -> set[str]:
        return set(self.loop.engine.lora_names()) if self.enabled else set()

    async def ensure(self, name: str) -> str:
        """The digest of adapter `name` in this engine, loading it first when --lora-modules
        lists it. NotFoundError when this worker may not serve it."""
        if not name:
            return ""
        if not self.enabled:
            raise NotFoundError(f"The model `{name}` does not exist (LoRA is off on this worker)", param="model")
        if name not in self._loaded():
            module = self._modules.get(name)
            if module is None:
                raise NotFoundError(f"The model `{name}` does not exist", param="model")
            async with self._locks.setdefault(name, asyncio.Lock()):
                if name not in self._loaded():
                    await self._load(name, module.path)
        return self.loop.engine.lora_digest(name)

    async def load(self, name: str, path: str) -> common_pb2.LoraAdapterState:
        """Load `path` under `name` (runtime admin): served from now on. Loading a name that
        is loaded from the same path again is a no-op (every worker answers alike)."""
        if not self.enabled:
            raise LoraDisabledError("LoRA is off on this worker (start it with --enable-lora)")
        check_lora_name(name)
        if not path:
            raise InvalidRequestError("lora_path is required", param="lora_path")
        async with self._locks.setdefault(name, asyncio.Lock()):
            known = self._modules.get(name)
            if not (name in self._loaded() and known is not None and known.path == path):
                await self._load(name, path)
            self._modules[name] = LoraModule(name, path, known.base_model_name if known else "")
        return self._state(name)

    async def _load(self, name: str, path: str) -> None:
        engine = self.loop.engine
        await self.loop.call(lambda: engine.load_lora(name, path), timeout=LOAD_TIMEOUT_S)

    async def unload(self, name: str) -> bool:
        """Forget `name`: the engine drops it and it is no longer loaded on first use. The
        engine refuses (LoraInUseError) while a request runs under it: that request keeps
        its adapter to the end, and the adapter stays served."""
        if not self.enabled:
            raise LoraDisabledError("LoRA is off on this worker (start it with --enable-lora)")
        check_lora_name(name)
        known = name in self._modules
        if name in self._loaded():
            engine = self.loop.engine
            try:
                await self.loop.call(lambda: engine.unload_lora(name), timeout=LOAD_TIMEOUT_S)
            except LoraInUseError as exc:
                raise LoraInUseError(f"adapter {name!r} is in use by running requests on this worker; unload it "
                                     f"once they finish ({exc})", param="lora_name") from None
            known = True
        self._modules.pop(name, None)
        return known

    def check_handoff(self, name: str, digest: str) -> None:
        """Prefill side, after `ensure(name)`: the decode's digest of the adapter must be ours."""
        ours = self.loop.engine.lora_digest(name) if name else ""
        if digest != ours:
            raise IncompatiblePeerError(f"adapter {name!r}: the decode's digest {digest[:16]!r} differs from "
                                        f"this worker's {ours[:16]!r} (KV under one adapter is never used "
                                        "under another)")

    def _state(self, name: str, loaded: set[str] | None = None,
               resident: set[str] | None = None) -> common_pb2.LoraAdapterState:
        engine = self.loop.engine
        loaded = self._loaded() if loaded is None else loaded
        module = self._modules.get(name)
        state = common_pb2.LoraAdapterState(name=name, base_model_name=module.base_model_name if module else "",
                                            loaded=name in loaded)
        if name in loaded:
            state.digest = engine.lora_digest(name)
            state.resident = name in (resident if resident is not None else set(engine.loras.resident()))
        return state

    def states(self) -> list[common_pb2.LoraAdapterState]:
        """Every adapter this worker serves, for its heartbeat."""
        if not self.enabled:
            return []
        loaded, resident = self._loaded(), set(self.loop.engine.loras.resident())
        return [self._state(name, loaded, resident) for name in sorted(set(self._modules) | loaded)]
