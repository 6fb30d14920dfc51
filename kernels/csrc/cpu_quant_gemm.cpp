// Linear layers straight from a GGUF file's quantized blocks: y = x @ W^T with W kept in
// GGML's own block layout, expanded to float32 in registers and accumulated in float32.
//
//   quant_linear(x, blocks, qtype, bias) -> y
//       x [M, K] float32 contiguous; blocks [N, K / 32 * block_bytes] uint8 contiguous (row n
//       holds W[n, :] as K / 32 consecutive blocks); qtype the GGML type id (2 = Q4_0,
//       3 = Q4_1, 8 = Q8_0); bias [N] float32 or None. Returns y [M, N] float32.
//   dequantize_rows(blocks, qtype, begin, end) -> W[begin:end] float32 [end - begin, K]
//
// Block layouts (GGML's, all little-endian; d and m are IEEE half floats):
//   Q4_0 (18 bytes): d, qs[16]; value j = d * (q_j - 8)
//   Q4_1 (20 bytes): d, m, qs[16]; value j = d * q_j + m
//   Q8_0 (34 bytes): d, qs[32] (int8); value j = d * q_j
// where for the 4-bit types q_j = qs[j] & 15 and q_{j+16} = qs[j] >> 4 (j < 16).
//
// A decode step has a few rows: there the step is bound by weight bytes, and reading four or
// eight bits per weight instead of 32 is the whole gain. Each weight row is expanded once per
// tile of up to kRows activation rows, which reuse it from registers. With many rows (a
// prefill) that would redo the expansion M / kRows times: `kernels.quant` then expands the
// weights once (dequantize_rows_into) for the CPU GEMM instead.
// Both vector paths (AVX-512, AVX2) and a scalar one are picked at compile time
// (-march=native); `kernels.cpu_native` builds one per CPU.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

constexpr int64_t kBlock = 32;  // weights per block, all three types
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
    default: TORCH_CHECK(false, "unsupported GGML block type ", qtype, " (2 = Q4_0, 3 = Q4_1, 8 = Q8_0)");
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// ---- per instruction set: the vector helpers of cpu_vectors.cpp, and bytes -> floats ------
using namespace pdvec;
#if defined(__AVX512F__)
constexpr int kRows = 8;  // activation rows per tile: 2 x 8 accumulators + 4 weight vectors of 32 registers
// 16 unsigned (or signed) bytes -> 16 / kLanes vectors
inline void u8_to_f(__m128i b, vf* out) { out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
inline void i8_to_f(__m128i b, vf* out) { out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
#elif defined(PD_SIMD)
constexpr int kRows = 4;  // 2 x 4 accumulators + 8 weight vectors: all 16 registers
inline void u8_to_f(__m128i b, vf* out) {
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
}
inline void i8_to_f(__m128i b, vf* out) {
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}
#else
constexpr int kRows = 4;
#endif

constexpr int kPerBlock = kBlock / kLanes;  // vectors per block

// The 32 weights of one block, as float32 vectors w[0 .. kPerBlock).
template <int64_t QT>
inline void expand(const uint8_t* blk, vf* w) {
  const float d = half_at(blk);
#if defined(PD_SIMD)
  if constexpr (QT == kQ8_0) {
    i8_to_f(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)), w);
    i8_to_f(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)), w + kPerBlock / 2);
    const vf vd = vset(d);
    for (int i = 0; i < kPerBlock; ++i) w[i] = vmul(w[i], vd);
  } else {
    const uint8_t* qs = blk + (QT == kQ4_1 ? 4 : 2);
    const float m = QT == kQ4_1 ? half_at(blk + 2) : -8.0f * d;
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
#if defined(__AVX512F__)
    // A 4-bit block holds 16 values at most: compute them once (d * q + m for q = 0..15,
    // rounded as the float32 model's weights) and pick each weight from that table, instead
    // of converting 32 integers (SmolLM2's Q4_1 linears, one thread: 8.4 -> 7.6 ms a step at
    // one row, 13.8 -> 12.9 ms at four).
    const vf table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                     vset(d), vset(m));
    const __m512i q = _mm512_cvtepu8_epi32(bytes);  // permutexvar reads the low 4 bits of each lane
    w[0] = _mm512_permutexvar_ps(q, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
#else
    const __m128i low4 = _mm_set1_epi8(0x0F);
    u8_to_f(_mm_and_si128(bytes, low4), w);
    u8_to_f(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4), w + kPerBlock / 2);
    const vf vd = vset(d), vm = vset(m);
    for (int i = 0; i < kPerBlock; ++i) w[i] = vfma(w[i], vd, vm);
