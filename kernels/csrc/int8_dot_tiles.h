// The integer-dot tiles of `cpu_int8_dot.cpp`, compiled once per instruction set: the
// includer opens `namespace <isa>` inside that ISA's `#pragma GCC target` region and defines
//
//   __m256i dot_u8s8(__m256i u, __m256i s)
//       8 int32 lanes, lane i = sum of u[4i + t] * s[4i + t] for t < 4 (u unsigned bytes,
//       s signed bytes), with no saturation for |u| <= 128 and |s| <= 127.
//
// Any type may also take 16-bit activations (Acts::q16, tile16_dot). Every path computes the
// same integer sum per block and row; only how the float32 scale
// products are added up differs.
//
// Per block b of weight row n and activation row m:
//   Q4_0: w = d (q - 8)   dot = d_w * d_x * sum((q - 8) * qx)
//   Q4_1: w = d q + m     dot = d_w * d_x * sum(q * qx) + m_w * (d_x * sum(qx))
//   Q8_0: w = d q         dot = d_w * d_x * sum(q * qx)
// The signed weights (Q4_0, Q8_0) go through the sign trick: |w| is unsigned, and qx * sign(w)
// carries the sign; |w| <= 128 and |qx| <= 127 keep AVX2's pairwise 16-bit sums below 32767.

// The block's 32 weights as bytes in activation order: the 4-bit types' low nibbles are
// weights 0-15 and the high nibbles 16-31.
template <int64_t QT>
inline __m256i block_weights(const uint8_t* blk) {
  if constexpr (QT == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (QT == kQ4_1 ? 4 : 2)));
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1);
    const __m256i q = _mm256_and_si256(both, _mm256_set1_epi8(15));
    if constexpr (QT == kQ4_1) return q;
    return _mm256_sub_epi8(q, _mm256_set1_epi8(8));
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// y[r * ldy + j] = x_r . W_j for NR weight rows j (row_bytes apart from w0) and MR activation
// rows r of `a` from row m0: each block of a weight row is unpacked once for all MR rows.
// Blocks [b0, a.nblocks) into acc and offset (y = hsum(acc) + offset); a wider tile runs
// the blocks it leaves over through here.
template <int64_t QT, int NR, int MR>
inline void blocks_dot(const uint8_t* w0, int64_t row_bytes, const Acts& a, int64_t m0, int64_t b0,
                       __m256 (&acc)[NR][MR], float (&offset)[NR][MR]) {
  constexpr int64_t bb = QT == kQ4_0 ? 18 : QT == kQ4_1 ? 20 : 34;
  for (int64_t b = b0; b < a.nblocks; ++b) {
    __m256i w[NR], u[NR];
    float dw[NR], mw[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const uint8_t* blk = w0 + j * row_bytes + b * bb;
      w[j] = block_weights<QT>(blk);
      u[j] = QT == kQ4_1 ? w[j] : _mm256_sign_epi8(w[j], w[j]);
      dw[j] = half_at(blk);
      mw[j] = QT == kQ4_1 ? half_at(blk + 2) : 0.0f;
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const int64_t row = (m0 + r) * a.nblocks + b;
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + row * kBlock));
      const float dx = a.scales[row];
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        const __m256i s = QT == kQ4_1 ? x : _mm256_sign_epi8(x, w[j]);
        const __m256 sums = _mm256_cvtepi32_ps(dot_u8s8(u[j], s));
        acc[j][r] = _mm256_fmadd_ps(sums, _mm256_set1_ps(dw[j] * dx), acc[j][r]);
        if constexpr (QT == kQ4_1) offset[j][r] += mw[j] * (dx * a.sums[row]);
      }
    }
  }
}

template <int64_t QT, int NR, int MR>
inline void tile_dot(const uint8_t* w0, int64_t row_bytes, const Acts& a, int64_t m0, float* y, int64_t ldy) {
  __m256 acc[NR][MR];
  float offset[NR][MR];  // Q4_1: sum over blocks of m_w * d_x * sum(qx)
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < MR; ++r) acc[j][r] = _mm256_setzero_ps(), offset[j][r] = 0.0f;
  blocks_dot<QT, NR, MR>(w0, row_bytes, a, m0, 0, acc, offset);
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < MR; ++r) y[r * ldy + j] = hsum(acc[j][r]) + offset[j][r];
}

