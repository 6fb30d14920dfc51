// Integer-dot linears over a GGUF file's blocks (`--quantization gguf-int8dot`): the weights
// stay 4- or 8-bit integers, the activations are quantized once per call to 8 bits per block
// of 32, each block's dot product is an integer sum, and the two block scales are applied
// once per block.
//
//   quantize_activations(x, bits, isa) -> (q, scales, sums)
//       x [M, K] float32 contiguous, K a multiple of 32. Per block of 32, with L = 127 (bits 8)
//       or 32767 (bits 16): d = max|x| / L, q = round(x / d) in [-L, L] (all zero where the
//       block is), sums = sum(q) (an integer, held exactly in float32). q [M, K] int8 or int16,
//       scales and sums [M, K / 32] float32. `kernels.int8_dot.ACTIVATION_BITS` says which
//       block types take 16 bits.
//   int8dot_linear(q, scales, sums, blocks, qtype, bias, isa) -> y [M, N] float32
//       blocks [N, K / 32 * block_bytes] uint8 as in `cpu_quant_gemm.cpp` (Q4_0 = 2, Q4_1 = 3,
//       Q8_0 = 8); isa: 0 scalar, 1 AVX2, 2 AVX-VNNI (256-bit), 3 AVX-512 VNNI (512-bit).
//       8-bit activations multiply through vpmaddubsw / vpdpbusd, 16-bit ones through
//       vpmaddwd / vpdpwssd.
//   supported_isas() -> the isa codes this CPU runs, lowest first.
//
// One build holds every path: the file is compiled for the baseline x86-64, and each vector
// path is the same tiles (`int8_dot_tiles.h`) compiled in its own target region; the caller
// picks one at run time from what the CPU reports (`kernels.int8_dot`).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512Vnni = 3 };

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
    default: TORCH_CHECK(false, "unsupported GGML block type ", qtype, " (2 = Q4_0, 3 = Q4_1, 8 = Q8_0)");
  }
}

// Quantized activations: rows x nblocks blocks, row-major [rows, nblocks * 32]: 8-bit in q,
// or 16-bit in q16, the other one null.
struct Acts {
  const int8_t* q;
  const int16_t* q16;
  const float* scales;  // d_x per block
  const float* sums;    // sum(q) per block
  int64_t rows, nblocks;
};

// ---- scalar path: plain C, the reference every vector path is tested against -----------
namespace scalar {

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

template <int64_t QT, typename X>
inline int32_t block_sum(const uint8_t* blk, const X* x) {
  int32_t s = 0;
  if constexpr (QT == kQ8_0) {
    const int8_t* w = reinterpret_cast<const int8_t*>(blk + 2);
    for (int j = 0; j < 32; ++j) s += static_cast<int32_t>(w[j]) * x[j];
  } else {
    const uint8_t* qs = blk + (QT == kQ4_1 ? 4 : 2);
    const int32_t zero = QT == kQ4_1 ? 0 : 8;
    for (int j = 0; j < 16; ++j) {
      s += (static_cast<int32_t>(qs[j] & 15) - zero) * x[j];
      s += (static_cast<int32_t>(qs[j] >> 4) - zero) * x[j + 16];
    }
  }
  return s;
}

template <int64_t QT>
void gemv(const Acts& a, const uint8_t* blocks, float* y, int64_t N) {
  const int64_t bb = block_bytes(QT), row_bytes = a.nblocks * bb;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m = 0; m < a.rows; ++m) {
        float acc = 0.0f;
        for (int64_t b = 0; b < a.nblocks; ++b) {
          const uint8_t* blk = blocks + n * row_bytes + b * bb;
          const int64_t row = m * a.nblocks + b;
          const int32_t sum = a.q16 != nullptr ? block_sum<QT>(blk, a.q16 + row * kBlock)
                                               : block_sum<QT>(blk, a.q + row * kBlock);
          acc += half_at(blk) * a.scales[row] * static_cast<float>(sum);
          if constexpr (QT == kQ4_1) acc += half_at(blk + 2) * (a.scales[row] * a.sums[row]);
        }
        y[m * N + n] = acc;
      }
  });
}