#endif
  }
#else
  if constexpr (QT == kQ8_0) {
    const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2);
    for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(qs[j]);
  } else {
    const uint8_t* qs = blk + (QT == kQ4_1 ? 4 : 2);
    const float m = QT == kQ4_1 ? half_at(blk + 2) : -8.0f * d;
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(qs[j] & 15) + m;
      w[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
    }
  }
#endif
}

// UB blocks from b of the NR weight rows against the MR activation rows, each vector i of
// them into chain i % C of its output.
template <int64_t QT, int NR, int MR, int UB, int C>
inline void blocks_dot(const uint8_t* w0, int64_t row_bytes, int64_t b, const float* x, int64_t ldx,
                       vf (&acc)[NR][MR][C]) {
  constexpr int64_t bb = QT == kQ4_0 ? 18 : QT == kQ4_1 ? 20 : 34;
  vf w[NR][UB * kPerBlock];
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 4
    for (int u = 0; u < UB; ++u) expand<QT>(w0 + j * row_bytes + (b + u) * bb, w[j] + u * kPerBlock);
  const float* xb = x + b * kBlock;
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 32
    for (int i = 0; i < UB * kPerBlock; ++i) {
      const vf xv = vload(xb + r * ldx + i * kLanes);
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) acc[j][r][i % C] = vfma(xv, w[j][i], acc[j][r][i % C]);
    }
}

// y[r * ldy + j] = x[r] . W[j] for the NR weight rows j (row_bytes apart) and MR activation
// rows r (ldx apart) of one tile: each block of a weight row is expanded once and used by
// every activation row, each activation vector loaded once for every weight row.
// An FMA waits 4 cycles for its accumulator: with one chain per output a one-row tile ran
// at ~10 cycles a block (decode at batch 1). Small tiles therefore take two blocks a step
// and keep C independent chains per output, summed at the end (C = 4 with AVX-512, 4 with
// AVX2, whose 16 registers hold no more); larger tiles have chains enough in their outputs.
template <int64_t QT, int NR, int MR>
inline void tile_dot(const uint8_t* w0, int64_t row_bytes, int64_t nblocks, const float* x, int64_t ldx,
                     float* y, int64_t ldy) {
  constexpr bool small = NR * MR <= 2;
  constexpr int UB = small && kPerBlock <= 2 ? 2 : 1;  // blocks a step
  constexpr int C = small ? UB * kPerBlock : 1;       // chains per output
  vf acc[NR][MR][C];
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[j][r][c] = vzero();
  int64_t b = 0;
  for (; b + UB <= nblocks; b += UB) blocks_dot<QT, NR, MR, UB, C>(w0, row_bytes, b, x, ldx, acc);
  for (; b < nblocks; ++b) blocks_dot<QT, NR, MR, 1, C>(w0, row_bytes, b, x, ldx, acc);
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      vf s = acc[j][r][0];
#pragma GCC unroll 8
      for (int c = 1; c < C; ++c) s = vadd(s, acc[j][r][c]);
      y[r * ldy + j] = vsum(s);
    }
}

// A tile of NR weight rows and `rows` (<= MR) activation rows.
template <int64_t QT, int NR, int MR>
void tile(const uint8_t* w0, int64_t row_bytes, int64_t nblocks, const float* x, int64_t ldx, float* y,
          int64_t ldy, int rows) {
  if constexpr (MR > 1) {
    if (rows < MR) return tile<QT, NR, MR - 1>(w0, row_bytes, nblocks, x, ldx, y, ldy, rows);
  }
  tile_dot<QT, NR, MR>(w0, row_bytes, nblocks, x, ldx, y, ldy);
}

// The row loop of both kernels: tiles of one or two weight rows (`pairs`), each run against
// the activation rows ROWS at a time by `run(nr, w, x, y, rows)` (nr: the tile's weight rows,
// a std::integral_constant), the next tile's blocks asked for while one is computed.
template <int ROWS, int NR, typename In, typename F>
void each_tile_of(const In* x, const uint8_t* blocks, float* y, int64_t M, int64_t N, int64_t K, int64_t row_bytes,
                  F& run) {
  const int64_t tile_bytes = NR * row_bytes;
  at::parallel_for(0, N / NR, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (t + 1 < end) {
        const char* next = reinterpret_cast<const char*>(blocks + (t + 1) * tile_bytes);
        for (int64_t off = 0; off < tile_bytes; off += 64) __builtin_prefetch(next + off, 0, 3);
      }
      for (int64_t m = 0; m < M; m += ROWS)
        run(std::integral_constant<int, NR>{}, blocks + t * tile_bytes, x + m * K, y + m * N + NR * t,
            static_cast<int>(std::min<int64_t>(ROWS, M - m)));
    }
  });
}

