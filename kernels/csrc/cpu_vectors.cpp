// One vector of float32 lanes, per instruction set, for the native CPU kernels after this
// file (`kernels.cpu_native` joins the sources into one translation unit, this one first).
// PD_SIMD is defined where a vector path exists (AVX-512, AVX2 + FMA); otherwise vf is a
// plain float (kLanes = 1), which the GEMM's scalar path uses.

#include <immintrin.h>

namespace pdvec {

#if defined(__AVX512F__)
#define PD_SIMD 1
constexpr int kLanes = 16;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset(float v) { return _mm512_set1_ps(v); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define PD_SIMD 1
constexpr int kLanes = 8;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset(float v) { return _mm256_set1_ps(v); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline float vsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
constexpr int kLanes = 1;
using vf = float;
inline vf vzero() { return 0.0f; }
inline vf vset(float v) { return v; }
inline vf vload(const float* p) { return *p; }
inline void vstore(float* p, vf v) { *p = v; }
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline vf vmul(vf a, vf b) { return a * b; }
inline vf vadd(vf a, vf b) { return a + b; }
inline float vsum(vf v) { return v; }
#endif

}  // namespace pdvec
