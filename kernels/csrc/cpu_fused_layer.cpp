// The small steps of a decoder layer around its GEMMs and attention, one call each instead of
// a dozen torch operators: with a decode batch of 8 rows a torch operator costs more to
// dispatch than to compute, and a layer used to call about 160 of them.
//
//   add_rms_norm(h, delta, weight, eps) -> normed
//       h += delta (in place, when delta is given), then normed = weight * h / rms(h), the
//       mean of squares in float32 as transformers' LlamaRMSNorm computes it.
//       h, delta [T, N] float32 contiguous; weight [N] float32.
//   rope_store_kv(qkv, cos, sin, kv_cache, slot_mapping, num_heads, num_kv_heads) -> q
//       qkv [T, (H + 2 KVH) D] float32 contiguous (q, k, v heads side by side, as the stacked
//       projection gives them); cos, sin [T, D] float32 contiguous (each half repeated, as
//       RotaryEmbedding gives them). Rotates q and k (the halves convention: out = x cos +
//       rotate_half(x) sin), writes k and v into slot slot_mapping[t] of kv_cache
//       [NB, 2, BS, KVH, D] float32 (slot -1: a padding token, not written) and returns the
//       rotated q [T, H, D].
// Built with the decode attention kernel by `pdserve.kernels.cpu_native`.

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

at::Tensor add_rms_norm(at::Tensor h, c10::optional<at::Tensor> delta, at::Tensor weight, double eps) {
  TORCH_CHECK(h.device().is_cpu() && h.scalar_type() == at::kFloat && h.dim() == 2 && h.is_contiguous(),
              "h must be a contiguous float32 [T, N] CPU tensor");
  const int64_t T = h.size(0), N = h.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.size(0) == N &&
              weight.is_contiguous(), "weight must be a contiguous float32 [N] tensor");
  const float* d = nullptr;
  if (delta.has_value()) {
    TORCH_CHECK(delta->scalar_type() == at::kFloat && delta->sizes() == h.sizes() && delta->is_contiguous(),
                "delta must be a contiguous float32 tensor shaped like h");
    d = delta->data_ptr<float>();
  }
  at::Tensor out = at::empty_like(h);
  float* x_all = h.data_ptr<float>();
  float* y_all = out.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* x = x_all + t * N;
      float* y = y_all + t * N;
      if (d != nullptr) {
        const float* dt = d + t * N;
        for (int64_t n = 0; n < N; ++n) x[n] += dt[n];
      }
      float sum = 0.0f;
      for (int64_t n = 0; n < N; ++n) sum += x[n] * x[n];
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(N) + feps);
      for (int64_t n = 0; n < N; ++n) y[n] = w[n] * (x[n] * inv);
    }
  });
  return out;
}

namespace {

// out[d] = x[d] cos[d] + rotate_half(x)[d] sin[d], rotate_half(x) = (-x[half:], x[:half])
inline void rotate(const float* x, const float* c, const float* s, float* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * c[i] - x[i + half] * s[i];
  for (int64_t i = half; i < D; ++i) out[i] = x[i] * c[i] + x[i - half] * s[i];
}

}  // namespace

at::Tensor rope_store_kv(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor kv_cache,
                         at::Tensor slot_mapping, int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat && qkv.dim() == 2 && qkv.is_contiguous(),
              "qkv must be a contiguous float32 [T, (H + 2 KVH) D] CPU tensor");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat && kv_cache.dim() == 5 && kv_cache.size(1) == 2 &&
              kv_cache.is_contiguous() && kv_cache.size(3) == num_kv_heads,
              "kv_cache must be a contiguous float32 [NB, 2, BS, KVH, D] tensor");
  const int64_t T = qkv.size(0), D = kv_cache.size(4), BS = kv_cache.size(2), NB = kv_cache.size(0);
  const int64_t H = num_heads, KVH = num_kv_heads, width = (H + 2 * KVH) * D;
  TORCH_CHECK(qkv.size(1) == width && D % 2 == 0, "qkv is not (num_heads + 2 num_kv_heads) x head_dim wide");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == T && cos.size(1) == D &&
              sin.sizes() == cos.sizes(), "cos and sin must be contiguous float32 [T, head_dim]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == T &&
              slot_mapping.is_contiguous(), "slot_mapping must be a contiguous int64 [T] tensor");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < NB * BS, "slot_mapping holds slots outside [-1, ", NB * BS, ")");
  }
  at::Tensor q = at::empty({T, H, D}, qkv.options());
  const float* in = qkv.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  float* q_out = q.data_ptr<float>();
  float* cache = kv_cache.data_ptr<float>();
  const int64_t row = KVH * D;  // one token's K (or V) in a block
  at::parallel_for(0, T, 32,  // a decode batch is a few microseconds of work: no threads to wake
                   [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* x = in + t * width;
      const float* c = cs + t * D;
      const float* s = sn + t * D;
      for (int64_t h = 0; h < H; ++h) rotate(x + h * D, c, s, q_out + (t * H + h) * D, D);
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      float* k_dst = cache + ((slot / BS) * 2 * BS + slot % BS) * row;  // [block, 0, offset]
      float* v_dst = k_dst + BS * row;                                    // [block, 1, offset]
      for (int64_t h = 0; h < KVH; ++h) rotate(x + (H + h) * D, c, s, k_dst + h * D, D);
      std::memcpy(v_dst, x + (H + KVH) * D, sizeof(float) * row);
    }
  });
  return q;
}
