// Paged decode attention on CPU, reading K/V in place through the block table.
//
// The pure-torch path has to gather every sequence's blocks into a padded batch before it
// can call a matmul: at SmolLM2's shape and batch 32 that copy is most of the attention
// time. Here each sequence's task walks its own blocks directly, so K and V are
// read once and never copied. Built on first use by `pdserve.kernels.cpu_native`.
//
// Shapes (all contiguous):
//   query        [B, H, D]               float32, already multiplied by the softmax scale
//   kv_cache     [NB, 2, BS, KVH, D]     float32 / bfloat16 / float16; [:, 0] K, [:, 1] V
//   block_tables [B, MAXB]               int32
//   context_lens [B]                     int32, 0 = padded slot (zero output)
//   returns      [B, H, D]               float32
// Head h reads KV head h / (H / KVH). With window W > 0 the query (at len - 1) sees
// positions >= len - W. Scores and softmax in float32, exactly as the torch path.

#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// e^x for x <= 0 (a score minus its row's maximum), within 2 ulp of expf: Cody-Waite range
// reduction to r in [-ln2/2, ln2/2], a degree-6 polynomial for e^r (Cephes' coefficients),
// then a multiply by 2^n built from its bits. Plain arithmetic, so the softmax loop
// vectorises (std::exp stays a scalar libm call without -ffast-math).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // e^-87 ~ 1.6e-38, still a normal float
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// scores [rows, n] -> e^(score - its row's maximum), in place; inv_total[r] = 1 / row r's sum.
inline void softmax_rows(float* scores, int64_t rows, int64_t n, float* inv_total) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * n;
    float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
    for (int64_t t = 0; t < n; ++t) top = std::max(top, s[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      s[t] = exp_nonpositive(s[t] - top);
      sum += s[t];
    }
    inv_total[r] = 1.0f / sum;
  }
}

// One task per sequence, all heads: a token's K (and V) for every KV head is one contiguous
// row, so each task streams its blocks front to back. HEAD_DIM > 0 fixes the head size at
// compile time (unrolled, register-resident loops); 0 reads it from `head_dim`.
template <typename scalar_t, int HEAD_DIM>
void decode_attention(float* out, const float* query, const scalar_t* cache, const int32_t* tables,
                      int64_t table_width, const int32_t* lens, int64_t num_seqs, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim_arg, int64_t block_size, int64_t window) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim_arg;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // one token's K (or V), all KV heads
  const int64_t half_stride = block_size * token_stride;  // K part of a block -> its V part
  const int64_t block_stride = 2 * half_stride;
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // [num_heads, n]: scores, then probabilities
    std::vector<float> row(token_stride);  // one token's K or V in float
    std::vector<float> acc(num_heads * head_dim);
    std::vector<float> inv_total(num_heads);
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t len = lens[seq];
      const float* q = query + seq * num_heads * head_dim;
      float* o = out + seq * num_heads * head_dim;
      if (len <= 0) {
        std::fill(o, o + num_heads * head_dim, 0.0f);
        continue;
      }
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const int32_t* table = tables + seq * table_width;
      scores.resize(num_heads * n);

      // scores[h, t] = q[h] . K[first + t, h / group]
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = first + t;
        const scalar_t* k = cache + table[pos / block_size] * block_stride + (pos % block_size) * token_stride;
#pragma omp simd
        for (int64_t i = 0; i < token_stride; ++i) row[i] = static_cast<float>(k[i]);
        for (int64_t h = 0; h < num_heads; ++h) {
          const float* qh = q + h * head_dim;
          const float* kh = row.data() + (h / group) * head_dim;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * kh[d];
          scores[h * n + t] = dot;
        }
      }
      softmax_rows(scores.data(), num_heads, n, inv_total.data());  // over t, per head
      // out[h] = sum_t p[h, t] V[first + t, h / group] / total[h]
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = first + t;
        const scalar_t* v = cache + table[pos / block_size] * block_stride + half_stride +
                            (pos % block_size) * token_stride;
#pragma omp simd
        for (int64_t i = 0; i < token_stride; ++i) row[i] = static_cast<float>(v[i]);
        for (int64_t h = 0; h < num_heads; ++h) {
          const float p = scores[h * n + t];
          const float* vh = row.data() + (h / group) * head_dim;
          float* a = acc.data() + h * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vh[d];
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        const float inv = inv_total[h];
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) o[h * head_dim + d] = acc[h * head_dim + d] * inv;
      }
    }
  });
}

