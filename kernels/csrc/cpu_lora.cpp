// Batched LoRA updates on CPU: every token row of a step under its own adapter slot, in one
// call per linear whatever the mix of adapters (Punica / S-LoRA's gathered update). Rows of
// one slot that sit next to each other form a run; each run reads its slot's matrices once,
// so a step pays for the adapters it holds, not for every slot.
//
//   lora_add(y, x, slots, ranks, a, bt, bounds) -> y
//     x [T, IN] float32, y [T, OUT] float32: rows may be strided, columns contiguous.
//     slots [T] int32: row t's slot, -1 = no adapter (row t of y is not touched).
//     ranks [S] int32: slot s's rank in this linear, 0 = this linear is not adapted under s.
//     a [S, N*R, IN] contiguous: slice i's A (rows i*R .. i*R + ranks[s]).
//     bt [S, R, OUT] contiguous: slice i's B transposed with its scaling folded in, in the
//       slice's own columns: bt[s, r, o] = scaling * B_i[o - bounds[i], r].
//     bounds [N + 1]: 0 = bounds[0] < ... < bounds[N] = OUT (the slices' columns).
//   For each row t of slot s and each slice i, with r < ranks[s]:
//     v[r]  = a[s, i*R + r, :] . x[t, :]                            (shrink)
//     y[t, o] += sum_r v[r] * bt[s, r, o],  bounds[i] <= o < bounds[i+1]  (expand)
//   The update is summed apart from y and added once, as PEFT adds B(Ax) to the base output.
// Built with the decode attention kernel by `pdserve.kernels.cpu_native` (after cpu_vectors.cpp).

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

using pdvec::kLanes;
using pdvec::vf;

struct LoraRun {
  int64_t slot, begin, end, rank;
};

// rows of x sharing one pass over A's rows: the accumulators must fit the vector registers
constexpr int64_t kTokenTile = kLanes == 16 ? 4 : 2;
constexpr int64_t kRowTile = 4;        // A rows per shrink task (independent FMA chains)
constexpr int64_t kColumnBlock = 64;   // output columns per expand task
constexpr int64_t kPrefetchFloats = 256;  // how far ahead a stream of weights is fetched (past the end: harmless)
constexpr int64_t kMinTaskMacs = 1 << 16;  // less work than this stays on one thread

// out[k * NT + j] = a_k . x_j for the KR rows a_k = a + k * n and the NT rows x_j = x + j * sx
template <int64_t KR, int64_t NT>
inline void dot_rows(const float* a, const float* x, int64_t sx, int64_t n, float* out) {
  vf acc[KR][NT];
  for (int64_t k = 0; k < KR; ++k)
    for (int64_t j = 0; j < NT; ++j) acc[k][j] = pdvec::vzero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    vf xv[NT];
    for (int64_t j = 0; j < NT; ++j) xv[j] = pdvec::vload(x + j * sx + i);
    for (int64_t k = 0; k < KR; ++k) {
      __builtin_prefetch(a + k * n + i + kPrefetchFloats);
      const vf w = pdvec::vload(a + k * n + i);
      for (int64_t j = 0; j < NT; ++j) acc[k][j] = pdvec::vfma(w, xv[j], acc[k][j]);
    }
  }
  for (int64_t k = 0; k < KR; ++k) {
    for (int64_t j = 0; j < NT; ++j) {
      float sum = pdvec::vsum(acc[k][j]);
      for (int64_t e = i; e < n; ++e) sum += a[k * n + e] * x[j * sx + e];
      out[k * NT + j] = sum;
    }
  }
}

template <int64_t KR>
inline void dot_rows_nt(const float* a, const float* x, int64_t sx, int64_t nt, int64_t n, float* out) {
  switch (nt) {
    case 4: dot_rows<KR, 4>(a, x, sx, n, out); break;
    case 3: dot_rows<KR, 3>(a, x, sx, n, out); break;
    case 2: dot_rows<KR, 2>(a, x, sx, n, out); break;
    default: dot_rows<KR, 1>(a, x, sx, n, out); break;
  }
}

// out[k * nt + j] = a_k . x_j for kr <= kRowTile rows of A and nt <= kTokenTile rows of x
inline void dot_tile(const float* a, const float* x, int64_t sx, int64_t kr, int64_t nt, int64_t n, float* out) {
  switch (kr) {
    case 4: dot_rows_nt<4>(a, x, sx, nt, n, out); break;
    case 3: dot_rows_nt<3>(a, x, sx, nt, n, out); break;
    case 2: dot_rows_nt<2>(a, x, sx, nt, n, out); break;
    default: dot_rows_nt<1>(a, x, sx, nt, n, out); break;
  }
}

