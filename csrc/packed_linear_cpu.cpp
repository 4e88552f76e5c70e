// Small-M fp32 linear layers on the CPU: y = x W^T + b for x [M, K] with M = tree nodes x batch (1..64),
// W stored fp32 (the model) or bf16 (draft heads; accumulation stays fp32).
//
// Decoding and tree verification on a CPU are bound by streaming the weights from DRAM (every weight
// is used M times per step). MKL's sgemm reaches only ~40-100 GFLOP/s at M = 2..16 on a 2-core
// Sapphire Rapids, so a 16-node verify step costs 2-3 single-token steps instead of ~1.2. Here:
//  - the weight is packed once into column panels: packed[p][k][c] = W[64 p + c, k] (N padded to a
//    multiple of 64 with zeros), so each panel is one contiguous K x 256-byte stream;
//  - an AVX-512 micro-kernel keeps up to 6 rows x 64 columns of fp32 accumulators in 24 zmm
//    registers, loads each panel row once per 6 rows of x (the panel stays in L2 between row groups)
//    and broadcasts x[m, k];
//  - panels are split across threads (at::parallel_for: needs -fopenmp at build time, see setup.py;
//    without it the loop silently runs on one core at half the DRAM bandwidth).
// Every output y[m, n] is the in-order FMA chain over k = 0..K-1, whatever M and the thread split:
// the same hidden state gives bit-identical logits in a 1-token step and inside a 16-node tree.
// Machines without AVX-512 run a portable loop with the same order (correct, not fast: the Python
// side enables packing only where torch reports AVX-512).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "cpu_features.h"
#include "panel_loop.h"
#include "step_kernels.h"

namespace hydra_kernels {
namespace {

constexpr int64_t kPanel = kPanelColumns;  // columns per panel: 4 zmm registers of 16 floats
constexpr int kRows = 6;        // rows of x per micro-kernel call: 6 x 4 = 24 accumulators

// Weight element -> fp32. bf16 is the high half of an fp32, so the conversion is exact.
inline float to_float(float w) { return w; }
inline float to_float(c10::BFloat16 w) { return static_cast<float>(w); }

// Portable reference order: y[m, c] = bias[c] + sum_k x[m, k] * panel[k, c], k ascending, fused multiply-add.
template <typename W>
void panel_rows_portable(const float* x, int64_t ldx, int rows, const W* panel, int64_t K, const float* bias,
                         float* y, int64_t ldy, int ncols) {
  for (int m = 0; m < rows; ++m)
    for (int c = 0; c < ncols; ++c) {
      float acc = bias ? bias[c] : 0.0f;
      for (int64_t k = 0; k < K; ++k) acc = __builtin_fmaf(x[m * ldx + k], to_float(panel[k * kPanel + c]), acc);
      y[m * ldy + c] = acc;
    }
}

#ifdef HK_X86
// 16 weights of a panel row -> 16 fp32 lanes. bf16 -> fp32 is a zero-extend and a 16-bit shift (AVX-512F
// only, no AVX512-BF16 needed), so both storage types share one FMA loop.
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int R, typename W>
__attribute__((target("avx512f"))) void panel_rows_avx512(const float* x, int64_t ldx, const W* panel, int64_t K,
                                                           const float* bias, float* y, int64_t ldy, int ncols) {
  // a panel row is 64 weights: 256 bytes in fp32 (4 cache lines), 128 in bf16 (2 lines)
  constexpr int kLines = static_cast<int>(kPanel * sizeof(W) / 64);
  constexpr int kPerLine = static_cast<int>(64 / sizeof(W));
  // prefetch 4 KB ahead whatever the storage type (16 fp32 rows, 32 bf16 rows)
  constexpr int64_t kAhead = 4096 / (kPanel * static_cast<int64_t>(sizeof(W)));
  __m512 acc[R][4];
  for (int j = 0; j < 4; ++j) {
    __m512 b = bias ? _mm512_loadu_ps(bias + 16 * j) : _mm512_setzero_ps();
    for (int m = 0; m < R; ++m) acc[m][j] = b;
  }
  for (int64_t k = 0; k < K; ++k) {
    const W* row = panel + k * kPanel;
    // every cache line of the panel row 4 KB ahead: the stream stays ahead of the FMAs
    // (measured on 2 cores, fp32: M = 6 at ~1.1x the M = 1 time; with half the lines prefetched ~1.5x)
    for (int j = 0; j < kLines; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(row + kAhead * kPanel + kPerLine * j), _MM_HINT_T0);
    const __m512 w0 = load16(row), w1 = load16(row + 16), w2 = load16(row + 32), w3 = load16(row + 48);
    for (int m = 0; m < R; ++m) {
      const __m512 a = _mm512_set1_ps(x[m * ldx + k]);
      acc[m][0] = _mm512_fmadd_ps(a, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(a, w1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(a, w2, acc[m][2]);
      acc[m][3] = _mm512_fmadd_ps(a, w3, acc[m][3]);
    }
  }
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < 4; ++j) {
      const int left = ncols - 16 * j;
      if (left >= 16) {
        _mm512_storeu_ps(y + m * ldy + 16 * j, acc[m][j]);
      } else if (left > 0) {
        _mm512_mask_storeu_ps(y + m * ldy + 16 * j, static_cast<__mmask16>((1u << left) - 1u), acc[m][j]);
      }
    }
}

template <typename W>
using PanelFn = void (*)(const float*, int64_t, const W*, int64_t, const float*, float*, int64_t, int);
template <typename W>
constexpr PanelFn<W> kAvx512[kRows + 1] = {nullptr,
                                           panel_rows_avx512<1, W>,
                                           panel_rows_avx512<2, W>,
                                           panel_rows_avx512<3, W>,
                                           panel_rows_avx512<4, W>,
                                           panel_rows_avx512<5, W>,
                                           panel_rows_avx512<6, W>};

#endif

// w [N, K] fp32 (any strides) -> packed [P, K, 64], P = ceil(N / 64), zero columns past N; stored fp32, or
// bf16 (rounded to nearest even) for weights whose exact values do not matter (the draft heads): half the
// bytes to stream, and a 16k-row draft LM head (19 MB) then stays in a 32 MB L3 across a step's heads.
at::Tensor pack_linear_weight_cpu(const at::Tensor& w, std::optional<at::ScalarType> dtype) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "pack_linear_weight: weight must be fp32 [N, K], got ",
              w.scalar_type(), " ", w.sizes());
  const at::ScalarType st = dtype.value_or(at::kFloat);
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16, "pack_linear_weight: dtype must be torch.float32 or ",
              "torch.bfloat16, got ", st);
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({P, K, kPanel}, w.options().dtype(st));
  // one transposed copy per panel: rows [64 p, 64 p + 64) of W become the panel's columns
  for (int64_t p = 0; p < P; ++p) {
    const int64_t n0 = p * kPanel, n = std::min(kPanel, N - n0);
    packed[p].narrow(1, 0, n).copy_(w.narrow(0, n0, n).t());
  }
  return packed;
}

