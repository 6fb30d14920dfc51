"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Iterator, Sequence

from pdserve.common.errors import InvalidRequestError
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.connector import Connector, ConnectorFactory
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import Completion, RequestOutput
from pdserve.engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Runs the engine in the caller's thread until the given prompts are done."""

    def __init__(self, model: str = "default", *, config: EngineConfig | None = None,
                 connector: Connector | ConnectorFactory | None = None, loaded=None,
                 thread_policy=None, **overrides) -> None:
        config = config or EngineConfig(model=model)
        if config.model != model and model != "default":
            config = replace(config, model=model)
        cache_keys = set(CacheConfig.__dataclass_fields__)
        sched_keys = set(SchedulerConfig.__dataclass_fields__)
        cache = {k: v for k, v in overrides.items() if k in cache_keys}
        sched = {k: v for k, v in overrides.items() if k in sched_keys}
        rest = {k: v for k, v in overrides.items() if k not in cache_keys | sched_keys}
        if "dtype" in overrides:  # the model's and its KV cache's, as the workers' --dtype sets both
            rest["dtype"] = overrides["dtype"]
        config = replace(config, cache=replace(config.cache, **cache),
                         scheduler=replace(config.scheduler, **sched), **rest)
        self.engine = LLMEngine(config, connector=connector, loaded=loaded, thread_policy=thread_policy)
        self._ids = itertools.count()
        self._prompt_ids: dict[str, tuple[int, ...]] = {}

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter in directory `path` as `name` (needs enable_lora=True)."""
        self.engine.load_lora(name, path)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 lora_name: str | Sequence[str | None] | None = None) -> list[Completion]:
        """All prompts run together (continuous batching); results in prompt order.
        `lora_name`: the adapter of every prompt, or one per prompt (None: the base model)."""
        prompts = _as_list(prompts)
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        names = list(lora_name) if isinstance(lora_name, (list, tuple)) else [lora_name] * len(prompts)
        if len(names) != len(prompts):
            raise InvalidRequestError(f"{len(names)} lora names for {len(prompts)} prompts")
        ids = [self._submit(p, sp, lora_name=n) for p, sp, n in zip(prompts, params_list, names)]
        state = {rid: _Accumulator(rid, self._prompt_ids.pop(rid)) for rid in ids}
        for out in self._drain():
            acc = state.get(out.request_id)
            if acc is not None:
                acc.add(out)
        return [state[rid].completion(self.engine) for rid in ids]

    def generate_stream(self, prompt: Prompt, params: SamplingParams | None = None,
                        request_id: str | None = None, lora_name: str | None = None) -> Iterator[RequestOutput]:
        """Deltas of one request as they come (other requests in flight keep running)."""
        rid = self._submit(prompt, params, request_id, lora_name)
        self._prompt_ids.pop(rid, None)
        for out in self._drain():
            if out.request_id == rid:
                yield out
                if out.finished:
                    return

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, lora_name: str | None = None) -> str:
        rid = self._submit(prompt, params, request_id, lora_name)
        self._prompt_ids.pop(rid, None)
        return rid

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def step(self) -> list[RequestOutput]:
        outputs, _ = self.engine.step()
        return outputs

    def _submit(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None = None,
                lora_name: str | None = None) -> str:
        rid = request_id or f"offline-{next(self._ids)}"
        request = self.engine.add_request(prompt, params or SamplingParams(), request_id=rid, lora_name=lora_name)
        self._prompt_ids[rid] = tuple(request.prompt_token_ids)
        return rid

    def _drain(self) -> Iterator[RequestOutput]:
        while self.engine.has_unfinished():
            outputs, _ = self.engine.step()
            yield from outputs


def _as_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return list(prompts)


class _Accumulator:
    def __init__(self, request_id: str, prompt_token_ids: tuple[int, ...]) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.tokens: list[int] = []
        self.text: list[str] = []
        self.logprobs: list = []
        self.prompt_logprobs = None
        self.last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.tokens += out.new_token_ids
        self.text.append(out.new_text)
        self.logprobs += out.new_logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.last = out

    def completion(self, engine: LLMEngine) -> Completion:
        last = self.last
        return Completion(self.request_id, self.prompt_token_ids, tuple(self.tokens), "".join(self.text),
                          tuple(self.logprobs), last.finish_reason if last else None,
                          last.stop_reason if last else None,
                          last.num_cached_tokens if last else 0,
                          last.num_external_tokens if last else 0, self.prompt_logprobs)
