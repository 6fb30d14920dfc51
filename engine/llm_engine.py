"""The engine: requests in, one step at a time, token deltas out. Single-threaded by design;
services drive it from one thread (see `engine_loop.py`). Its parts are built by
`engine.assembly`; the constructor only wires them."""
from __future__ import annotations

import itertools
import logging
import time
import uuid
from typing import Sequence

from pdserve.engine.assembly import assemble
from pdserve.engine.config import EngineConfig
from pdserve.engine.connector import Connector, ConnectorFactory
from pdserve.engine.detokenizer import Detokenizer
from pdserve.common.errors import InvalidRequestError
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import EngineStats, PrefillRate, RequestOutput, delta
from pdserve.engine.intake import Intake
from pdserve.engine.lora import NO_LORAS, LoraAdapter, LoraManager
from pdserve.engine.request import Request, RequestStatus, TokenLogprob, stop_status
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.step_threads import StepThreads, ThreadPolicy
from pdserve.common.block_hash import PromptBlocks

log = logging.getLogger("pdserve.engine")

__all__ = ["EngineStats", "LLMEngine"]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *,
                 connector: Connector | ConnectorFactory | None = None, loaded=None,
                 thread_policy: ThreadPolicy | None = None) -> None:
        """`connector`: a ready pair, or a factory the engine calls with its cache layout.
        `loaded`: a model loaded already. `thread_policy`: who sets its steps' thread count
        (None: always `config.num_threads`)."""
        config = config or EngineConfig()
        self._threads = StepThreads(config.num_threads, thread_policy)  # before the weights load
        parts = assemble(config, connector, loaded)
        loaded = self.loaded = parts.loaded
        self.config, self.model, self.kv, self.speculator = parts.config, parts.model, parts.kv, parts.speculator
        self.connector, self.layout, self.max_model_len = parts.connector, parts.layout, parts.max_model_len
        self.compat_hash, self.device = self.layout.compatibility_hash(), self.model.device
        self.model_config, self.tokenizer, self.model_name = loaded.model_config, loaded.tokenizer, loaded.name
        self.loras = LoraManager(self.config, self.model_config, self.device, self.model.dtype) \
            if self.config.enable_lora else NO_LORAS
        self.scheduler = Scheduler(self.config.scheduler, self.kv, self.connector.scheduler, self.max_model_len,
                                   self.speculator, self.loras)
        self.intake = Intake(self.config, self.model_config, self.tokenizer, self.max_model_len, self.kv.block_size,
                             self.compat_hash, self.device, self.loras)
        self.kv.extend_block_hashes = self.intake.extend_blocks  # generated blocks are cached too
        self.runner = ModelRunner(self.model, self.kv, self.connector.worker, self.loras)
        self._requests: dict[str, Request] = {}
        self._detok: dict[str, Detokenizer] = {}
        self._pending: list[RequestOutput] = []  # ends decided outside step() (abort, errors)
        self._sending: set[str] = set()
        self._finished_this_step: set[str] = set()  # finished, blocks kept until the connector's send ends
        self._num_prompt_computed = self._num_generated = self._num_steps = 0
        self._step_seconds, self._prefill_rate = 0.0, PrefillRate()
        self.last_step_ran = False  # whether the last step ran a forward

    # -- requests -----------------------------------------------------------------------
    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        return self.intake.tokenize(prompt)

    def prompt_blocks(self, token_ids: Sequence[int], cache_salt: str = "",
                      lora_name: str | None = None) -> PromptBlocks:
        """The keys and digests of a prompt's full blocks in this engine's cache (under
        adapter `lora_name`'s digest when given). Any thread."""
        return self.intake.prompt_blocks(token_ids, cache_salt, lora_name)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, remote_prefill: bool = False,
                    transfer_params: object | None = None, resumed: Sequence[int] = (),
                    cache_salt: str = "", stream_layers: bool = True,
                    blocks: PromptBlocks | None = None, lora_name: str | None = None) -> Request:
        """Queue a request. `resumed`: tokens it already generated elsewhere (a decode that
        died mid-stream); they count as its output (max_tokens, penalties, the seeded draw's
        index, grammar and stop-string state), their KV is computed here with the prompt's,
        and generation goes on after them. Such a request prefills locally. `cache_salt`:
        the tenant salt; prompts with different salts share no cached block.
        `stream_layers` (prefill side): its KV may leave layer by layer while the forward
        runs; False sends it whole after the forward. `blocks`: the prompt's
        `prompt_blocks`, when the caller computed them already. `lora_name`: the LoRA
        adapter it runs under (None: the base model; LoraNotFoundError if not loaded)."""
        request_id = request_id or uuid.uuid4().hex
        # an id is taken until its blocks are back: a finished request whose send still
        # reads its blocks holds them under its id (`_sending`)
        if request_id in self._requests or request_id in self._sending:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if lora_name is not None:
            self.loras.acquire(lora_name)  # held until the request ends (_finish)
        try:
            request, detok = self.intake.request(
                request_id, prompt, params or SamplingParams(), remote_prefill=remote_prefill,
                transfer_params=transfer_params, resumed=resumed, cache_salt=cache_salt,
                stream_layers=stream_layers, blocks=blocks, lora_name=lora_name)
            self.scheduler.add(request)
        except BaseException:
            if lora_name is not None:
                self.loras.release(lora_name)
            raise
        self._requests[request_id] = request
        self._detok[request_id] = detok
        return request

    def abort(self, request_id: str) -> bool:
        """End a request wherever it is; its blocks go back now. False if unknown/finished."""
        request = self._requests.get(request_id)
        if request is None or request.is_finished:
            return False
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        self._pending.append(delta(request, (), "", ()))
        return True

    def finish_remote_prefill(self, request_id: str, first_token_id: int,
                              logprob: TokenLogprob | None = None,
                              prompt_logprobs: Sequence[TokenLogprob] = ()) -> bool:
        """Decode side: the prefill service filled the blocks and chose the first token (and
        computed the prompt's logprobs when the request wants them)."""
        request = self.scheduler.finish_remote(request_id)
        if request is None:
            return False
        request.prompt_logprobs = list(prompt_logprobs)
        request.num_computed_tokens = request.num_prompt_tokens
        request.num_external_tokens = request.num_prompt_tokens - max(0, request.num_cached_tokens)
        self.kv.update_resources(request)
        self._pending += self._record([(request, first_token_id, logprob)])
        return True

    def recompute_remote_prefill(self, request_id: str) -> bool:
        """Decode side: the prefill leg failed; compute the prompt here instead."""
        return self.scheduler.recompute_remote(request_id) is not None

    def remote_block_ids(self, request_id: str) -> list[int]:
        return self.kv.blocks_of(request_id)

    # -- the step -----------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending) or bool(self._sending)

    def take_outputs(self) -> list[RequestOutput]:
        """The deltas decided between steps (a remote prefill's first token, an abort's end),
        now rather than with the next step's."""
        outputs, self._pending = self._pending, []
        return outputs

    def step(self) -> tuple[list[RequestOutput], list[Request]]:
        """Run one step. Returns (deltas, requests that now wait for a remote prefill)."""
        outputs = self.take_outputs()
        plan = self.scheduler.schedule()
        for request in self.loras.take_failed():  # its adapter's files changed or went away
            self._finish(request, RequestStatus.FINISHED_ERROR)
            self._pending.append(delta(request, (), "", ()))
        self.last_step_ran = bool(plan.chunks)
        between_layers = self._threads.before_step(forward=self.last_step_ran)
        if not plan.chunks and plan.connector_meta.request_ids:
            # no forward this step, but loads for a request that waits for a remote prefill
            self.connector.worker.start_load_kv(plan.connector_meta)
        if plan.chunks:
            started = time.perf_counter()
            computed_before = self._num_prompt_computed
            result = self.runner.execute(plan, between_layers)
            for chunk in plan.chunks:
                req = chunk.request
                if req.num_computed_tokens < req.num_prompt_tokens:
                    self._num_prompt_computed += min(chunk.num_new_tokens,
                                                     req.num_prompt_tokens - chunk.start)
                req.num_computed_tokens = chunk.start + chunk.num_new_tokens
                self.kv.update_resources(req)
            for chunk, entries in result.prompt_logprobs:
                known = chunk.request.prompt_logprobs  # a recomputed (preempted) prompt: kept
                known += entries[len(known) - chunk.start:]
            if result.sampling_chunks:
                self._pending += self.speculator.sample(result.sampling_chunks, result.logits, self._record)
            self._num_steps += 1
            elapsed = time.perf_counter() - started
            self._step_seconds += elapsed
            self.speculator.note_step(plan, elapsed)
            self._prefill_rate.note(self._num_prompt_computed - computed_before, elapsed)
        outputs += self._pending
        self._pending = []
        finished, self._finished_this_step = self._finished_this_step, set()
        done_sending = self.connector.worker.get_finished(finished)
        for request_id in done_sending & self._sending:
            self._sending.discard(request_id)
            self.kv.free_resources(request_id)
        return outputs, plan.remote_ready

    def _record(self, items) -> list[RequestOutput]:
        """Record sampled tokens, (request, token id, logprob or None) each; returns their
        deltas (none for a request that finished already)."""
        now, deltas = time.monotonic(), []
        for request, token, logprob in items:
            if request.is_finished:
                continue
            request.output_token_ids.append(token)
            request.grammar.advance(token)  # every path, a remote prefill's first token too
            if logprob is not None:
                request.output_logprobs.append(logprob)
            if request.first_token_time is None:
                request.first_token_time = now
            self._num_generated += 1
            detok = self._detok[request.request_id]
            text = detok.push(token)
            status = stop_status(request, token, detok.stopped_by, self.max_model_len)
            if status is not None:
                text += detok.flush() if detok.stopped_by is None else ""
                self._finish(request, status)
            deltas.append(delta(request, (token,), text, (logprob,) if logprob else ()))
        return deltas

    def _finish(self, request: Request, status: RequestStatus) -> None:
        freed = self.scheduler.finish(request, status)
        self._finished_this_step.add(request.request_id)
        if not freed:
            self._sending.add(request.request_id)
        self._requests.pop(request.request_id, None)
        self._detok.pop(request.request_id, None)
        if request.lora_name is not None:
            self.loras.release(request.lora_name)

    # -- LoRA adapters --------------------------------------------------------------------
    def load_lora(self, name: str, path: str) -> LoraAdapter:
        """Load the PEFT adapter in directory `path` as `name` (engine thread). LoraAdapterError
        (400) names what is wrong with it; AlreadyExistsError if `name` is loaded."""
        return self.loras.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Forget adapter `name` (engine thread). Refused with LoraInUseError while requests
        use it (queued, running or still decoding): it never waits and never switches a
        request to the base model."""
        self.loras.unload(name)

    def lora_names(self) -> list[str]:
        """The adapters loaded, by name. Any thread."""
        return self.loras.names()

    def lora_digest(self, name: str) -> str:
        """Adapter `name`'s digest (its name and content): what its KV is keyed by. Any thread."""
        return self.loras.digest_of(name)

    # -- introspection ------------------------------------------------------------------
    def idle(self) -> None:
        """Nothing to step: the thread policy hears it (the loop calls this while it waits)."""
        self._threads.before_step(forward=False)

    @property
    def num_threads(self) -> int:
        """Intra-op threads the last step ran with."""
        return self._threads.current

    def stats(self) -> EngineStats:
        s = self.scheduler
        # the prompt work this engine will do itself: a request whose KV a prefill service
        # computes (waiting for admission or for the KV) is not this engine's queue
        queued = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in itertools.chain(s.waiting, s.running)
                     if not r.waits_for_remote_prefill)
        decoding = sum(1 for r in s.running if r.num_computed_tokens >= r.num_prompt_tokens)
        return EngineStats(len(s.waiting), len(s.running), len(s.remote),
                           self.kv.get_num_free_blocks(), self.kv.get_max_resource_count(),
                           s.num_preemptions, self._num_prompt_computed, self._num_generated,
                           s.num_prefix_queries, s.num_prefix_hits, self._num_steps, self._step_seconds,
                           queued, self._prefill_rate.tokens_per_s, decoding, *self.speculator.totals())

    def assert_no_leaks(self) -> None:
        """Every KV block is back in the pool (call when nothing is in flight)."""
        self.kv.assert_all_free()
        self.loras.assert_idle()