// Block i of x (x[i * 32, (i + 1) * 32)) into q at the same place, its scale and sum at i.
template <typename T>
void quantize_blocks(const float* xp, T* qp, float* dp, float* sp, int64_t count, float levels) {
  at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xb = xp + i * kBlock;
      float amax = 0.0f;
      for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float inv = amax > 0.0f ? levels / amax : 0.0f;
      int32_t sum = 0;
      for (int j = 0; j < kBlock; ++j) {
        const int32_t c = static_cast<int32_t>(std::min(levels, std::max(-levels, std::nearbyint(xb[j] * inv))));
        qp[i * kBlock + j] = static_cast<T>(c);
        sum += c;
      }
      dp[i] = amax / levels;
      sp[i] = static_cast<float>(sum);
    }
  });
}

}  // namespace scalar

#if defined(__x86_64__)
// ---- AVX2: vpmaddubsw (pairs into 16 bits) then vpmaddwd against ones --------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#include "int8_dot_tiles.h"
}  // namespace avx2
#pragma GCC pop_options

// ---- AVX-VNNI: vpdpbusd, VEX-encoded (Alder Lake and later cores without AVX-512) -------
#pragma GCC push_options
#pragma GCC target("avxvnni,avx2,fma,f16c")
namespace avxvnni {
inline __m256i dot_u8s8(__m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s); }
#include "int8_dot_tiles.h"
}  // namespace avxvnni
#pragma GCC pop_options

// ---- AVX-512 VNNI: vpdpbusd on 512-bit vectors, two blocks each ---------------------------
#pragma GCC push_options
#pragma GCC target("avx512vnni,avx512vl,avx512bw,avx512f,avx2,fma,f16c")
namespace avx512vnni {
inline __m256i dot_u8s8(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
template <int64_t QT, int NR, int MR>
void tile_dot512(const uint8_t* w0, int64_t row_bytes, const Acts& a, int64_t m0, float* y, int64_t ldy);
template <int64_t QT, int NR, int MR>
void tile16_dot512(const uint8_t* w0, int64_t row_bytes, const Acts& a, int64_t m0, float* y, int64_t ldy);
#define PD_WIDE_TILE tile_dot512
#define PD_WIDE_TILE16 tile16_dot512
#include "int8_dot_tiles.h"
#undef PD_WIDE_TILE
#undef PD_WIDE_TILE16

// 16-bit activations, one block per 512-bit vector: its 32 weights widened to 16 bits,
// vpdpwssd sums pairs of products into 16 int32 lanes.
template <int64_t QT, int NR, int MR>
void tile16_dot512(const uint8_t* w0, int64_t row_bytes, const Acts& a, int64_t m0, float* y, int64_t ldy) {
  constexpr int64_t bb = QT == kQ4_0 ? 18 : QT == kQ4_1 ? 20 : 34;
  __m512 acc[NR][MR];
  float offset[NR][MR];  // Q4_1: sum over blocks of m_w * d_x * sum(qx)
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < MR; ++r) acc[j][r] = _mm512_setzero_ps(), offset[j][r] = 0.0f;
  for (int64_t b = 0; b < a.nblocks; ++b) {
    __m512i w[NR];
    float dw[NR], mw[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const uint8_t* blk = w0 + j * row_bytes + b * bb;
      w[j] = _mm512_cvtepi8_epi16(block_weights<QT>(blk));
      dw[j] = half_at(blk);
      mw[j] = QT == kQ4_1 ? half_at(blk + 2) : 0.0f;
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const int64_t row = (m0 + r) * a.nblocks + b;
      const __m512i x = _mm512_loadu_si512(a.q16 + row * kBlock);
      const float dx = a.scales[row];
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        const __m512 sums = _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(_mm512_setzero_si512(), w[j], x));
        acc[j][r] = _mm512_fmadd_ps(sums, _mm512_set1_ps(dw[j] * dx), acc[j][r]);
        if constexpr (QT == kQ4_1) offset[j][r] += mw[j] * (dx * a.sums[row]);
      }
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < MR; ++r) y[r * ldy + j] = _mm512_reduce_add_ps(acc[j][r]) + offset[j][r];
}

