"""Forward pass of the Llama family (Llama 2/3, Mistral, SmolLM) and Qwen2 / Qwen3 over the
paged KV cache. Our own code: transformers only supplies the weights (by its names).

Differences between the families are flags on ModelConfig: `attention_bias` (Qwen2: q/k/v
carry a bias), `qk_norm` (Qwen3: RMSNorm over each head of q and k before RoPE),
`tie_word_embeddings` (lm_head = embed_tokens).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from pdserve import kernels
from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.config import ModelConfig
from pdserve.engine.connector import KVConnectorWorker, LayerSaveContext
from pdserve.engine.lora.slots import NO_LORA, NoLora
from pdserve.common.errors import ModelLoadError
from pdserve.engine.models.linear import Linear, can_prepack
from pdserve.kernels.quant import QuantWeight
from pdserve.engine.models.rope import RotaryEmbedding
from pdserve.kernels.fused import add_rms_norm, rms_norm, rope_store_kv


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # [(Hq + 2 Hkv) * D, hidden]: q, k, v projections stacked (+ bias)
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: Linear  # [hidden, Hq * D]
    post_norm: torch.Tensor
    gate_up: Linear  # [2 * intermediate, hidden]: gate then up
    down: Linear  # [hidden, intermediate]


class CausalLM:
    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype, quantization: str = "",
                 blocks: dict[str, QuantWeight] | None = None) -> None:
        """`blocks`: GGUF linears by transformers' name (`--quantization gguf`/`gguf-fast`/`gguf-int8dot`),
        used in place of the float32 weights of the same name."""
        self.config = config
        self.device = device
        self.dtype = dtype
        self._state, self._blocks = state, blocks or {}
        self._pack = can_prepack(device, dtype)
        self._quantization = quantization
        self.embed = self._take("model.embed_tokens.weight")
        self.norm = self._take("model.norm.weight")
        head = "model.embed_tokens.weight"
        if not config.tie_word_embeddings and "lm_head.weight" in state:
            head = "lm_head.weight"
        self.lm_head = self._linear([head])
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if config.attention_bias:
                bias = torch.cat([self._take(a + "q_proj.bias"), self._take(a + "k_proj.bias"),
                                  self._take(a + "v_proj.bias")])
            self.layers.append(LayerWeights(
                input_norm=self._take(p + "input_layernorm.weight"),
                qkv=self._linear([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"], bias),
                q_norm=self._take(a + "q_norm.weight") if config.qk_norm else None,
                k_norm=self._take(a + "k_norm.weight") if config.qk_norm else None,
                o_proj=self._linear([a + "o_proj.weight"]),
                post_norm=self._take(p + "post_attention_layernorm.weight"),
                gate_up=self._linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                # int8 everywhere but down_proj: its inputs (SiLU(gate) x up) carry the outlier
                # activations that one dynamic scale per call cannot hold (SmolLM2: perplexity
                # +141% from down_proj alone, +1 to +17% from each of the others)
                down=self._linear([p + "mlp.down_proj.weight"], int8=False),
            ))
        del self._state, self._blocks
        self.rope = RotaryEmbedding(config, device)
        self.scale = config.head_dim ** -0.5
        c = config
        self._q_size = c.num_heads * c.head_dim
        self._kv_size = c.num_kv_heads * c.head_dim

    def linears(self) -> list[Linear]:
        """Every linear one decode step runs, lm_head last."""
        return [lin for w in self.layers for lin in (w.qkv, w.o_proj, w.gate_up, w.down)] + [self.lm_head]

    def _take(self, name: str) -> torch.Tensor:
        t = self._state.get(name)
        if t is None:
            raise ModelLoadError(f"weight {name} missing from the checkpoint")
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def _linear(self, names: list[str], bias: torch.Tensor | None = None, int8: bool = True) -> Linear:
        """One projection over the weights `names`, stacked by rows: from GGUF blocks when all
        of them have blocks of one type, else float32 (prepacked, or int8 when asked)."""
        parts = [self._blocks.get(name) for name in names]
        if all(parts):
            stacked = QuantWeight.stack(parts)
            if stacked is not None:
                return Linear.from_blocks(stacked, bias, mode=self._quantization)
        weight = torch.cat([self._take(name) for name in names]) if len(names) > 1 else self._take(names[0])
        int8 = self._quantization if self._quantization == "int8" and int8 else ""
        return Linear(weight, bias, prepack=self._pack, quantize=int8)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor], connector: KVConnectorWorker,
                save_context: LayerSaveContext, between_layers: Callable[[], None] | None = None,
                lora: NoLora = NO_LORA) -> torch.Tensor:
        """input_ids, positions: [T]. Returns the final hidden states [T, hidden].
        `between_layers`, if given, runs before each layer (the engine's thread count may change there).
        `lora`: each row's LoRA update, added to every adapted linear's output (after the
        base linear, whatever its quantization, on its float output).

        Each residual add is fused with the RMSNorm after it (`add_rms_norm`), and the
        rotary embedding with the KV-cache write (`rope_store_kv`)."""
        c = self.config
        T = input_ids.shape[0]
        h = self.embed[input_ids]  # a fresh tensor: the residual stream, updated in place
        cos, sin = self.rope.cos_sin(positions, self.dtype)
        eps = c.rms_norm_eps
        delta = None  # the previous layer's MLP output, not yet added to h
        decode = None  # the decode rows' attention, checked once for every layer
        if meta.num_decode_tokens:
            decode = kernels.DecodeAttention(kv_caches[0], meta.decode_block_tables, meta.decode_context_lens,
                                             self.scale, window=meta.window)
        for i, w in enumerate(self.layers):
            if between_layers is not None:
                between_layers()
            connector.wait_for_layer_load(i)
            x = add_rms_norm(h, delta, w.input_norm, eps)
            qkv = lora.apply(i, "qkv", x, w.qkv(x))
            if w.q_norm is not None:
                qkv = self._norm_qk(qkv, w)
            q = rope_store_kv(qkv, cos, sin, kv_caches[i], meta.slot_mapping, c.num_heads, c.num_kv_heads)
            connector.save_kv_layer(i, kv_caches[i], save_context)  # its KV is final: it may leave
            attn = self._attention(q, kv_caches[i], meta, decode)
            attn = attn.reshape(T, self._q_size)
            x = add_rms_norm(h, lora.apply(i, "o_proj", attn, w.o_proj(attn)), w.post_norm, eps)
            gate, up = lora.apply(i, "gate_up", x, w.gate_up(x)).chunk(2, dim=-1)
            act = F.silu(gate) * up
            delta = lora.apply(i, "down", act, w.down(act))
        return add_rms_norm(h, delta, self.norm, eps)

    def _norm_qk(self, qkv: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        """Qwen3: RMSNorm over each head of q and k, before the rotary embedding."""
        c = self.config
        T = qkv.shape[0]
        q, k, v = qkv.split([self._q_size, self._kv_size, self._kv_size], dim=-1)
        q = rms_norm(q.reshape(T, c.num_heads, c.head_dim), w.q_norm, c.rms_norm_eps)
        k = rms_norm(k.reshape(T, c.num_kv_heads, c.head_dim), w.k_norm, c.rms_norm_eps)
        return torch.cat([q.reshape(T, -1), k.reshape(T, -1), v], dim=-1)

    def _attention(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                   decode: kernels.DecodeAttention | None) -> torch.Tensor:
        nd = meta.num_decode_tokens
        parts = []
        if nd:
            parts.append(decode(q[:nd], cache))
        if q.shape[0] > nd:
            parts.append(kernels.paged_prefill_attention(
                q[nd:], cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
                meta.prefill_context_lens, self.scale, window=meta.window))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