// 16-bit activation blocks (Acts::q16): each block's 32 weights widened to 16 bits,
// vpmaddwd sums pairs of products into 8 int32 lanes (at most 2 * 128 * 32767 each, exact in
// float32 after the two halves are added).
template <int64_t QT, int NR, int MR>
inline void tile16_dot(const uint8_t* w0, int64_t row_bytes, const Acts& a, int64_t m0, float* y, int64_t ldy) {
  constexpr int64_t bb = QT == kQ4_0 ? 18 : QT == kQ4_1 ? 20 : 34;
  __m256 acc[NR][MR];
  float offset[NR][MR];  // Q4_1: sum over blocks of m_w * d_x * sum(qx)
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < MR; ++r) acc[j][r] = _mm256_setzero_ps(), offset[j][r] = 0.0f;
  for (int64_t b = 0; b < a.nblocks; ++b) {
    __m256i lo[NR], hi[NR];
    float dw[NR], mw[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const uint8_t* blk = w0 + j * row_bytes + b * bb;
      const __m256i w = block_weights<QT>(blk);  // signed bytes: Q4_1's 0..15 are too
      lo[j] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
      hi[j] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
      dw[j] = half_at(blk);
      mw[j] = QT == kQ4_1 ? half_at(blk + 2) : 0.0f;
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const int64_t row = (m0 + r) * a.nblocks + b;
      const __m256i* x = reinterpret_cast<const __m256i*>(a.q16 + row * kBlock);
      const __m256i xlo = _mm256_loadu_si256(x), xhi = _mm256_loadu_si256(x + 1);
      const float dx = a.scales[row];
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(lo[j], xlo), _mm256_madd_epi16(hi[j], xhi));
        acc[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dw[j] * dx), acc[j][r]);
        if constexpr (QT == kQ4_1) offset[j][r] += mw[j] * (dx * a.sums[row]);
      }
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < MR; ++r) y[r * ldy + j] = hsum(acc[j][r]) + offset[j][r];
}

// X16: the activations are 16-bit. PD_WIDE_TILE (PD_WIDE_TILE16), where the includer defines
// it, names an 8-bit tile_dot (a tile16_dot) of its own for this ISA, declared before the
// include, same arguments.
template <int64_t QT, bool X16, int NR, int MR>
void tile(const uint8_t* w0, int64_t row_bytes, const Acts& a, int64_t m0, float* y, int64_t ldy, int rows) {
  if constexpr (MR > 1) {
    if (rows < MR) return tile<QT, X16, NR, MR - 1>(w0, row_bytes, a, m0, y, ldy, rows);
  }
  if constexpr (X16) {
#if defined(PD_WIDE_TILE16)
    PD_WIDE_TILE16<QT, NR, MR>(w0, row_bytes, a, m0, y, ldy);
#else
    tile16_dot<QT, NR, MR>(w0, row_bytes, a, m0, y, ldy);
#endif
  } else {
#if defined(PD_WIDE_TILE)
    PD_WIDE_TILE<QT, NR, MR>(w0, row_bytes, a, m0, y, ldy);
#else
    tile_dot<QT, NR, MR>(w0, row_bytes, a, m0, y, ldy);
#endif
  }
}

// y [M, N] = the activations against every weight row: tiles of NR weight rows split over
// the threads, each against the activation rows kRows at a time, the next tile's blocks
// asked for while one is computed (decode streams its weights from memory).
template <int64_t QT, bool X16, int NR>
void gemv_tiles(const Acts& a, const uint8_t* blocks, float* y, int64_t N) {
  constexpr int kRows = 4;  // NR x 4 float accumulators + the weight vectors fit 16 registers
  const int64_t row_bytes = a.nblocks * block_bytes(QT), tile_bytes = NR * row_bytes;
  at::parallel_for(0, N / NR, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (t + 1 < end) {
        const char* next = reinterpret_cast<const char*>(blocks + (t + 1) * tile_bytes);
        for (int64_t off = 0; off < tile_bytes; off += 64) __builtin_prefetch(next + off, 0, 3);
      }
      for (int64_t m = 0; m < a.rows; m += kRows)
        tile<QT, X16, NR, kRows>(blocks + t * tile_bytes, row_bytes, a, m, y + m * N + NR * t, N,
                            static_cast<int>(std::min<int64_t>(kRows, a.rows - m)));
    }
  });
}

template <int64_t QT>
void gemv(const Acts& a, const uint8_t* blocks, float* y, int64_t N) {
  if (a.q16 != nullptr) {
    if (N % 2 == 0) return gemv_tiles<QT, true, 2>(a, blocks, y, N);
    return gemv_tiles<QT, true, 1>(a, blocks, y, N);
  }
  if (N % 2 == 0) {
    gemv_tiles<QT, false, 2>(a, blocks, y, N);
  } else {
    gemv_tiles<QT, false, 1>(a, blocks, y, N);
  }
}