// Lanes 0-7 v0, lanes 8-15 v1: one scale per block of a block pair.
inline __m512 pair(__m128 two) {
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                               _mm512_castps128_ps512(two));
}

// The tiles of int8_dot_tiles.h with blocks b and b + 1 in one vector: lanes 0-7 hold block
// b's sums and scale, lanes 8-15 block b + 1's (the activations of both are adjacent). An
// odd last block runs through the 256-bit blocks_dot. AVX-512 has no vpsignb: the signed
// weights' activations are negated under the mask of the negative weights instead.
template <int64_t QT, int NR, int MR>
void tile_dot512(const uint8_t* w0, int64_t row_bytes, const Acts& a, int64_t m0, float* y, int64_t ldy) {
  constexpr int64_t bb = QT == kQ4_0 ? 18 : QT == kQ4_1 ? 20 : 34;
  __m512 acc[NR][MR];
  __m256 tail[NR][MR];
  float offset[NR][MR];  // Q4_1: sum over blocks of m_w * d_x * sum(qx)
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < MR; ++r) acc[j][r] = _mm512_setzero_ps(), tail[j][r] = _mm256_setzero_ps(), offset[j][r] = 0.0f;
  const int64_t pairs = a.nblocks / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t b = 2 * p;
    __m512i u[NR];
    __mmask64 neg[NR];
    __m512 dw[NR];
    float mw0[NR], mw1[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const uint8_t* blk = w0 + j * row_bytes + b * bb;
      const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(block_weights<QT>(blk)), block_weights<QT>(blk + bb), 1);
      if constexpr (QT == kQ4_1) {
        u[j] = w;
        mw0[j] = half_at(blk + 2), mw1[j] = half_at(blk + bb + 2);
      } else {
        u[j] = _mm512_abs_epi8(w);
        neg[j] = _mm512_movepi8_mask(w);
      }
      dw[j] = pair(_mm_unpacklo_ps(_mm_set_ss(half_at(blk)), _mm_set_ss(half_at(blk + bb))));
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const int64_t row = (m0 + r) * a.nblocks + b;
      const __m512i x = _mm512_loadu_si512(a.q + row * kBlock);
      const __m512 dx = pair(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(a.scales + row))));
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        const __m512i s = QT == kQ4_1 ? x : _mm512_mask_sub_epi8(x, neg[j], _mm512_setzero_si512(), x);
        const __m512 sums = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u[j], s));
        acc[j][r] = _mm512_fmadd_ps(sums, _mm512_mul_ps(dw[j], dx), acc[j][r]);
        if constexpr (QT == kQ4_1)
          offset[j][r] += mw0[j] * (a.scales[row] * a.sums[row]) + mw1[j] * (a.scales[row + 1] * a.sums[row + 1]);
      }
    }
  }
  if (a.nblocks % 2) blocks_dot<QT, NR, MR>(w0, row_bytes, a, m0, a.nblocks - 1, tail, offset);
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < MR; ++r) y[r * ldy + j] = _mm512_reduce_add_ps(acc[j][r]) + hsum(tail[j][r]) + offset[j][r];
}