// ---- float32 caches: a task per (sequence, KV head), K and V read straight from the cache ----
// The generic kernel above copies each token's K and V into a float row and lets the
// compiler vectorise per-head loops; at SmolLM2's shape that ran ~550 cycles a token (one
// Zen 4 thread, cache-resident). Here a task holds one KV head's G query heads: each K row
// is loaded once as NV vectors and dotted with the G queries (one horizontal sum per head
// and token), each V row loaded once and accumulated into the G outputs, in registers where
// they fit (~330 cycles a token; 8 sequences of 230 tokens: 284 -> 163 us a layer, 1 thread;
// 189 -> 84 us, 2 threads). In a decode step the KV comes from memory, not cache: there the
// layer's attention went 16.8 -> 13.1 ms at batch 8, 1 thread; asking for each row of the
// next block while the same row of this one is read (blocks lie anywhere in the cache, so
// the hardware prefetcher loses the stream at every block) took it to 10.7 ms (30 layers of
// 8 x 250 tokens, scattered blocks: 463 -> 288 us a layer). Softmax is the generic
// kernel's (`softmax_rows`); the dot products sum in another order.
namespace f32 {
using namespace pdvec;  // cpu_vectors.cpp

#if defined(PD_SIMD)
// Where one (sequence, KV head) task reads: its KV head's K rows (V rows `half` further on).
struct Task {
  const float* q;  // [G, HEAD_DIM] queries, already scaled
  float* out;      // [G, HEAD_DIM]
  const float* head;
  const int32_t* table;
  int64_t first, len, block_size, token_stride, block_stride, half;
};

// fn(t, row) for each visited token t (0-based from `first`) and its K (or V, `offset`) row
// of HEAD_DIM floats: block by block, one table read per block. The next block lies
// elsewhere in memory, so each row asks for the same row of it.
template <int HEAD_DIM, typename F>
inline void each_row(const Task& task, int64_t offset, F&& fn) {
  for (int64_t pos = task.first, t = 0; pos < task.len;) {
    const int64_t blk = pos / task.block_size, stop = std::min(task.len, (blk + 1) * task.block_size);
    const float* row = task.head + task.table[blk] * task.block_stride + offset +
                       (pos - blk * task.block_size) * task.token_stride;
    const int64_t to_next = stop < task.len ? (task.table[blk + 1] - task.table[blk]) * task.block_stride : 0;
    for (; pos < stop; ++pos, ++t, row += task.token_stride) {
      if (to_next != 0) {
        const char* ahead = reinterpret_cast<const char*>(row + to_next);
        for (int b = 0; b < HEAD_DIM * static_cast<int>(sizeof(float)); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T1);
      }
      fn(t, row);
    }
  }
}

// G query heads known at compile time: queries and output accumulators live in registers.
template <int HEAD_DIM, int G>
void task_in_registers(const Task& task, float* scores, float* inv_total) {
  constexpr int NV = HEAD_DIM / kLanes;
  const int64_t n = task.len - task.first;
  vf q[G][NV];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < NV; ++v) q[g][v] = vload(task.q + g * HEAD_DIM + v * kLanes);
  each_row<HEAD_DIM>(task, 0, [&](int64_t t, const float* k) {
    vf kv[NV];
    for (int v = 0; v < NV; ++v) kv[v] = vload(k + v * kLanes);
    for (int g = 0; g < G; ++g) {
      vf dot = vmul(q[g][0], kv[0]);
      for (int v = 1; v < NV; ++v) dot = vfma(q[g][v], kv[v], dot);
      scores[g * n + t] = vsum(dot);
    }
  });
  softmax_rows(scores, G, n, inv_total);
  vf acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < NV; ++v) acc[g][v] = vzero();
  each_row<HEAD_DIM>(task, task.half, [&](int64_t t, const float* row) {
    vf vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = vload(row + v * kLanes);
    for (int g = 0; g < G; ++g) {
      const vf p = vset(scores[g * n + t]);
      for (int v = 0; v < NV; ++v) acc[g][v] = vfma(p, vv[v], acc[g][v]);
    }
  });
  for (int g = 0; g < G; ++g) {
    const vf inv = vset(inv_total[g]);
    for (int v = 0; v < NV; ++v) vstore(task.out + g * HEAD_DIM + v * kLanes, vmul(acc[g][v], inv));
  }
}

// Any group size: output accumulators in memory (`acc`, [group, HEAD_DIM]).
template <int HEAD_DIM>
void task_any_group(const Task& task, int64_t group, float* scores, float* inv_total, float* acc) {
  constexpr int NV = HEAD_DIM / kLanes;
  const int64_t n = task.len - task.first;
  each_row<HEAD_DIM>(task, 0, [&](int64_t t, const float* k) {
    vf kv[NV];
    for (int v = 0; v < NV; ++v) kv[v] = vload(k + v * kLanes);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = task.q + g * HEAD_DIM;
      vf dot = vmul(vload(qg), kv[0]);
      for (int v = 1; v < NV; ++v) dot = vfma(vload(qg + v * kLanes), kv[v], dot);
      scores[g * n + t] = vsum(dot);
    }
  });
  softmax_rows(scores, group, n, inv_total);
  std::fill(acc, acc + group * HEAD_DIM, 0.0f);
  each_row<HEAD_DIM>(task, task.half, [&](int64_t t, const float* row) {
    vf vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = vload(row + v * kLanes);
    for (int64_t g = 0; g < group; ++g) {
      const vf p = vset(scores[g * n + t]);
      float* a = acc + g * HEAD_DIM;
      for (int v = 0; v < NV; ++v) vstore(a + v * kLanes, vfma(p, vv[v], vload(a + v * kLanes)));
    }
  });
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < HEAD_DIM; ++d) task.out[g * HEAD_DIM + d] = acc[g * HEAD_DIM + d] * inv_total[g];
}