// The activations' quantization (quantize_activations) on 8-float vectors: the scalar
// path's arithmetic (q = x * (levels / amax) rounded to nearest even, clamped to +-levels)
// in the same order, so both give the same q.
inline __m256i packed_order(__m256i v) {  // undo vpack*'s per-128-bit-lane interleave
  return _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

template <typename T>
void quantize_blocks(const float* xp, T* qp, float* dp, float* sp, int64_t count, float levels) {
  at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
    const __m256 sign = _mm256_set1_ps(-0.0f), hi = _mm256_set1_ps(levels), lo = _mm256_set1_ps(-levels);
    for (int64_t i = begin; i < end; ++i) {
      const float* xb = xp + i * kBlock;
      __m256 v[4];
      for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(xb + 8 * k);
      __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                               _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4);
      const __m256 inv = _mm256_set1_ps(amax > 0.0f ? levels / amax : 0.0f);
      __m256i q[4];
      for (int k = 0; k < 4; ++k)  // vcvtps2dq rounds to nearest even
        q[k] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_round_ps(_mm256_mul_ps(v[k], inv),
                                                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))));
      const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
      if constexpr (sizeof(T) == 1) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qp + i * kBlock), packed_order(_mm256_packs_epi16(w01, w23)));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qp + i * kBlock), _mm256_permute4x64_epi64(w01, 0xD8));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qp + i * kBlock + 16), _mm256_permute4x64_epi64(w23, 0xD8));
      }
      dp[i] = amax / levels;
      sp[i] = static_cast<float>(_mm_cvtsi128_si32(s4));
    }
  });
}

// ---- packed groups of 16 rows (`pack_rows` in cpu_int8_dot.cpp) on 256-bit vectors ---------
// Rows 0-7 of a group take one vector, rows 8-15 the other (half h: bytes 32 h.. of each
// 64-byte chunk, scales 8 h..): each int32 lane one row, as the 512-bit packed_group.
inline void store_lanes(float* y, __m256 v, int count) {
  if (count >= 8) return _mm256_storeu_ps(y, v);
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int i = 0; i < count; ++i) y[i] = tmp[i];
}

template <int64_t QT, int MR>
void packed_group256(const uint8_t* p, int64_t nb, const Acts& a, int64_t m0, float* y, int64_t ldy, int lanes) {
  constexpr int64_t scale_bytes = QT == kQ8_0 ? 32 : QT == kQ4_1 ? 64 : 32;
  constexpr int64_t step = QT == kQ8_0 ? 32 + 512 : scale_bytes + 256;
  const __m256i low = _mm256_set1_epi8(15);
  __m256 acc[2][MR];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < MR; ++r) acc[h][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, p += step) {
    for (int64_t off = 0; off < step; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p + 2 * step + off), _MM_HINT_T0);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
      __m256i s[MR];
      for (int r = 0; r < MR; ++r) s[r] = _mm256_setzero_si256();
      if constexpr (QT == kQ8_0) {  // 16-bit activations: pairs widened, vpmaddwd
#pragma GCC unroll 16
        for (int c = 0; c < 16; ++c) {
          const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 32 * c + 16 * h)));
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) {
            int32_t pair;
            std::memcpy(&pair, a.q16 + ((m0 + r) * a.nblocks + b) * kBlock + 2 * c, 4);
            s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(w, _mm256_set1_epi32(pair)));
          }
        }
      } else {
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + scale_bytes + 64 * c + 32 * h));
          const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) {
            const int8_t* x = a.q + ((m0 + r) * a.nblocks + b) * kBlock;
            int32_t xl, xh;
            std::memcpy(&xl, x + 4 * c, 4);
            std::memcpy(&xh, x + 16 + 4 * c, 4);
            s[r] = _mm256_add_epi32(s[r], _mm256_add_epi32(dot_u8s8(lo, _mm256_set1_epi32(xl)),
                                                           dot_u8s8(hi, _mm256_set1_epi32(xh))));
          }
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const int64_t row = (m0 + r) * a.nblocks + b;
        const float dx = a.scales[row];
        __m256i sum = s[r];
        if constexpr (QT == kQ4_0)  // its nibbles are q + 8: sum((q + 8) qx) - 8 sum(qx), exact in int32
          sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(8 * static_cast<int32_t>(a.sums[row])));
        acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[h][r]);
        if constexpr (QT == kQ4_1) {  // + m_w * d_x * sum(qx)
          const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * h)));
          acc[h][r] = _mm256_fmadd_ps(m, _mm256_set1_ps(dx * a.sums[row]), acc[h][r]);
        }
      }
    }
  }
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < MR; ++r) store_lanes(y + r * ldy + 8 * h, acc[h][r], lanes - 8 * h);
}