// ---- decode-sized calls over row-interleaved 4-bit weights (pack_rows) --------------------
// A group of 16 weight rows, block b: 16 scales d (float16), for Q4_1 16 minima m, then 256
// bytes: 4-byte chunk c (c < 4) of row l at offset 64 c + 4 l, the chunk being bytes 4c..4c+3
// of the row's GGUF nibbles (low nibbles weights 4c.., high nibbles 16 + 4c..). So vector c
// holds one chunk of every row, each int32 lane one row: vpdpbusd against the activations'
// 4 bytes broadcast to every lane leaves each row's block sum in its own lane, and the
// scales apply 16 rows at a time with no horizontal sums.
template <int64_t QT, int MR>
void packed_group(const uint8_t* p, int64_t nb, const Acts& a, int64_t m0, float* y, int64_t ldy, int lanes) {
  constexpr int64_t scale_bytes = QT == kQ4_1 ? 64 : 32, step = scale_bytes + 256;
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, p += step) {
    _mm_prefetch(reinterpret_cast<const char*>(p + 4 * step), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + 4 * step + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + 4 * step + 128), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + 4 * step + 192), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + 4 * step + 256), _MM_HINT_T0);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    __m512i lo[4], hi[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512i raw = _mm512_loadu_si512(p + scale_bytes + 64 * c);
      lo[c] = _mm512_and_si512(raw, low);
      hi[c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const int64_t row = (m0 + r) * a.nblocks + b;
      const int8_t* x = a.q + row * kBlock;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        int32_t xl, xh;
        std::memcpy(&xl, x + 4 * c, 4);
        std::memcpy(&xh, x + 16 + 4 * c, 4);
        s0 = _mm512_dpbusd_epi32(s0, lo[c], _mm512_set1_epi32(xl));
        s1 = _mm512_dpbusd_epi32(s1, hi[c], _mm512_set1_epi32(xh));
      }
      const float dx = a.scales[row];
      __m512i sum = _mm512_add_epi32(s0, s1);
      if constexpr (QT == kQ4_0)  // its nibbles are q + 8: sum((q + 8) qx) - 8 sum(qx), exact in int32
        sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(8 * static_cast<int32_t>(a.sums[row])));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[r]);
      if constexpr (QT == kQ4_1) {  // + m_w * d_x * sum(qx)
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(dx * a.sums[row]), acc[r]);
      }
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << lanes) - 1u);
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}

// Q8_0 against 16-bit activations: block b of a group is 16 scales d (float16), then 16
// chunks of 32 bytes, chunk c holding bytes 2c, 2c + 1 of every row (row l at 32 c + 2 l):
// widened to 16 bits, each int32 lane one row's pair, vpdpwssd against the activations' pair
// broadcast (at most 32 * 128 * 32767 a block: no overflow).
template <int MR>
void packed_group16(const uint8_t* p, int64_t nb, const Acts& a, int64_t m0, float* y, int64_t ldy, int lanes) {
  constexpr int64_t step = 32 + 512;
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, p += step) {
    for (int64_t off = 0; off < step; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p + 2 * step + off), _MM_HINT_T0);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    __m512i s[MR][2];
    for (int r = 0; r < MR; ++r) s[r][0] = s[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int c = 0; c < 16; ++c) {
      const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 + 32 * c)));
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        std::memcpy(&pair, a.q16 + ((m0 + r) * a.nblocks + b) * kBlock + 2 * c, 4);
        s[r][c & 1] = _mm512_dpwssd_epi32(s[r][c & 1], w, _mm512_set1_epi32(pair));
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const float dx = a.scales[(m0 + r) * a.nblocks + b];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s[r][0], s[r][1])),
                               _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[r]);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << lanes) - 1u);
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}

template <int64_t QT, int MR>
inline void packed_tile(const uint8_t* p, int64_t nb, const Acts& a, int64_t m0, float* y, int64_t ldy, int lanes) {
  if constexpr (QT == kQ8_0) {
    packed_group16<MR>(p, nb, a, m0, y, ldy, lanes);
  } else {
    packed_group<QT, MR>(p, nb, a, m0, y, ldy, lanes);
  }
}

}  // namespace avx512vnni
#pragma GCC pop_options
#endif

bool cpu_has(int64_t isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  switch (isa) {
    case kScalar: return true;
    case kAvx2: return avx2;
    case kAvxVnni: return avx2 && __builtin_cpu_supports("avxvnni");
    case kAvx512Vnni:
      return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    default: return false;
  }
#else
  return isa == kScalar;
#endif
}