template <int ROWS, typename In, typename F>
void each_tile(const In* x, const uint8_t* blocks, float* y, int64_t M, int64_t N, int64_t K, int64_t row_bytes,
               bool pairs, F&& run) {
  if (pairs) {
    each_tile_of<ROWS, 2>(x, blocks, y, M, N, K, row_bytes, run);
  } else {
    each_tile_of<ROWS, 1>(x, blocks, y, M, N, K, row_bytes, run);
  }
}

// 2 or 3 activation rows: one weight row per tile. One row, or 4 and more: two weight rows
// per tile, which halves the activation loads: they come from L2 once a tile's rows are
// wider than L1 holds (a 1B model at batch 8: 46.8 against 33.5 tok/s; SmolLM2's linears at
// 8 rows 15.9 against 16.9 ms a step, 2 Zen 4 threads); at one row the two rows' chains also
// overlap (Q4_1 at batch 1, one Zen 4 thread: 16 cycles a block with one chain per output,
// 10 with four, 8.7 with two weight rows). The next tile's blocks are asked for while one
// is computed, at any row count: weights stream from memory (SmolLM2's 30 layers, 60 MB of
// Q4_1, one Zen 4 thread: 14.5 -> 13.8 ms at 4 rows; the Q8_0 output projection 5.9 -> 3.9 ms).
template <int64_t QT>
void gemv_rows(const float* x, const uint8_t* blocks, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t nblocks = K / kBlock, row_bytes = nblocks * block_bytes(QT);
  const bool pairs = (M >= 4 || M == 1) && N % 2 == 0;
  each_tile<kRows>(x, blocks, y, M, N, K, row_bytes, pairs, [&](auto nr, const uint8_t* w, const float* xm, float* ym, int rows) {
    tile<QT, decltype(nr)::value, kRows>(w, row_bytes, nblocks, xm, K, ym, N, rows);
  });
}

template <int64_t QT>
void expand_rows(const uint8_t* blocks, float* out, int64_t begin, int64_t end, int64_t K) {
  const int64_t nblocks = K / kBlock, bb = block_bytes(QT), row_bytes = nblocks * bb;
  at::parallel_for(begin, end, 16, [&](int64_t lo, int64_t hi) {
    vf w[kPerBlock];
    for (int64_t n = lo; n < hi; ++n) {
      for (int64_t b = 0; b < nblocks; ++b) {
        expand<QT>(blocks + n * row_bytes + b * bb, w);
        float* dst = out + (n - begin) * K + b * kBlock;
        for (int i = 0; i < kPerBlock; ++i) vstore(dst + i * kLanes, w[i]);
      }
    }
  });
}

#if defined(__AVX512BF16__)
// ---- fast mode (`gguf-fast`): bfloat16 activations, one dot-product instruction a block --
// Each block is expanded to 32 bfloat16 weights (d * q + m computed in float32, as the exact
// mode does, then rounded once to bfloat16), and VDPBF16PS multiplies them with the block's
// 32 bfloat16 activations, summing pairs into 16 float32 lanes: one instruction per block and
// row where the exact mode needs two FMAs, and half the activation bytes. Where the CPU has
// no AVX-512 BF16 the fast mode runs torch's int4 GEMM instead (`kernels.quant`).
namespace bf16 {

constexpr int kRows = 8;  // activation rows per tile, as the float32 kernel

template <int64_t QT>
inline __m512i expand(const uint8_t* blk) {
  const float d = half_at(blk);
  if constexpr (QT == kQ8_0) {
    const __m512 vd = _mm512_set1_ps(d);
    const __m128i* qs = reinterpret_cast<const __m128i*>(blk + 2);
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qs))), vd);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qs + 1))), vd);
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
  } else {
    const float m = QT == kQ4_1 ? half_at(blk + 2) : -8.0f * d;
    const __m512 values = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_ps(d), _mm512_set1_ps(m));
    // the 16 values twice over: a 16-bit lane holding a whole byte indexes by its low 5 bits,
    // the low nibble plus one bit of the high one, which then picks the same value
    const __m512i table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(values, values));
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (QT == kQ4_1 ? 4 : 2))));
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(bytes), _mm256_srli_epi16(bytes, 4), 1);
    return _mm512_permutexvar_epi16(q, table);
  }
}

