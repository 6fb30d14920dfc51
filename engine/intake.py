"""A request's way in: what a caller sends (a prompt, sampling params, a tenant salt, tokens
generated elsewhere) checked and turned into a `Request` with its block keys, grammar
matcher, random generator and detokenizer. Typed errors name what is wrong; nothing is
queued here."""
from __future__ import annotations

from typing import Sequence

import torch

from pdserve.common.block_hash import PromptBlocks, chain_blocks, chain_root, check_cache_salt, prompt_blocks
from pdserve.common.errors import InvalidRequestError
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.constraints import GrammarCompiler
from pdserve.engine.detokenizer import Detokenizer
from pdserve.engine.request import Request, check_prompt, check_resumed
from pdserve.engine.sampling_params import SamplingParams


class Intake:
    """Builds requests for one engine (its tokenizer, context length, cache keys). Reads only
    fixed state, except the shared generator of unseeded requests (engine thread)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, tokenizer, max_model_len: int,
                 block_size: int, compat_hash: str, device: torch.device, loras=None) -> None:
        """`loras`: the engine's adapters (engine.lora.LoraManager, or NO_LORAS)."""
        from pdserve.engine.lora import NO_LORAS

        self.loras = loras or NO_LORAS
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.compat_hash = compat_hash
        self.device = device
        self.grammars = GrammarCompiler(tokenizer, model_config.vocab_size, model_config.eos_token_ids)
        self._generator = torch.Generator(device=device).manual_seed(config.seed)

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return [int(t) for t in prompt]

    def prompt_blocks(self, token_ids: Sequence[int], cache_salt: str = "",
                      lora_name: str | None = None) -> PromptBlocks:
        """The keys and digests of a prompt's full blocks in this engine's cache (its block
        size, compatibility hash and block-hash key; the adapter's digest under `lora_name`).
        Any thread; LoraNotFoundError for an adapter it does not hold."""
        lora_key = "" if lora_name is None else self.loras.digest_of(lora_name)
        return prompt_blocks(token_ids, self.block_size, self.compat_hash, self.config.block_hash_key, cache_salt,
                             lora_key)

    def extend_blocks(self, request: Request, num_blocks: int) -> None:
        """Extend `request`'s block keys and digests to its first `num_blocks` full blocks:
        blocks past the prompt hold generated tokens and chain on from the prompt's, exactly
        as a later prompt that repeats them (history + answer) is keyed. A request whose keys
        and digests disagree in number (hand-built) is left as it is."""
        have = len(request.block_hashes)
        if num_blocks <= have or len(request.block_digests) != have:
            return
        parent = request.block_digests[-1] if have else chain_root(
            self.compat_hash, self.config.block_hash_key, request.cache_salt,
            "" if request.lora_name is None else self.loras.digest_of(request.lora_name))
        tokens = request.token_ids(have * self.block_size, num_blocks * self.block_size)
        more = chain_blocks(parent, tokens, self.block_size, self.config.block_hash_key)
        request.block_hashes.extend(more.hashes)
        request.block_digests.extend(more.digests)

    def request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, *,
                remote_prefill: bool, transfer_params: object | None, resumed: Sequence[int],
                cache_salt: str, stream_layers: bool, blocks: PromptBlocks | None,
                lora_name: str | None = None) -> tuple[Request, Detokenizer]:
        """A checked request (max_tokens resolved to fit the context) and its detokenizer,
        both in the state `resumed` tokens left them (see `LLMEngine.add_request`)."""
        ids = self.tokenize(prompt)
        params = check_prompt(ids, params, self.model_config.vocab_size, self.max_model_len)
        check_cache_salt(cache_salt)
        resumed = check_resumed(resumed, params, self.model_config.vocab_size)
        request = Request(request_id, ids, params, eos_token_ids=self.model_config.eos_token_ids,
                          transfer_params=transfer_params, remote_prefill=remote_prefill,
                          stream_layers=stream_layers, lora_name=lora_name)
        blocks = blocks or self.prompt_blocks(ids, cache_salt, lora_name)
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
        return request, detok