template <typename F>
void by_type(int64_t qtype, F&& f) {
  switch (qtype) {
    case kQ4_0: f(std::integral_constant<int64_t, kQ4_0>{}); break;
    case kQ4_1: f(std::integral_constant<int64_t, kQ4_1>{}); break;
    case kQ8_0: f(std::integral_constant<int64_t, kQ8_0>{}); break;
    default: block_bytes(qtype);  // raises
  }
}

void run(int64_t isa, int64_t qtype, const Acts& a, const uint8_t* blocks, float* y, int64_t N) {
  by_type(qtype, [&](auto qt) {
    constexpr int64_t QT = decltype(qt)::value;
    switch (isa) {
#if defined(__x86_64__)
      case kAvx2: return avx2::gemv<QT>(a, blocks, y, N);
      case kAvxVnni: return avxvnni::gemv<QT>(a, blocks, y, N);
      case kAvx512Vnni: return avx512vnni::gemv<QT>(a, blocks, y, N);
#endif
      default: return scalar::gemv<QT>(a, blocks, y, N);
    }
  });
}

// y [M, N] from the packed groups: the groups split evenly over the threads, each group
// against the activation rows four at a time; Tile<MR>::run is one ISA's group kernel.
template <int64_t QT, template <int> class Tile>
void packed_gemv(const Acts& a, const uint8_t* packed, float* y, int64_t N) {
  const int64_t groups = (N + 15) / 16, group_bytes = a.nblocks * (QT == kQ8_0 ? 544 : QT == kQ4_1 ? 320 : 288);
  at::parallel_for(0, groups, 2, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int lanes = static_cast<int>(std::min<int64_t>(16, N - 16 * g));
      const uint8_t* p = packed + g * group_bytes;
      float* out = y + 16 * g;
      int64_t m = 0;
      for (; m + 4 <= a.rows; m += 4) Tile<4>::run(p, a.nblocks, a, m, out + m * N, N, lanes);
      switch (a.rows - m) {
        case 3: Tile<3>::run(p, a.nblocks, a, m, out + m * N, N, lanes); break;
        case 2: Tile<2>::run(p, a.nblocks, a, m, out + m * N, N, lanes); break;
        case 1: Tile<1>::run(p, a.nblocks, a, m, out + m * N, N, lanes); break;
        default: break;
      }
    }
  });
}

#if defined(__x86_64__)
template <int64_t QT>
struct Packed512 {
  template <int MR>
  struct T {
    static void run(const uint8_t* p, int64_t nb, const Acts& a, int64_t m0, float* y, int64_t ldy, int lanes) {
      avx512vnni::packed_tile<QT, MR>(p, nb, a, m0, y, ldy, lanes);
    }
  };
};
#define PD_PACKED256(NS)                                                                                   \
  template <int64_t QT>                                                                                    \
  struct Packed_##NS {                                                                                     \
    template <int MR>                                                                                      \
    struct T {                                                                                             \
      static void run(const uint8_t* p, int64_t nb, const Acts& a, int64_t m0, float* y, int64_t ldy, int lanes) { \
        NS::packed_group256<QT, MR>(p, nb, a, m0, y, ldy, lanes);                                          \
      }                                                                                                    \
    };                                                                                                     \
  };
PD_PACKED256(avx2)
PD_PACKED256(avxvnni)
#undef PD_PACKED256

void run_packed(int64_t isa, int64_t qtype, const Acts& a, const uint8_t* packed, float* y, int64_t N) {
  by_type(qtype, [&](auto qt) {
    constexpr int64_t QT = decltype(qt)::value;
    switch (isa) {
      case kAvx2: return packed_gemv<QT, Packed_avx2<QT>::template T>(a, packed, y, N);
      case kAvxVnni: return packed_gemv<QT, Packed_avxvnni<QT>::template T>(a, packed, y, N);
      case kAvx512Vnni: return packed_gemv<QT, Packed512<QT>::template T>(a, packed, y, N);
      default: TORCH_CHECK(false, "packed weights run on the vector paths (AVX2 and up), not path ", isa);
    }
  });
}
#endif

}  // namespace

std::vector<int64_t> supported_isas() {
  std::vector<int64_t> out;
  for (int64_t isa : {kScalar, kAvx2, kAvxVnni, kAvx512Vnni})
    if (cpu_has(isa)) out.push_back(isa);
  return out;
}