// As the float32 tile_dot, with C chains per output for tiles too small to hide the
// instruction's latency in their own outputs.
template <int64_t QT, int NR, int MR>
inline void tile_dot(const uint8_t* w0, int64_t row_bytes, int64_t nblocks, const uint16_t* x, int64_t ldx,
                     float* y, int64_t ldy) {
  constexpr int64_t bb = QT == kQ4_0 ? 18 : QT == kQ4_1 ? 20 : 34;
  constexpr int C = NR * MR <= 2 ? 4 : NR * MR <= 4 ? 2 : 1;
  __m512 acc[NR][MR][C];
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < C; ++c) acc[j][r][c] = _mm512_setzero_ps();
  auto step = [&](int64_t b, int c) __attribute__((always_inline)) {
    __m512i w[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) w[j] = expand<QT>(w0 + j * row_bytes + b * bb);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + r * ldx + b * kBlock));
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[j][r][c] = _mm512_dpbf16_ps(acc[j][r][c], xv, reinterpret_cast<__m512bh>(w[j]));
    }
  };
  int64_t b = 0;
  for (; b + C <= nblocks; b += C)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) step(b + c, c);
  for (; b < nblocks; ++b) step(b, 0);
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < MR; ++r) {
      __m512 s = acc[j][r][0];
      for (int c = 1; c < C; ++c) s = _mm512_add_ps(s, acc[j][r][c]);
      y[r * ldy + j] = _mm512_reduce_add_ps(s);
    }
}

template <int64_t QT, int NR, int MR>
void tile(const uint8_t* w0, int64_t row_bytes, int64_t nblocks, const uint16_t* x, int64_t ldx, float* y,
          int64_t ldy, int rows) {
  if constexpr (MR > 1) {
    if (rows < MR) return tile<QT, NR, MR - 1>(w0, row_bytes, nblocks, x, ldx, y, ldy, rows);
  }
  tile_dot<QT, NR, MR>(w0, row_bytes, nblocks, x, ldx, y, ldy);
}

// Two weight rows a tile at every row count.
template <int64_t QT>
void gemv_rows(const uint16_t* x, const uint8_t* blocks, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t nblocks = K / kBlock, row_bytes = nblocks * block_bytes(QT);
  each_tile<kRows>(x, blocks, y, M, N, K, row_bytes, N % 2 == 0, [&](auto nr, const uint8_t* w, const uint16_t* xm, float* ym, int rows) {
    tile<QT, decltype(nr)::value, kRows>(w, row_bytes, nblocks, xm, K, ym, N, rows);
  });
}

// Rows [begin, end) of W as bfloat16 into `out` [end - begin, K]: the fast mode's prompts
// multiply them with oneDNN's bfloat16 GEMM.
template <int64_t QT>
void expand_rows(const uint8_t* blocks, uint16_t* out, int64_t begin, int64_t end, int64_t K) {
  const int64_t nblocks = K / kBlock, bb = block_bytes(QT), row_bytes = nblocks * bb;
  at::parallel_for(begin, end, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n)
      for (int64_t b = 0; b < nblocks; ++b)
        _mm512_storeu_si512(out + (n - begin) * K + b * kBlock, expand<QT>(blocks + n * row_bytes + b * bb));
  });
}

}  // namespace bf16
#endif

template <typename F>
void by_type(int64_t qtype, F&& f) {
  switch (qtype) {
    case kQ4_0: f(std::integral_constant<int64_t, kQ4_0>{}); break;
    case kQ4_1: f(std::integral_constant<int64_t, kQ4_1>{}); break;
    case kQ8_0: f(std::integral_constant<int64_t, kQ8_0>{}); break;
    default: block_bytes(qtype);  // raises
  }
}

int64_t checked_k(const at::Tensor& blocks, int64_t qtype) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous(), "blocks must be a contiguous uint8 [N, row_bytes] CPU tensor");
  const int64_t bb = block_bytes(qtype);
  TORCH_CHECK(blocks.size(1) % bb == 0, "a row of ", blocks.size(1), " bytes is not whole blocks of ", bb);
  return blocks.size(1) / bb * kBlock;
}

}  // namespace

