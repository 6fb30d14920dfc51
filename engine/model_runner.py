"""Turns a scheduled step into tensors, runs the model over the paged cache, returns logits."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.connector import KVConnectorWorker, LayerSaveContext
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.models.llama import CausalLM
from pdserve.engine.request import TokenLogprob
from pdserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from pdserve.kernels import cpu_native

log = logging.getLogger(__name__)


PROMPT_LOGPROB_ROWS = 256  # prompt positions whose full-vocabulary logits exist at once


@dataclass(frozen=True, slots=True)
class StepResult:
    # chunks whose last token's logits are below, in order; a decoding chunk of several rows
    # has one row per position it computed, consecutive
    sampling_chunks: list[ScheduledChunk]
    logits: torch.Tensor  # [sum of the sampling chunks' rows, vocab] fp32
    # chunks of requests that want prompt logprobs: (chunk, entries for positions chunk.start..)
    prompt_logprobs: list[tuple[ScheduledChunk, list[TokenLogprob]]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCacheManager, connector: KVConnectorWorker, loras=None) -> None:
        """`loras`: the engine's adapters (engine.lora), whose slots the step's rows read."""
        from pdserve.engine.lora import NO_LORAS

        self.loras = loras or NO_LORAS
        self.model = model
        self.kv = kv
        self.connector = connector
        self.device = model.device
        self.block_size = kv.block_size
        if self.device.type == "cpu":
            # builds (first start on a machine) or loads the native kernel now, not mid-request
            log.info("decode attention on CPU: %s path", cpu_native.backend_name())

    def execute(self, step: SchedulerOutput, between_layers: Callable[[], None] | None = None) -> StepResult:
        """`between_layers`: run before each layer of the forward (CausalLM.forward)."""
        # decodes first, then prefill chunks (AttentionMetadata's packing order); within each,
        # rows of one adapter slot are next to each other (one run per slot for the LoRA update)
        chunks = sorted(step.chunks, key=lambda c: (c.num_new_tokens > 1, c.request.lora_slot))
        input_ids, positions, slots, lora_slots = [], [], [], []
        logit_rows: list[int] = []
        sampling: list[ScheduledChunk] = []
        prompt_rows: list[tuple[ScheduledChunk, int]] = []  # (chunk, its first row)
        dec_tables, dec_lens, pre_tables, pre_lens, pre_starts = [], [], [], [], [0]
        num_decodes = 0
        for chunk in chunks:
            req = chunk.request
            block_ids = self.kv.blocks_of(req.request_id)
            end = chunk.start + chunk.num_new_tokens
            if req.needs_prompt_logprobs and chunk.start < req.num_prompt_tokens - 1:
                prompt_rows.append((chunk, len(input_ids)))
            first_row = len(input_ids)
            input_ids += chunk.token_ids
            lora_slots += [req.lora_slot] * chunk.num_rows
            for pos in range(chunk.start, chunk.start + chunk.num_rows):
                positions.append(pos)
                slots.append(block_ids[pos // self.block_size] * self.block_size + pos % self.block_size)
            if chunk.num_new_tokens == 1:
                # each of a decoding chunk's rows is one decode row that attends to the
                # positions up to its own (their KV is written before attention reads)
                num_decodes += chunk.num_rows
                dec_tables += [block_ids] * chunk.num_rows
                dec_lens += range(end, end + chunk.num_rows)
                if chunk.num_rows > 1:
                    logit_rows += range(first_row, first_row + chunk.num_rows - 1)
            else:
                pre_tables.append(block_ids)
                pre_lens.append(end)
                pre_starts.append(pre_starts[-1] + chunk.num_new_tokens)
            if chunk.samples_token:
                logit_rows.append(len(input_ids) - 1)
                sampling.append(chunk)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            num_decode_tokens=num_decodes,
            decode_block_tables=self._table(dec_tables),
            decode_context_lens=self._tensor(dec_lens, torch.int32),
            prefill_block_tables=self._table(pre_tables),
            prefill_query_start_loc=self._tensor(pre_starts, torch.int32),
            prefill_context_lens=self._tensor(pre_lens, torch.int32),
            window=self.kv.config.attention_window,
        )
        save_ctx = LayerSaveContext(
            {c.request.request_id: tuple(self.kv.blocks_of(c.request.request_id)) for c in chunks},
            {c.request.request_id: c.start + c.num_new_tokens for c in chunks})
        self.connector.start_load_kv(step.connector_meta)
        hidden = self.model.forward(self._tensor(input_ids, torch.int64),
                                    self._tensor(positions, torch.int64), meta,
                                    self.kv.kv_caches, self.connector, save_ctx, between_layers,
                                    self.loras.batch(lora_slots))
        self.connector.wait_for_save()
        if logit_rows:
            logits = self.model.compute_logits(hidden[self._tensor(logit_rows, torch.int64)])
        else:
            logits = torch.empty(0, self.model.config.vocab_size, device=self.device)
        return StepResult(sampling, logits, [(c, self._prompt_logprobs(hidden, c, row)) for c, row in prompt_rows])

    def _prompt_logprobs(self, hidden: torch.Tensor, chunk: ScheduledChunk, first_row: int) -> list[TokenLogprob]:
        """The logprob of each prompt token this chunk's positions predict (position p gives
        token p + 1's), with the request's top alternatives; the logits of at most
        PROMPT_LOGPROB_ROWS positions exist at a time."""
        req = chunk.request
        top_n = req.sampling_params.prompt_logprobs
        stop = min(chunk.start + chunk.num_new_tokens, req.num_prompt_tokens - 1)
        out: list[TokenLogprob] = []
        for lo in range(chunk.start, stop, PROMPT_LOGPROB_ROWS):
            hi = min(lo + PROMPT_LOGPROB_ROWS, stop)
            rows = hidden[first_row + lo - chunk.start: first_row + hi - chunk.start]
            logprobs = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
            targets = req.prompt_token_ids[lo + 1: hi + 1]
            chosen = logprobs.gather(1, self._tensor(targets, torch.int64)[:, None])[:, 0].tolist()
            if top_n:
                values, ids = torch.topk(logprobs, top_n)
                tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
            else:
                tops = [()] * len(targets)
            out += [TokenLogprob(t, lp, top) for t, lp, top in zip(targets, chosen, tops)]
        return out

    def _tensor(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _table(self, tables: list[list[int]]) -> torch.Tensor:
        width = max((len(t) for t in tables), default=0)
        out = torch.zeros(len(tables), max(width, 1), dtype=torch.int32)
        for i, t in enumerate(tables):
            out[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        return out.to(self.device)