template <typename W>
void packed_linear_panels(const float* xp, int64_t M, int64_t K, const W* wp, int64_t N, const float* bp, float* yp) {
  const bool fast = cpu_has_avx512();
  for_each_panel_tile(M, N, bp, kRows, [&](int64_t p, int64_t m0, int rows, int64_t n0, int ncols, const float* pb,
                                           int /*half: whole panels here*/) {
    const W* panel = wp + p * K * kPanel;
#ifdef HK_X86
    if (fast) return kAvx512<W>[rows](xp + m0 * K, K, panel, K, pb, yp + m0 * N + n0, N, ncols);
#endif
    panel_rows_portable(xp + m0 * K, K, rows, panel, K, pb, yp + m0 * N + n0, N, ncols);
  });
}

at::Tensor packed_linear_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                             const std::optional<at::Tensor>& bias) {
  const at::ScalarType wt = packed.scalar_type();
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && (wt == at::kFloat || wt == at::kBFloat16) &&
                  packed.is_contiguous(),
              "packed_linear: packed must come from pack_linear_weight (fp32 or bf16 [P, K, 64], contiguous)");
  const int64_t P = packed.size(0), K = packed.size(1);
  TORCH_CHECK(N > (P - 1) * kPanel && N <= P * kPanel, "packed_linear: N=", N, " does not match ", P, " panels");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) == K, "packed_linear: x must be fp32 [..., K=",
              K, "], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat),
              "packed_linear: bias must be fp32 [N=", N, "]");
  at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y.view(out_sizes);
  at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (wt == at::kFloat) {
    packed_linear_panels(x2.data_ptr<float>(), M, K, packed.data_ptr<float>(), N, bp, y.data_ptr<float>());
  } else {
    packed_linear_panels(x2.data_ptr<float>(), M, K, packed.data_ptr<c10::BFloat16>(), N, bp, y.data_ptr<float>());
  }
  return y.view(out_sizes);
}

bool packed_linear_is_fast_cpu() { return cpu_has_avx512(); }

}  // namespace

void packed_linear_into(const float* x, int64_t M, const at::Tensor& packed, int64_t N, const float* bias, float* y) {
  const at::ScalarType wt = packed.scalar_type();
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && (wt == at::kFloat || wt == at::kBFloat16) &&
                  packed.is_contiguous() && N > (packed.size(0) - 1) * kPanel && N <= packed.size(0) * kPanel,
              "packed_linear: packed must come from pack_linear_weight (fp32 or bf16 [P, K, 64], contiguous) for N=", N);
  if (M == 0) return;
  if (wt == at::kFloat)
    packed_linear_panels(x, M, packed.size(1), packed.data_ptr<float>(), N, bias, y);
  else
    packed_linear_panels(x, M, packed.size(1), packed.data_ptr<c10::BFloat16>(), N, bias, y);
}

TORCH_LIBRARY_FRAGMENT(hydra_kernels, m) {
  m.def("pack_linear_weight(Tensor weight, ScalarType? dtype=None) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int N, Tensor? bias=None) -> Tensor");
  m.def("packed_linear_is_fast() -> bool", &packed_linear_is_fast_cpu);  // no tensor argument: a catch-all kernel
}

TORCH_LIBRARY_IMPL(hydra_kernels, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight_cpu);
  m.impl("packed_linear", &packed_linear_cpu);
}

}  // namespace hydra_kernels