// y_j[o0..o1) += sum_r v_j[r] * b[r * ldb + o], r < rank, for the NT rows v_j = v + j * ldv,
// y_j = y + j * ldy (each update summed first, then added; b is read once for all rows)
template <int64_t NT>
inline void expand_rows(const float* v, int64_t ldv, const float* b, int64_t ldb, int64_t rank, int64_t o0,
                        int64_t o1, float* y, int64_t ldy) {
  int64_t o = o0;
  for (; o + 4 * kLanes <= o1; o += 4 * kLanes) {
    vf u[NT][4];
    for (int64_t j = 0; j < NT; ++j)
      for (int64_t q = 0; q < 4; ++q) u[j][q] = pdvec::vzero();
    for (int64_t r = 0; r < rank; ++r) {
      const float* br = b + r * ldb + o;
      for (int64_t q = 0; q < 4 * kLanes; q += 16) __builtin_prefetch(br + kPrefetchFloats + q);  // a line each
      const vf b0 = pdvec::vload(br), b1 = pdvec::vload(br + kLanes);
      const vf b2 = pdvec::vload(br + 2 * kLanes), b3 = pdvec::vload(br + 3 * kLanes);
      for (int64_t j = 0; j < NT; ++j) {
        const vf vr = pdvec::vset(v[j * ldv + r]);
        u[j][0] = pdvec::vfma(vr, b0, u[j][0]);
        u[j][1] = pdvec::vfma(vr, b1, u[j][1]);
        u[j][2] = pdvec::vfma(vr, b2, u[j][2]);
        u[j][3] = pdvec::vfma(vr, b3, u[j][3]);
      }
    }
    for (int64_t j = 0; j < NT; ++j) {
      float* yo = y + j * ldy + o;
      for (int64_t q = 0; q < 4; ++q) {
        pdvec::vstore(yo + q * kLanes, pdvec::vadd(pdvec::vload(yo + q * kLanes), u[j][q]));
      }
    }
  }
  for (; o + kLanes <= o1; o += kLanes) {
    for (int64_t j = 0; j < NT; ++j) {
      vf u = pdvec::vzero();
      for (int64_t r = 0; r < rank; ++r) {
        u = pdvec::vfma(pdvec::vset(v[j * ldv + r]), pdvec::vload(b + r * ldb + o), u);
      }
      float* yo = y + j * ldy + o;
      pdvec::vstore(yo, pdvec::vadd(pdvec::vload(yo), u));
    }
  }
  for (; o < o1; ++o) {
    for (int64_t j = 0; j < NT; ++j) {
      float u = 0.0f;
      for (int64_t r = 0; r < rank; ++r) u += v[j * ldv + r] * b[r * ldb + o];
      y[j * ldy + o] += u;
    }
  }
}

// the runs of rows under one adapted slot, in row order
std::vector<LoraRun> lora_runs(const int32_t* slots, int64_t T, const int32_t* ranks, int64_t S) {
  std::vector<LoraRun> runs;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slots[t];
    TORCH_CHECK(s >= -1 && s < S, "slots holds ", s, ", outside [-1, ", S, ")");
    if (s < 0 || ranks[s] == 0) continue;
    if (!runs.empty() && runs.back().slot == s && runs.back().end == t) {
      runs.back().end = t + 1;
    } else {
      runs.push_back({s, t, t + 1, ranks[s]});
    }
  }
  return runs;
}

void check_lora_args(const at::Tensor& y, const at::Tensor& x, const at::Tensor& slots, const at::Tensor& ranks,
                     const at::Tensor& a, const at::Tensor& bt, const std::vector<int64_t>& bounds) {
  TORCH_CHECK(x.device().is_cpu() && y.device().is_cpu() && a.device().is_cpu() && bt.device().is_cpu(),
              "lora_add runs on CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat &&
              bt.scalar_type() == at::kFloat, "x, y, a and bt must be float32");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "x and y must be [T, in] and [T, out]");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "x and y must be contiguous along a row");
  TORCH_CHECK(a.dim() == 3 && bt.dim() == 3 && a.is_contiguous() && bt.is_contiguous(),
              "a and bt must be contiguous [S, N*R, in] and [S, R, out]");
  TORCH_CHECK(a.size(2) == x.size(1) && bt.size(2) == y.size(1) && a.size(0) == bt.size(0),
              "a ", a.sizes(), " and bt ", bt.sizes(), " do not fit x ", x.sizes(), " and y ", y.sizes());
  const int64_t N = static_cast<int64_t>(bounds.size()) - 1;
  TORCH_CHECK(N >= 1 && a.size(1) == N * bt.size(1), "a's rows must be ", N, " slices of bt's rank ", bt.size(1));
  TORCH_CHECK(bounds.front() == 0 && bounds.back() == y.size(1), "bounds must run from 0 to y's width");
  for (int64_t i = 0; i < N; ++i) TORCH_CHECK(bounds[i] < bounds[i + 1], "bounds must increase");
  TORCH_CHECK(slots.scalar_type() == at::kInt && slots.dim() == 1 && slots.size(0) == x.size(0) &&
              slots.is_contiguous(), "slots must be a contiguous int32 [T] tensor");
  TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.dim() == 1 && ranks.size(0) == a.size(0) &&
              ranks.is_contiguous(), "ranks must be a contiguous int32 [S] tensor");
  const int32_t* r = ranks.data_ptr<int32_t>();
  for (int64_t s = 0; s < a.size(0); ++s) {
    TORCH_CHECK(r[s] >= 0 && r[s] <= bt.size(1), "ranks holds ", r[s], ", outside [0, ", bt.size(1), "]");
  }
}

}  // namespace

