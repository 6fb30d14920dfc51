"""Which adapters an engine knows, which are in memory, which sit in the device slots, and
which requests hold them.

Three tiers, each bounded:
- registered: every adapter `load` accepted (name -> path and digest), until `unload`;
- in memory (`max_cpu_loras`, LRU): checked tensors on the CPU; one evicted is read again
  from its path when a request asks for it, and must hash to the digest it was loaded with;
- resident (`max_loras` slots, LRU): on the device, applied by the forward.

A request holds its adapter from `acquire` (add_request) to `release` (its end): a held
adapter cannot be unloaded (LoraInUseError: unloading is refused, not waited for). A
request takes a slot when the scheduler admits it (`try_activate`) and gives it back when
it is preempted or ends (`deactivate`); a slot in use is never rewritten, so no request
changes adapter mid-way. A request whose adapter is in no slot and finds every slot in use
waits at the head of the queue (arrival order is kept). Engine thread, except `names` and `digest_of` (any).
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from pdserve.common.errors import AlreadyExistsError, LoraAdapterError, LoraInUseError, LoraNotFoundError
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.lora.adapter import LoraAdapter, load_peft_adapter
from pdserve.engine.lora.slots import NO_LORA, NoLora, SlotWeights

log = logging.getLogger("pdserve.engine.lora")

MAX_NAME_CHARS = 256


@dataclass(frozen=True, slots=True)
class Registered:
    name: str
    path: str
    digest: str
    rank: int


class LoraManager:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config, self.model_config, self.device = config, model_config, device
        self.max_cpu = config.max_cpu_loras or config.max_loras
        self.slots = SlotWeights(model_config, config.max_loras, config.max_lora_rank, device, dtype)
        self._lock = threading.Lock()  # guards _registered (read by other threads)
        self._registered: dict[str, Registered] = {}
        self._memory: OrderedDict[str, LoraAdapter] = OrderedDict()  # LRU first
        self._refs: dict[str, int] = {}
        self._slot_names: list[str | None] = [None] * config.max_loras
        self._slot_users = [0] * config.max_loras
        self._slot_order: OrderedDict[int, None] = OrderedDict((s, None) for s in range(config.max_loras))
        self._failed: list = []  # requests whose adapter could not be read again (take_failed)

    # -- registry ----------------------------------------------------------------------
    def load(self, name: str, path: str) -> LoraAdapter:
        _check_name(name)
        with self._lock:
            if name in self._registered:
                raise AlreadyExistsError(f"adapter {name!r} is already loaded; unload it first", param="lora_name")
        adapter = load_peft_adapter(path, self.model_config, max_rank=self.config.max_lora_rank,
                                    allowed_root=self.config.lora_allowed_root, name=name)
        with self._lock:
            self._registered[name] = Registered(name, adapter.path, adapter.digest, adapter.rank)
        self._memory[name] = adapter
        self._trim_memory()
        return adapter

    def unload(self, name: str) -> None:
        self._known(name)
        if self._refs.get(name, 0):
            raise LoraInUseError(f"adapter {name!r} is used by {self._refs[name]} request(s); "
                                 f"unload it when they have finished", param="lora_name")
        with self._lock:
            del self._registered[name]
        self._memory.pop(name, None)
        for slot, held in enumerate(self._slot_names):
            if held == name:
                self._slot_names[slot] = None

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._registered)

    def digest_of(self, name: str) -> str:
        """The digest of adapter `name` (LoraNotFoundError if unknown). Any thread."""
        return self._known(name).digest

    def adapter(self, name: str) -> LoraAdapter | None:
        """`name`'s tensors if they are in memory."""
        return self._memory.get(name)

    # -- requests ----------------------------------------------------------------------
    def acquire(self, name: str) -> None:
        """A new request uses `name` (LoraNotFoundError if it is not loaded): it cannot be
        unloaded until `release`."""
        self._known(name)
        self._refs[name] = self._refs.get(name, 0) + 1

    def release(self, name: str) -> None:
        left = self._refs.get(name, 0) - 1
        if left > 0:
            self._refs[name] = left
        else:
            self._refs.pop(name, None)

    def try_activate(self, request) -> bool:
        """Give `request` a slot holding its adapter (no adapter: nothing to do). False when
        every slot holds another adapter that admitted requests use, or when the adapter
        could not be read again (the request is then in `take_failed`)."""
        name = request.lora_name
        if name is None or request.lora_slot >= 0:
            return True
        slot = next((s for s, held in enumerate(self._slot_names) if held == name), None)
        if slot is None:
            slot = next((s for s in self._slot_order if self._slot_users[s] == 0), None)
            if slot is None:
                return False
            try:
                adapter = self._in_memory(name)
            except (LoraAdapterError, LoraNotFoundError) as exc:
                log.error("request %s: adapter %r cannot be read: %s", request.request_id, name, exc)
                self._failed.append(request)
                return False
            self.slots.write(slot, adapter)
            self._slot_names[slot] = name
        self._slot_users[slot] += 1
        self._slot_order.move_to_end(slot)
        request.lora_slot = slot
        return True

    def take_failed(self) -> list:
        """Requests whose adapter could not be read again since the last call: they must end."""
        failed, self._failed = self._failed, []
        return failed

    def deactivate(self, request) -> None:
        if request.lora_slot >= 0:
            self._slot_users[request.lora_slot] -= 1
            request.lora_slot = -1

    def resident(self) -> list[str]:
        return [n for n in self._slot_names if n is not None]

    def batch(self, row_slots: list[int]) -> NoLora:
        return self.slots.batch(row_slots, self.device)

    def assert_idle(self) -> None:
        """No request holds an adapter or a slot (tests, after everything finished)."""
        assert not any(self._refs.values()), f"adapters still held: {self._refs}"
        assert not any(self._slot_users), f"slots still in use: {self._slot_users}"

    # -- internals ---------------------------------------------------------------------
    def _known(self, name: str) -> Registered:
        with self._lock:
            record = self._registered.get(name)
        if record is None:
            raise LoraNotFoundError(f"the LoRA adapter {name!r} is not loaded", param="model")
        return record

    def _in_memory(self, name: str) -> LoraAdapter:
        """`name`'s tensors: in memory, or read again from its path (and checked to hash to
        the digest it was loaded with)."""
        adapter = self._memory.get(name)
        if adapter is None:
            record = self._known(name)
            adapter = load_peft_adapter(record.path, self.model_config, max_rank=self.config.max_lora_rank,
                                        allowed_root=self.config.lora_allowed_root, name=name)
            if adapter.digest != record.digest:
                raise LoraAdapterError(f"adapter {name!r} changed on disk since it was loaded; load it again")
            self._memory[name] = adapter
        self._memory.move_to_end(name)
        self._trim_memory()
        return adapter

    def _trim_memory(self) -> None:
        """Evict non-resident adapters, least recent first, down to max_cpu_loras (which is
        at least max_loras, so the resident ones always fit); the newest stays."""
        keep = set(self._slot_names) | {next(reversed(self._memory), None)}
        for name in list(self._memory):
            if len(self._memory) <= self.max_cpu:
                break
            if name not in keep:
                del self._memory[name]


class NoLoras:
    """An engine without LoRA: every adapter name is unknown, every request runs base."""

    def names(self) -> list[str]:
        return []

    def _refuse(self, name: str, *args) -> None:
        raise LoraNotFoundError(f"the LoRA adapter {name!r} is not loaded: this engine runs without "
                                f"LoRA (enable_lora)", param="model")

    load = unload = digest_of = acquire = _refuse

    def release(self, name: str) -> None:
        pass

    def try_activate(self, request) -> bool:
        return True

    def deactivate(self, request) -> None:
        pass

    def resident(self) -> list[str]:
        return []

    def batch(self, row_slots: list[int]) -> NoLora:
        return NO_LORA

    def take_failed(self) -> list:
        return []

    def assert_idle(self) -> None:
        pass


NO_LORAS = NoLoras()


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or not name.isprintable() \
            or name != name.strip():
        raise LoraAdapterError(f"adapter name {name!r} must be 1 to {MAX_NAME_CHARS} printable characters "
                               f"without surrounding spaces", param="lora_name")