// Rows [begin, begin + out.size(0)) of W into `out` (float32 [rows, K] contiguous): a caller
// that expands weights on every call reuses one buffer instead of faulting in fresh pages.
// `out` may also be bfloat16 where the build has AVX-512 BF16 (has_bf16_gemm()): each weight
// rounded once from its float32 value, as the fast mode's kernel does.
at::Tensor dequantize_rows_into(at::Tensor blocks, int64_t qtype, int64_t begin, at::Tensor out) {
  const int64_t K = checked_k(blocks, qtype);
#if defined(__AVX512BF16__)
  const bool bf16_out = out.scalar_type() == at::kBFloat16;
#else
  const bool bf16_out = false;
#endif
  TORCH_CHECK((out.scalar_type() == at::kFloat || bf16_out) && out.dim() == 2 && out.size(1) == K && out.is_contiguous(),
              "out must be a contiguous float32 (or, with AVX-512 BF16, bfloat16) [rows, ", K, "] tensor");
  const int64_t end = begin + out.size(0);
  TORCH_CHECK(0 <= begin && end <= blocks.size(0), "row range out of bounds");
  pybind11::gil_scoped_release no_gil;
  by_type(qtype, [&](auto qt) {
#if defined(__AVX512BF16__)
    if (bf16_out) {
      bf16::expand_rows<decltype(qt)::value>(blocks.data_ptr<uint8_t>(),
                                            reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), begin, end, K);
      return;
    }
#endif
    expand_rows<decltype(qt)::value>(blocks.data_ptr<uint8_t>(), out.data_ptr<float>(), begin, end, K);
  });
  return out;
}

at::Tensor dequantize_rows(at::Tensor blocks, int64_t qtype, int64_t begin, int64_t end) {
  TORCH_CHECK(begin <= end, "row range out of bounds");
  return dequantize_rows_into(blocks, qtype, begin, at::empty({end - begin, checked_k(blocks, qtype)}, at::kFloat));
}


// Both linears: x [M, K] of `dtype` against W's blocks, y float32 [M, N] = run(qt, y, M, N, K)
// (+ bias), everything checked before the work.
template <typename Run>
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype,
                        const c10::optional<at::Tensor>& bias, at::ScalarType dtype, const char* dtype_name,
                        Run&& run) {
  const int64_t K = checked_k(blocks, qtype), N = blocks.size(0);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == dtype && x.dim() == 2 && x.is_contiguous() &&
                  x.size(1) == K, "x must be a contiguous ", dtype_name, " [M, ", K, "] CPU tensor");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N),
              "bias: float32 [N]");
  const int64_t M = x.size(0);
  // no Python object is touched from here: let the service's event loop run meanwhile
  pybind11::gil_scoped_release no_gil;
  at::Tensor y = at::empty({M, N}, at::kFloat);
  by_type(qtype, [&](auto qt) { run(qt, y.data_ptr<float>(), M, N, K); });
  if (bias.has_value()) y.add_(*bias);
  return y;
}

at::Tensor quant_linear(at::Tensor x, at::Tensor blocks, int64_t qtype, c10::optional<at::Tensor> bias) {
  return block_linear(x, blocks, qtype, bias, at::kFloat, "float32", [&](auto qt, float* y, int64_t M, int64_t N, int64_t K) {
    gemv_rows<decltype(qt)::value>(x.data_ptr<float>(), blocks.data_ptr<uint8_t>(), y, M, N, K);
  });
}


// Whether this build has the fast mode's kernel (`quant_linear_bf16`): AVX-512 BF16.
bool has_bf16_gemm() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// quant_linear with bfloat16 activations x [M, K] (the fast mode); y float32 [M, N].
at::Tensor quant_linear_bf16(at::Tensor x, at::Tensor blocks, int64_t qtype, c10::optional<at::Tensor> bias) {
#if defined(__AVX512BF16__)
  return block_linear(x, blocks, qtype, bias, at::kBFloat16, "bfloat16", [&](auto qt, float* y, int64_t M, int64_t N, int64_t K) {
    bf16::gemv_rows<decltype(qt)::value>(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                                         blocks.data_ptr<uint8_t>(), y, M, N, K);
  });
#else
  TORCH_CHECK(false, "quant_linear_bf16 needs AVX-512 BF16, which this build lacks (has_bf16_gemm())");
#endif
}