std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations(at::Tensor x, int64_t bits, int64_t isa) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() &&
                  x.size(1) % kBlock == 0, "x must be a contiguous float32 [M, K] CPU tensor, K a multiple of 32");
  TORCH_CHECK(bits == 8 || bits == 16, "activations are quantized to 8 or 16 bits, not ", bits);
  TORCH_CHECK(cpu_has(isa), "instruction-set path ", isa, " is not one this CPU runs (supported_isas())");
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  at::Tensor q = at::empty({M, K}, bits == 8 ? at::kChar : at::kShort), scales = at::empty({M, nb}, at::kFloat),
             sums = at::empty({M, nb}, at::kFloat);
  pybind11::gil_scoped_release no_gil;
  // every vector path quantizes with AVX2 (the same q as the scalar path: tests check it)
  auto run = [&](auto quantize) {
    if (bits == 8) {
      quantize(x.data_ptr<float>(), q.data_ptr<int8_t>(), scales.data_ptr<float>(), sums.data_ptr<float>(), M * nb,
               127.0f);
    } else {
      quantize(x.data_ptr<float>(), q.data_ptr<int16_t>(), scales.data_ptr<float>(), sums.data_ptr<float>(), M * nb,
               32767.0f);
    }
  };
#if defined(__x86_64__)
  if (isa != kScalar) {
    run([](auto... args) { avx2::quantize_blocks(args...); });
    return {q, scales, sums};
  }
#endif
  run([](auto... args) { scalar::quantize_blocks(args...); });
  return {q, scales, sums};
}

at::Tensor int8dot_linear(at::Tensor q, at::Tensor scales, at::Tensor sums, at::Tensor blocks, int64_t qtype,
                          c10::optional<at::Tensor> bias, int64_t isa) {
  const int64_t bb = block_bytes(qtype);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous() && blocks.size(1) % bb == 0,
              "blocks must be a contiguous uint8 [N, whole blocks of ", bb, " bytes] CPU tensor");
  const int64_t N = blocks.size(0), nb = blocks.size(1) / bb, K = nb * kBlock;
  const bool wide = q.scalar_type() == at::kShort;
  TORCH_CHECK((q.scalar_type() == at::kChar || wide) && q.dim() == 2 && q.is_contiguous() && q.size(1) == K,
              "q must be a contiguous int8 or int16 [M, ", K, "] tensor");
  const int64_t M = q.size(0);
  for (const at::Tensor* t : {&scales, &sums})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->is_contiguous() && t->size(0) == M &&
                    t->size(1) == nb, "scales and sums must be contiguous float32 [", M, ", ", nb, "] tensors");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N),
              "bias: float32 [N]");
  TORCH_CHECK(cpu_has(isa), "instruction-set path ", isa, " is not one this CPU runs (supported_isas())");
  const Acts acts{wide ? nullptr : q.data_ptr<int8_t>(), wide ? q.data_ptr<int16_t>() : nullptr,
                  scales.data_ptr<float>(), sums.data_ptr<float>(), M, nb};
  pybind11::gil_scoped_release no_gil;
  at::Tensor y = at::empty({M, N}, at::kFloat);
  run(isa, qtype, acts, blocks.data_ptr<uint8_t>(), y.data_ptr<float>(), N);
  if (bias.has_value()) y.add_(*bias);
  return y;
}

// ---- packed weights for decode-sized calls on the vector paths (packed_gemv) -------------
int64_t packed_step(int64_t qtype) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0,
              "only Q4_0, Q4_1 and Q8_0 blocks pack (2 = Q4_0, 3 = Q4_1, 8 = Q8_0), not ", qtype);
  return qtype == kQ8_0 ? 32 + 512 : (qtype == kQ4_1 ? 64 : 32) + 256;
}