at::Tensor lora_add(at::Tensor y, at::Tensor x, at::Tensor slots, at::Tensor ranks, at::Tensor a, at::Tensor bt,
                    std::vector<int64_t> bounds) {
  check_lora_args(y, x, slots, ranks, a, bt, bounds);
  const int64_t T = x.size(0), IN = x.size(1), OUT = y.size(1), R = bt.size(1), K = a.size(1);
  const int64_t N = static_cast<int64_t>(bounds.size()) - 1;
  const std::vector<LoraRun> runs = lora_runs(slots.data_ptr<int32_t>(), T, ranks.data_ptr<int32_t>(), a.size(0));
  if (runs.empty()) return y;
  int64_t rows = 0;
  for (const LoraRun& run : runs) rows += run.end - run.begin;
  const float* xs = x.data_ptr<float>();
  const float* as = a.data_ptr<float>();
  const float* bs = bt.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const int64_t sx = x.stride(0), sy = y.stride(0);
  std::vector<float> v(static_cast<size_t>(T * K));  // v[t, i*R + r]; only adapted rows' ranks are set

  // shrink: one task per (run, slice, kRowTile rows of A); A's rows are read once for all
  // the run's rows, kTokenTile rows of x at a time
  const int64_t num_runs = static_cast<int64_t>(runs.size());
  const int64_t row_tiles = (R + kRowTile - 1) / kRowTile;  // per slice
  const int64_t tasks_per_run = N * row_tiles;
  const int64_t shrink_grain =
      std::max<int64_t>(1, kMinTaskMacs * num_runs / std::max<int64_t>(1, rows * IN * kRowTile));
  at::parallel_for(0, num_runs * tasks_per_run, shrink_grain, [&](int64_t begin, int64_t end) {
    float out[kRowTile * kTokenTile];
    for (int64_t task = begin; task < end; ++task) {
      const LoraRun& run = runs[task / tasks_per_run];
      const int64_t i = (task % tasks_per_run) / row_tiles, r0 = (task % row_tiles) * kRowTile;
      if (r0 >= run.rank) continue;  // zero padding up to R
      const int64_t kr = std::min(kRowTile, run.rank - r0), k0 = i * R + r0;
      const float* a_rows = as + (run.slot * K + k0) * IN;
      for (int64_t t = run.begin; t < run.end; t += kTokenTile) {
        const int64_t nt = std::min(kTokenTile, run.end - t);
        dot_tile(a_rows, xs + t * sx, sx, kr, nt, IN, out);
        for (int64_t k = 0; k < kr; ++k)
          for (int64_t j = 0; j < nt; ++j) v[(t + j) * K + k0 + k] = out[k * nt + j];
      }
    }
  });

  // expand: one task per block of output columns inside one slice, every run in it
  std::vector<int64_t> starts, slices;  // each block's first column and its slice
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t o = bounds[i]; o < bounds[i + 1]; o += kColumnBlock) {
      starts.push_back(o);
      slices.push_back(i);
    }
  }
  const int64_t num_blocks = static_cast<int64_t>(starts.size());
  const int64_t expand_grain = std::max<int64_t>(1, kMinTaskMacs / std::max<int64_t>(1, rows * R * kColumnBlock));
  at::parallel_for(0, num_blocks, expand_grain, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t i = slices[block], o0 = starts[block];
      const int64_t o1 = std::min(o0 + kColumnBlock, bounds[i + 1]);
      for (const LoraRun& run : runs) {
        const float* b = bs + run.slot * R * OUT;
        int64_t t = run.begin;
        for (; t + 2 <= run.end; t += 2) {
          expand_rows<2>(v.data() + t * K + i * R, K, b, OUT, run.rank, o0, o1, ys + t * sy, sy);
        }
        if (t < run.end) expand_rows<1>(v.data() + t * K + i * R, K, b, OUT, run.rank, o0, o1, ys + t * sy, sy);
      }
    }
  });
  return y;
}
