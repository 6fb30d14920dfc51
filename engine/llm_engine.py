"""The engine: requests in, one step at a time, token deltas out. Single-threaded by design;
services drive it from one thread (see `engine_loop.py`)."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Sequence

import torch

from pdserve.engine.config import EngineConfig, ModelConfig, kv_weights
from pdserve.engine.connector import Connector, ConnectorFactory, KVCacheLayout
from pdserve.engine import gguf_weights
from pdserve.engine.constraints import GrammarCompiler
from pdserve.engine.fingerprint import weights_fingerprint
from pdserve.engine.detokenizer import Detokenizer
from pdserve.common.errors import InvalidRequestError
from pdserve.engine.kv_cache_manager import DTYPES, KVCacheManager
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.models.llama import CausalLM
from pdserve.engine.outputs import PrefillRate, RequestOutput, merge_deltas
from pdserve.engine.request import (Request, RequestStatus, TokenLogprob, check_prompt, check_resumed,
                                    stop_status)
from pdserve.engine.sampler import sample
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledChunk, Scheduler
from pdserve.engine.speculation import NO_SPECULATION, Speculator, verify
from pdserve.engine.step_threads import StepThreads, ThreadPolicy
from pdserve.common.block_hash import PromptBlocks, check_cache_salt, prompt_blocks

log = logging.getLogger("pdserve.engine")


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_waiting_remote: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    num_prompt_tokens_computed: int  # prompt tokens run through the model, all requests
    num_generation_tokens: int
    num_prefix_queries: int = 0  # prompt tokens of admitted requests
    num_prefix_hits: int = 0  # of those, found in the prefix cache
    num_steps: int = 0  # steps that ran a forward
    step_seconds: float = 0.0  # their total time
    num_queued_prompt_tokens: int = 0  # prompt tokens of waiting and running requests not yet computed
    prefill_tokens_per_s: float = 0.0  # recent prompt tokens per second of forward time (0: none yet)
    num_decoding: int = 0  # running requests past their prompt
    # speculative decoding: drafts checked, drafts kept, and sequence-steps that checked drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verified_sequences: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *,
                 connector: Connector | ConnectorFactory | None = None, loaded=None,
                 thread_policy: ThreadPolicy | None = None) -> None:
        """`connector`: a ready pair, or a factory the engine calls with its cache layout.
        `thread_policy`: who sets its steps' thread count (None: always `config.num_threads`)."""
        from pdserve.engine.loader import load_model, weight_files

        self.config = config or EngineConfig()
        self._threads = StepThreads(self.config.num_threads, thread_policy)
        self.device = torch.device(self.config.device)
        dtype = DTYPES[self.config.dtype]
        self.loaded = loaded or load_model(self.config.model, dtype=self.config.dtype)
        self.model_config: ModelConfig = self.loaded.model_config
        self.tokenizer = self.loaded.tokenizer
        self.model_name = self.loaded.name
        state = self.loaded.load_state_dict()
        quantization, blocks = gguf_weights.weights_to_serve(self.config, self.loaded, state)
        self.config = dataclasses.replace(self.config, quantization=quantization)
        self.model = CausalLM(self.model_config, state, self.device, dtype, quantization, blocks)
        del state
        sched_cfg = self.config.scheduler
        self.max_model_len = min(sched_cfg.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        cache_cfg = self.config.cache
        if self.model_config.sliding_window and (cache_cfg.attention_window is None
                                                 or cache_cfg.attention_window > self.model_config.sliding_window):
            cache_cfg = dataclasses.replace(cache_cfg, attention_window=self.model_config.sliding_window)
        self.kv = KVCacheManager(self.model_config, cache_cfg, self.device)
        self.layout = KVCacheLayout(
            model_name=self.model_name, num_layers=self.model_config.num_layers,
            num_blocks=self.kv.num_blocks, block_size=self.kv.block_size,
            num_kv_heads=self.model_config.num_kv_heads, head_dim=self.model_config.head_dim,
            dtype=self.config.cache.dtype, weights=kv_weights(self.config.quantization),
            attention_window=cache_cfg.attention_window or 0,
            weights_fingerprint=weights_fingerprint(weight_files(self.loaded.model_dir)))
        self.compat_hash = self.layout.compatibility_hash()
        if connector is None:
            connector = Connector()
        self.connector = connector if isinstance(connector, Connector) else connector(self.layout)
        self.connector.worker.register_kv_caches(self.kv.kv_caches, self.layout)
        spec = self.config.speculative
        self.speculator = Speculator(spec) if spec is not None else NO_SPECULATION
        self.scheduler = Scheduler(sched_cfg, self.kv, self.connector.scheduler, self.max_model_len,
                                   self.speculator)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                        self.model_config.eos_token_ids)
        self.runner = ModelRunner(self.model, self.kv, self.connector.worker)
        self._requests: dict[str, Request] = {}
        self._detok: dict[str, Detokenizer] = {}
        self._pending: list[RequestOutput] = []  # ends decided outside step() (abort, errors)
        self._sending: set[str] = set()
        self._finished_this_step: set[str] = set()  # finished, blocks kept until the connector's send ends
        self._generator = torch.Generator(device=self.device).manual_seed(self.config.seed)
        self._num_prompt_computed = 0
        self._num_generated = 0
        self._num_steps = 0
        self.last_step_ran = False  # whether the last step ran a forward
        self._step_seconds = 0.0
        self._prefill_rate = PrefillRate()
        kv_tokens = (self.kv.num_blocks - 1) * self.kv.block_size
        kv_gib = sum(t.numel() * t.element_size() for t in self.kv.kv_caches) / 2**30
        log.info("engine ready: model %s (%s, %s), KV cache %.2f GiB = %d tokens in blocks of %d, "
                 "max_model_len %d: room for %.1f requests at full length, more when shorter",
                 self.model_name, self.config.dtype, self.device, kv_gib, kv_tokens, self.kv.block_size,
                 self.max_model_len, kv_tokens / self.max_model_len)

    # -- requests -----------------------------------------------------------------------
    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return [int(t) for t in prompt]

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, remote_prefill: bool = False,
                    transfer_params: object | None = None, resumed: Sequence[int] = (),
                    cache_salt: str = "", stream_layers: bool = True,
                    blocks: PromptBlocks | None = None) -> Request:
        """Queue a request. `resumed`: tokens it already generated elsewhere (a decode that
        died mid-stream); they count as its output (max_tokens, penalties, the seeded draw's
        index, grammar and stop-string state), their KV is computed here with the prompt's,
        and generation goes on after them. Such a request prefills locally. `cache_salt`:
        the tenant salt; prompts with different salts share no cached block.
        `stream_layers` (prefill side): its KV may leave layer by layer while the forward
        runs; False sends it whole after the forward. `blocks`: the prompt's
        `prompt_blocks`, when the caller computed them already."""
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        # an id is taken until its blocks are back: a finished request whose send still
        # reads its blocks holds them under its id (`_sending`)
        if request_id in self._requests or request_id in self._sending:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        ids = self.tokenize(prompt)
        params = check_prompt(ids, params, self.model_config.vocab_size, self.max_model_len)  # max_tokens resolved
        check_cache_salt(cache_salt)
        resumed = check_resumed(resumed, params, self.model_config.vocab_size)
        request = Request(request_id, ids, params, eos_token_ids=self.model_config.eos_token_ids,
                          transfer_params=transfer_params, remote_prefill=remote_prefill,
                          stream_layers=stream_layers)
        blocks = blocks or self.prompt_blocks(ids, cache_salt)
        request.block_hashes, request.block_digests, request.cache_salt = blocks.hashes, blocks.digests, cache_salt
        request.grammar = self.grammars.matcher(params.constraint)
        if params.seed is not None:
            request.generator = torch.Generator(device=self.device)  # reseeded per token (sampler)
        else:
            request.generator = self._generator
        detok = Detokenizer(self.tokenizer, params.stop, params.skip_special_tokens)
        for token in resumed:  # replay: the state the first decode had, nothing emitted again
            request.output_token_ids.append(token)
            request.grammar.advance(token)
            detok.push(token)
        self.scheduler.add(request)
        self._requests[request_id] = request
        self._detok[request_id] = detok
        return request

    def prompt_blocks(self, token_ids: Sequence[int], cache_salt: str = "") -> PromptBlocks:
        """The keys and digests of a prompt's full blocks in this engine's cache (its block
        size, compatibility hash and block-hash key). Reads only fixed state: any thread."""
        return prompt_blocks(token_ids, self.kv.block_size, self.compat_hash, self.config.block_hash_key,
                             cache_salt)

    def abort(self, request_id: str) -> bool:
        """End a request wherever it is; its blocks go back now. False if unknown/finished."""
        request = self._requests.get(request_id)
        if request is None or request.is_finished:
            return False
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        self._pending.append(self._output(request, (), "", ()))
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
        self._append_tokens([(request, first_token_id, logprob)])
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
                self._sample(result.sampling_chunks, result.logits)
            self._num_steps += 1
            elapsed = time.perf_counter() - started
            self._step_seconds += elapsed
            if self.speculator.enabled and all(c.num_new_tokens == 1 for c in plan.chunks):
                self.speculator.cost.note(plan.num_tokens, elapsed)
            self._prefill_rate.note(self._num_prompt_computed - computed_before, elapsed)
        outputs += self._pending
        self._pending = []
        finished, self._finished_this_step = self._finished_this_step, set()
        done_sending = self.connector.worker.get_finished(finished)
        for request_id in done_sending & self._sending:
            self._sending.discard(request_id)
            self.kv.free_resources(request_id)
        return outputs, plan.remote_ready

    def _sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> None:
        """Sample each chunk's rows (`StepResult.logits`): one batch for the chunks without
        drafts, then each chunk with drafts in order of its rows (`_verify`)."""
        firsts = list(itertools.accumulate((1 + len(c.draft_token_ids) for c in chunks), initial=0))
        plain = [i for i, c in enumerate(chunks) if not c.draft_token_ids]
        if plain:
            reqs = [chunks[i].request for i in plain]
            tokens = sample(logits if len(plain) == len(chunks) else logits[[firsts[i] for i in plain]], reqs)
            self._append_tokens([(r, t.token_id, t.logprob) for r, t in zip(reqs, tokens)])
        for i, chunk in enumerate(chunks):
            if chunk.draft_token_ids:
                self._verify(chunk, logits[firsts[i]:firsts[i + 1]])

    def _verify(self, chunk: ScheduledChunk, logits: torch.Tensor) -> None:
        """A chunk with drafts (`speculation.verify`): the request keeps the KV of the kept
        drafts and gives back the blocks past them; its tokens go out as one delta."""
        request, first = chunk.request, len(self._pending)
        num_kept, num_tested = verify(request, chunk.draft_token_ids, logits,
                                      lambda token: self._append_tokens([(request, token.token_id, token.logprob)]))
        request.num_computed_tokens += num_kept
        self.speculator.observe(request, len(chunk.draft_token_ids), num_kept, num_tested)
        if not request.is_finished:
            self.kv.trim(request)
        if len(self._pending) - first > 1:
            self._pending[first:] = [merge_deltas(self._pending[first:])]

    def _append_tokens(self, items) -> None:
        """Record sampled tokens; their deltas go out with the next step's outputs."""
        now = time.monotonic()
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
            self._pending.append(
                self._output(request, (token,), text, (logprob,) if logprob else ()))

    def _finish(self, request: Request, status: RequestStatus) -> None:
        freed = self.scheduler.finish(request, status)
        self._finished_this_step.add(request.request_id)
        if not freed:
            self._sending.add(request.request_id)
        self._requests.pop(request.request_id, None)
        self._detok.pop(request.request_id, None)

    def _output(self, request: Request, tokens, text, logprobs) -> RequestOutput:
        prompt_logprobs = None
        if tokens and request.sampling_params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            prompt_logprobs, request.prompt_logprobs_sent = tuple(request.prompt_logprobs), True
        return RequestOutput(
            request.request_id, tuple(tokens), text, tuple(logprobs), request.is_finished,
            request.finish_reason, request.stop_reason, request.num_prompt_tokens,
            request.num_output_tokens, max(0, request.num_cached_tokens),
            request.num_external_tokens, num_loaded_tokens=request.num_loaded_tokens,
            prompt_logprobs=prompt_logprobs, first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time, num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens, num_draft_steps=request.num_draft_steps)

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
        queued = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in itertools.chain(s.waiting, s.running))
        decoding = sum(1 for r in s.running if r.num_computed_tokens >= r.num_prompt_tokens)
        return EngineStats(len(s.waiting), len(s.running), len(s.remote),
                           self.kv.get_num_free_blocks(), self.kv.get_max_resource_count(),
                           s.num_preemptions, self._num_prompt_computed, self._num_generated,
                           s.num_prefix_queries, s.num_prefix_hits, self._num_steps, self._step_seconds,
                           queued, self._prefill_rate.tokens_per_s, decoding,
                           self.speculator.num_draft_tokens, self.speculator.num_accepted_tokens,
                           self.speculator.num_verified_sequences)

    def assert_no_leaks(self) -> None:
        """Every KV block is back in the pool (call when nothing is in flight)."""
        self.kv.assert_all_free()