// blocks [N, nb * block_bytes] -> [ceil(N / 16), nb * packed_step]: the layout packed_group
// (4-bit) or packed_group16 (Q8_0) reads; the rows past N in the last group are zero (their
// outputs are never stored).
at::Tensor pack_rows(at::Tensor blocks, int64_t qtype) {
  const int64_t step = packed_step(qtype), bb = block_bytes(qtype);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous() && blocks.size(1) % bb == 0,
              "blocks must be a contiguous uint8 [N, whole blocks of ", bb, " bytes] CPU tensor");
  const int64_t N = blocks.size(0), nb = blocks.size(1) / bb, groups = (N + 15) / 16;
  const int64_t scale_bytes = qtype == kQ4_1 ? 64 : 32, qs_at = qtype == kQ4_1 ? 4 : 2;
  const int64_t chunk = qtype == kQ8_0 ? 2 : 4, chunks = qtype == kQ8_0 ? 16 : 4;
  at::Tensor out = at::zeros({groups, nb * step}, at::kByte);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t l = 0; l < 16 && 16 * g + l < N; ++l)
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* blk = src + (16 * g + l) * nb * bb + b * bb;
          uint8_t* o = dst + g * nb * step + b * step;
          std::memcpy(o + 2 * l, blk, 2);
          if (qtype == kQ4_1) std::memcpy(o + 32 + 2 * l, blk + 2, 2);
          for (int64_t c = 0; c < chunks; ++c)
            std::memcpy(o + scale_bytes + 16 * chunk * c + chunk * l, blk + qs_at + chunk * c, chunk);
        }
  });
  return out;
}

// x [M, K] float32 against packed weights (pack_rows) of N rows on vector path `isa`: x
// quantized to 8-bit blocks, 16-bit for Q8_0 (the quantize_activations arithmetic), into
// this thread's buffers, then packed_gemv.
// One call per linear and one allocation (y): decode's calls are short, their overhead counts.
at::Tensor packed_linear(at::Tensor x, at::Tensor packed, int64_t qtype, int64_t N, c10::optional<at::Tensor> bias,
                         int64_t isa) {
  const int64_t step = packed_step(qtype);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) % kBlock == 0,
              "x must be a float32 [M, K] CPU tensor, K a multiple of 32");
  x = x.contiguous();
  TORCH_CHECK(isa != kScalar && cpu_has(isa), "instruction-set path ", isa,
              " is not a vector path this CPU runs (packed weights take AVX2 and up)");
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(0) == (N + 15) / 16 && packed.size(1) == nb * step,
              "packed must be pack_rows' uint8 [", (N + 15) / 16, ", ", nb * step, "] for N = ", N, ", K = ", K);
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N),
              "bias: float32 [N]");
  at::Tensor y = at::empty({M, N}, at::kFloat);
  {
    pybind11::gil_scoped_release no_gil;
    thread_local std::vector<int8_t> q;  // 8-bit activations (4-bit weights) or, as int16, 16-bit (Q8_0)
    thread_local std::vector<float> scales, sums;
    const bool wide = qtype == kQ8_0;
    q.resize(M * K * (wide ? 2 : 1)), scales.resize(M * nb), sums.resize(M * nb);
#if defined(__x86_64__)
    int16_t* q16 = reinterpret_cast<int16_t*>(q.data());
    if (wide) {
      avx2::quantize_blocks(x.data_ptr<float>(), q16, scales.data(), sums.data(), M * nb, 32767.0f);
    } else {
      avx2::quantize_blocks(x.data_ptr<float>(), q.data(), scales.data(), sums.data(), M * nb, 127.0f);
    }
    const Acts acts{wide ? nullptr : q.data(), wide ? q16 : nullptr, scales.data(), sums.data(), M, nb};
    run_packed(isa, qtype, acts, packed.data_ptr<uint8_t>(), y.data_ptr<float>(), N);
#endif
  }
  if (bias.has_value()) y.add_(*bias);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported_isas", &supported_isas);
  m.def("quantize_activations", &quantize_activations);
  m.def("int8dot_linear", &int8dot_linear);
  m.def("pack_rows", &pack_rows);
  m.def("packed_linear", &packed_linear);
}