template <int HEAD_DIM, int G>
constexpr bool fits_registers() { return G * (HEAD_DIM / kLanes) <= 16; }

template <int HEAD_DIM>
void decode_attention_f32(float* out, const float* query, const float* cache, const int32_t* tables,
                          int64_t table_width, const int32_t* lens, int64_t num_seqs, int64_t num_heads,
                          int64_t num_kv_heads, int64_t block_size, int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * HEAD_DIM;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // [group, n]: scores, then probabilities
    std::vector<float> acc(group * HEAD_DIM);
    std::vector<float> inv_total(group);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t seq = index / num_kv_heads, kv_head = index % num_kv_heads;
      const int64_t len = lens[seq];
      Task task{query + (seq * num_heads + kv_head * group) * HEAD_DIM,
                out + (seq * num_heads + kv_head * group) * HEAD_DIM, cache + kv_head * HEAD_DIM,
                tables + seq * table_width, window > 0 ? std::max<int64_t>(0, len - window) : 0, len,
                block_size, token_stride, 2 * block_size * token_stride, block_size * token_stride};
      if (len <= 0) {
        std::fill(task.out, task.out + group * HEAD_DIM, 0.0f);
        continue;
      }
      scores.resize(group * (len - task.first));
      if constexpr (fits_registers<HEAD_DIM, 4>()) {
        if (group == 4) { task_in_registers<HEAD_DIM, 4>(task, scores.data(), inv_total.data()); continue; }
        if (group == 3) { task_in_registers<HEAD_DIM, 3>(task, scores.data(), inv_total.data()); continue; }
      }
      if constexpr (fits_registers<HEAD_DIM, 2>()) {
        if (group == 2) { task_in_registers<HEAD_DIM, 2>(task, scores.data(), inv_total.data()); continue; }
        if (group == 1) { task_in_registers<HEAD_DIM, 1>(task, scores.data(), inv_total.data()); continue; }
      }
      task_any_group<HEAD_DIM>(task, group, scores.data(), inv_total.data(), acc.data());
    }
  });
}
#endif
}  // namespace f32

}  // namespace

// The Python wrapper (`kernels.attention.paged_decode_attention`) has checked shapes, dtypes
// and index ranges; these checks only guard the raw pointer arithmetic below.
at::Tensor paged_decode_attention(at::Tensor query, at::Tensor kv_cache, at::Tensor block_tables,
                                  at::Tensor context_lens, int64_t window) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(), "cpu tensors only");
  TORCH_CHECK(query.scalar_type() == at::kFloat && query.dim() == 3 && query.is_contiguous(),
              "query: contiguous float32 [B, H, D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.is_contiguous(),
              "kv_cache: contiguous [NB, 2, BS, KVH, D]");
  TORCH_CHECK(kv_cache.size(4) == query.size(2) && query.size(1) % kv_cache.size(3) == 0,
              "query and kv_cache disagree on head_dim or the GQA ratio");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous() &&
                  block_tables.size(0) == query.size(0),
              "block_tables: contiguous int32 [B, MAXB]");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.dim() == 1 && context_lens.is_contiguous() &&
                  context_lens.size(0) == query.size(0),
              "context_lens: contiguous int32 [B]");
  auto out = at::empty_like(query);
  pybind11::gil_scoped_release no_gil;  // no Python object is touched from here
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_cache.scalar_type(), "pdserve_decode_attention", [&] {
    const int64_t head_dim = query.size(2);
    auto run = [&](auto kernel) {
      kernel(out.data_ptr<float>(), query.data_ptr<float>(), kv_cache.data_ptr<scalar_t>(),
             block_tables.data_ptr<int32_t>(), block_tables.size(1), context_lens.data_ptr<int32_t>(),
             query.size(0), query.size(1), kv_cache.size(3), head_dim, kv_cache.size(2), window);
    };
#if defined(PD_SIMD)
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (head_dim == 64 || head_dim == 128) {
        auto fast = head_dim == 64 ? f32::decode_attention_f32<64> : f32::decode_attention_f32<128>;
        fast(out.data_ptr<float>(), query.data_ptr<float>(), kv_cache.data_ptr<float>(),
             block_tables.data_ptr<int32_t>(), block_tables.size(1), context_lens.data_ptr<int32_t>(),
             query.size(0), query.size(1), kv_cache.size(3), kv_cache.size(2), window);
        return;
      }
    }
#endif
    if (head_dim == 64) {
      run(decode_attention<scalar_t, 64>);
    } else if (head_dim == 128) {
      run(decode_attention<scalar_t, 128>);
    } else {
      run(decode_attention<scalar_t, 0>);
    }
  });
  return out;
}
