// Small-M linear layers on the CPU over quantized weights, with the activations quantized to int8 and the products
// summed in integers (AVX-512 VNNI's vpdpbusd: 64 byte products a instruction): y = x W^T + b, x fp32 [M, K].
//
// Why: the exact kernel (quantized_linear_cpu.cpp) turns every weight into fp32 in registers and runs one fp32 FMA
// per weight and row. On this VM's 2 cores that arithmetic, not the bytes, is what a step pays: a SmolLM2 layer's
// projections on weights already in cache take about as long as streaming them, and every drafted row of a verify
// step adds ~1.5 ms to a ~6.6 ms plain step (2026-11-29, EPYC VM, benchmarks/bench_verify_step.py). Here a weight
// is unpacked once a tile (a nibble mask or a plain load) and each row adds one vpdpbusd per 64 products. This is
// llama.cpp's scheme on the CPU (its Q8 activation blocks): the model is then a slightly different model from the
// fp32 one (each activation group rounded to 8 bits), which is why the Python side makes it a choice
// (Llama.use_int8_activations) rather than a silent replacement of the exact kernel.
//
// The definition (ops/reference.py: int8_dot_linear), per row m and weight group g of G inputs (the weight's
// groups: w[n, k] = s[n, g] q[n, k] (+ o[n, g])):
//   a = max_k |x[m, k]| over the group; d = a / 127; xq[m, k] = nearbyint(x[m, k] * (127 / a)) clamped to
//   [-127, 127]; all 0 where 127 / a is not finite (a = 0, or a below ~3.7e-37); a group with an inf or a NaN input:
//   xq all 0 and d = NaN (its row's outputs NaN, as the exact kernel's would be); xs = sum_k xq[m, k];
//   isum[n] = sum_k q[n, k] xq[m, k] (integers: exact);
//   then, g ascending from acc = bias[n] (or 0): acc = fma(s[n, g] * d, isum[n], acc), and with an offset
//   acc = fma(o[n, g], d * xs, acc).
// Every product and sum above is fixed by the definition (the integer sums are exact, the fp32 steps run in this
// order on every path), so a row's output does not depend on M, on the row tiling, on the thread split or on the
// ISA: a token's logits are the same alone and in a verify tree, and speculative decoding stays plain decoding.
//
// Layout (pack_int8_dot_weight): uint8 [P, 2, NG, GB]: panels of 64 output rows as the exact kernel's (the threads
// split them the same way: panel_loop.h), each panel two halves of 32 columns stored one after the other, so a half
// streams contiguous memory (interleaved halves cost the 8-bit LM head ~25% at M = 1: 2026-11-29, EPYC VM). A half's
// group of G inputs is GB bytes: the header [s: 32][o: 32, only with an offset] (fp16 or fp32), then the inputs in
// quads of 4 (G % 4 == 0), each quad 32 columns x 4 inputs, a 32-bit lane holding one column's 4 inputs (vpdpbusd's
// operand):
//   8-bit: 2 lines of 64 bytes; line v, byte 4c + t = q[16v + c][4j + t] + 128 (biased to unsigned: the sum then
//          carries 128 xs too, taken off per group);
//   4-bit: 1 line of 64 bytes; byte 4c + t: low nibble q[c][4j + t], high nibble q[16 + c][4j + t].
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "cpu_features.h"
#include "panel_loop.h"
#include "step_kernels.h"

#ifdef HK_X86
#include <immintrin.h>
#endif

namespace hydra_kernels {
namespace {

constexpr int64_t kPanel = kPanelColumns, kHalf = kPanelColumns / 2;

enum DotIsa : int64_t { kDotAuto = 0, kDotPortable = 1, kDotAvx2 = 2, kDotVnni = 3 };

struct DotLayout {
  int bits;
  bool offset, half;
  int64_t G, NG, GB, header;
  int64_t K() const { return NG * G; }
  int64_t quad_bytes() const { return kHalf * 4 * bits / 8; }
  int64_t half_bytes() const { return NG * GB; }
};

DotLayout dot_layout_of(const at::Tensor& packed, int64_t bits, bool offset, bool half) {
  TORCH_CHECK(bits == 4 || bits == 8, "int8_dot_linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "int8_dot_linear: packed must come from pack_int8_dot_weight (uint8 [P, 2, K/G, group bytes], ",
              "contiguous), got ", packed.scalar_type(), " ", packed.sizes());
  DotLayout l;
  l.bits = static_cast<int>(bits);
  l.offset = offset;
  l.half = half;
  l.NG = packed.size(2);
  l.GB = packed.size(3);
  l.header = kHalf * (half ? 2 : 4) * (offset ? 2 : 1);
  const int64_t qbytes = l.GB - l.header;
  TORCH_CHECK(qbytes > 0 && qbytes % l.quad_bytes() == 0, "int8_dot_linear: a group of ", l.GB,
              " bytes does not fit bits=", bits, ", offset=", offset, ", half_scales=", half);
  l.G = 4 * (qbytes / l.quad_bytes());
  return l;
}

inline float stored_scale(const uint8_t* grp, const DotLayout& l, int64_t idx) {
  if (l.half) return c10::detail::fp16_ieee_to_fp32_value(reinterpret_cast<const uint16_t*>(grp)[idx]);
  return reinterpret_cast<const float*>(grp)[idx];
}

// One row's activations, quantized per weight group (the definition above): xq int8 [K] as int32 quads (4 inputs a
// lane, vpdpbusd's broadcast operand), d [NG], d * xs [NG] (the offset's factor) and xs [NG] (the 8-bit bias fix).
struct QuantizedRow {
  const int32_t* quads;
  const float* d;
  const float* dxs;
  const int32_t* xs;
};

// A group's scale from a = max |x| (finite: no inf or NaN input): writes d = a / 127 (NaN without a finite input) and
// returns 127 / a, or 0 where the group has no finite scale (an inf or NaN input, or 127 / a not finite), its xq then
// zeros. Every path's quantizer decides these cases here, so they agree on them.
inline float group_scale(float a, bool finite, int64_t G, int8_t* xq, float* d) {
  *d = finite ? a / 127.0f : std::numeric_limits<float>::quiet_NaN();
  const float inv = 127.0f / a;
  if (!finite || !(inv <= std::numeric_limits<float>::max())) {
    std::memset(xq, 0, G);
    return 0.0f;
  }
  return inv;
}

// One group's quantization (the definition above), the portable loop: a = max |x|, xq = nearbyint(x * (127 / a))
// clamped to [-127, 127]; returns xs = sum xq and writes d = a / 127. The cases with no finite scale first: an inf
// or NaN input (|x| <= FLT_MAX fails) -> d = NaN; 127 / a not finite -> xq = 0 (and d = a / 127).
int32_t quantize_group(const float* xg, int64_t G, int8_t* xq, float* d) {
  float a = 0.0f;
  bool finite = true;
  for (int64_t k = 0; k < G; ++k) {
    const float v = std::fabs(xg[k]);
    finite = finite && v <= std::numeric_limits<float>::max();
    a = std::max(a, v);
  }
  const float inv = group_scale(a, finite, G, xq, d);
  if (inv == 0.0f) return 0;
  int32_t sum = 0;
  for (int64_t k = 0; k < G; ++k) {
    const float r = std::nearbyint(xg[k] * inv);  // round half to even (the default rounding mode)
    const int v = static_cast<int>(std::min(127.0f, std::max(-127.0f, r)));
    xq[k] = static_cast<int8_t>(v);
    sum += v;
  }
  return sum;
}

#ifdef HK_X86
// The same for G % 16 == 0 in AVX-512: the same non-finite cases first; then max is exact in any order; x * inv is
// the same IEEE product (finite, |x * inv| <= 127 and a bit); vcvtps2dq rounds by MXCSR, half to even by default, as
// nearbyint; the clamp of the rounded value then the saturating pack give the same integers. So the values equal the loop's (the VNNI path uses this, the portable path the loop: the tests'
// VNNI-vs-portable comparison checks it). ~10x the loop, which ran on one thread while the other waited: 0.8 ms of
// a 6-row verify step (2026-11-29, EPYC VM, perf).
__attribute__((target("avx512f,avx512bw"))) int32_t quantize_group_avx512(const float* xg, int64_t G, int8_t* xq,
                                                                          float* d) {
  const __m512 big = _mm512_set1_ps(std::numeric_limits<float>::max());
  __m512 m = _mm512_setzero_ps();
  __mmask16 bad = 0;  // an inf or NaN input: |x| <= FLT_MAX fails (unordered for NaN)
  for (int64_t k = 0; k < G; k += 16) {
    const __m512 v = _mm512_abs_ps(_mm512_loadu_ps(xg + k));
    bad |= _mm512_cmp_ps_mask(v, big, _CMP_NLE_UQ);
    m = _mm512_max_ps(m, v);
  }
  const float a = _mm512_reduce_max_ps(m);  // exact in any order (no NaN reaches here that counts: bad says so)
  const float inv_s = group_scale(a, bad == 0, G, xq, d);
  if (inv_s == 0.0f) return 0;
  const __m512 inv = _mm512_set1_ps(inv_s);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t k = 0; k < G; k += 16) {
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + k), inv));
    v = _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);
    sum = _mm512_add_epi32(sum, v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + k), _mm512_cvtsepi32_epi8(v));
  }
  return _mm512_reduce_add_epi32(sum);
}

// The same in AVX2 for G % 8 == 0 (the same argument: exact max, the same product, vcvtps2dq's rounding, the clamp).
__attribute__((target("avx2,fma"))) int32_t quantize_group_avx2(const float* xg, int64_t G, int8_t* xq, float* d) {
  const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(std::numeric_limits<float>::max());
  __m256 m = _mm256_setzero_ps();
  int bad = 0;  // an inf or NaN input: |x| <= FLT_MAX fails (unordered for NaN)
  for (int64_t k = 0; k < G; k += 8) {
    const __m256 v = _mm256_andnot_ps(sign, _mm256_loadu_ps(xg + k));
    bad |= _mm256_movemask_ps(_mm256_cmp_ps(v, big, _CMP_NLE_UQ));
    m = _mm256_max_ps(m, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float a = 0.0f;
  for (float v : lanes) a = std::max(a, v);
  const float inv_s = group_scale(a, bad == 0, G, xq, d);
  if (inv_s == 0.0f) return 0;
  const __m256 inv = _mm256_set1_ps(inv_s);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i sum = _mm256_setzero_si256();
  alignas(32) int32_t v32[8];
  for (int64_t k = 0; k < G; k += 8) {
    __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + k), inv));
    v = _mm256_min_epi32(_mm256_max_epi32(v, lo), hi);
    sum = _mm256_add_epi32(sum, v);
    _mm256_store_si256(reinterpret_cast<__m256i*>(v32), v);
    for (int i = 0; i < 8; ++i) xq[k + i] = static_cast<int8_t>(v32[i]);
  }
  _mm256_store_si256(reinterpret_cast<__m256i*>(v32), sum);
  int32_t total = 0;
  for (int32_t v : v32) total += v;
  return total;
}
#endif

// One row's activations, per weight group: xq, d, d * xs (the offset's factor) and xs (the 8-bit bias fix).
void quantize_row(const float* x, const DotLayout& l, DotIsa isa, int8_t* xq, float* d, float* dxs, int32_t* xs) {
  for (int64_t g = 0; g < l.NG; ++g) {
#ifdef HK_X86
    if (isa == kDotVnni && l.G % 16 == 0)
      xs[g] = quantize_group_avx512(x + g * l.G, l.G, xq + g * l.G, d + g);
    else if (isa == kDotAvx2 && l.G % 8 == 0)
      xs[g] = quantize_group_avx2(x + g * l.G, l.G, xq + g * l.G, d + g);
    else
#endif
      xs[g] = quantize_group(x + g * l.G, l.G, xq + g * l.G, d + g);
    dxs[g] = d[g] * static_cast<float>(xs[g]);
  }
}

// ---- the portable path: the definition, column by column ------------------------------------------------------
// q[c][k] of a half's group (c < 32)
inline int weight_q(const uint8_t* qd, const DotLayout& l, int64_t k, int64_t c) {
  const int64_t j = k / 4, t = k % 4;
  if (l.bits == 8) return static_cast<int>(qd[j * 128 + (c / 16) * 64 + 4 * (c % 16) + t]) - 128;
  const uint8_t b = qd[j * 64 + 4 * (c % 16) + t];
  return c >= 16 ? (b >> 4) : (b & 0x0F);
}

// columns [c0, c1) of a panel (its halves at `panel` and `panel + half_bytes`)
void panel_rows_portable(const QuantizedRow* rows, int R, const uint8_t* panel, const DotLayout& l, const float* bias,
                         float* y, int64_t ldy, int c0, int c1) {
  for (int m = 0; m < R; ++m)
    for (int c = c0; c < c1; ++c) {
      const int8_t* xq = reinterpret_cast<const int8_t*>(rows[m].quads);  // the row's inputs, one byte each
      const uint8_t* half = panel + (c / kHalf) * l.half_bytes();
      const int64_t hc = c % kHalf;
      float acc = bias ? bias[c] : 0.0f;
      for (int64_t g = 0; g < l.NG; ++g) {
        const uint8_t* grp = half + g * l.GB;
        const uint8_t* qd = grp + l.header;
        int32_t isum = 0;
        for (int64_t k = 0; k < l.G; ++k) isum += weight_q(qd, l, k, hc) * xq[g * l.G + k];
        const float dg = rows[m].d[g];
        acc = __builtin_fmaf(stored_scale(grp, l, hc) * dg, static_cast<float>(isum), acc);
        if (l.offset) acc = __builtin_fmaf(stored_scale(grp, l, kHalf + hc), rows[m].dxs[g], acc);
      }
      y[m * ldy + c] = acc;
    }
}

#ifdef HK_X86
// ---- AVX-512 VNNI: up to 6 rows x one half panel (32 columns: 2 zmm of int32 sums and 2 of fp32 accumulators a
// row, 24 registers at 6 rows) ---------------------------------------------------------------------------------
__attribute__((target("avx512f"))) inline __m512 load_scales16(const uint8_t* grp, bool half, int64_t idx) {
  if (half) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 2 * idx)));
  return _mm512_loadu_ps(reinterpret_cast<const float*>(grp) + idx);
}

template <int R, int BITS, bool OFF>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void half_panel_vnni(const QuantizedRow* rows,
                                                                            const uint8_t* panel, const DotLayout& l,
                                                                            int h, const float* bias, float* y,
                                                                            int64_t ldy, int ncols) {
  constexpr int64_t kAhead = 1024;  // prefetch distance in the half's stream
  const int64_t c0 = kHalf * h, qb = l.quad_bytes();
  panel += h * l.half_bytes();
  __m512 acc[R][2];
  for (int v = 0; v < 2; ++v) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + c0 + 16 * v) : _mm512_setzero_ps();
    for (int m = 0; m < R; ++m) acc[m][v] = b;
  }
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int64_t QG = l.G / 4;  // quads a group
  for (int64_t g = 0; g < l.NG; ++g) {
    const uint8_t* grp = panel + g * l.GB;
    const uint8_t* qd = grp + l.header;
    __m512i isum[R][2];
    for (int m = 0; m < R; ++m) isum[m][0] = isum[m][1] = _mm512_setzero_si512();
    for (int64_t j = 0; j < QG; ++j) {
      __m512i w[2];
      if (BITS == 4) {
        const uint8_t* line = qd + j * qb;
        _mm_prefetch(reinterpret_cast<const char*>(line + kAhead), _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512(line);
        w[0] = _mm512_and_si512(v, low4);
        w[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      } else {
        const uint8_t* line = qd + j * qb;
        _mm_prefetch(reinterpret_cast<const char*>(line + kAhead), _MM_HINT_T0);
        w[0] = _mm512_loadu_si512(line);
        w[1] = _mm512_loadu_si512(line + 64);
      }
      for (int m = 0; m < R; ++m) {
        const __m512i xb = _mm512_set1_epi32(rows[m].quads[g * QG + j]);
        isum[m][0] = _mm512_dpbusd_epi32(isum[m][0], w[0], xb);
        isum[m][1] = _mm512_dpbusd_epi32(isum[m][1], w[1], xb);
      }
    }
    for (int v = 0; v < 2; ++v) {
      const __m512 s = load_scales16(grp, l.half, 16 * v);
      const __m512 o = OFF ? load_scales16(grp, l.half, kHalf + 16 * v) : _mm512_setzero_ps();
      for (int m = 0; m < R; ++m) {
        __m512i is = isum[m][v];
        if (BITS == 8) is = _mm512_sub_epi32(is, _mm512_set1_epi32(128 * rows[m].xs[g]));  // the +128 bias
        const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(rows[m].d[g]));
        acc[m][v] = _mm512_fmadd_ps(sd, _mm512_cvtepi32_ps(is), acc[m][v]);
        if (OFF) acc[m][v] = _mm512_fmadd_ps(o, _mm512_set1_ps(rows[m].dxs[g]), acc[m][v]);
      }
    }
  }
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < 2; ++v) {
      const int left = ncols - static_cast<int>(c0) - 16 * v;
      if (left >= 16)
        _mm512_storeu_ps(y + m * ldy + c0 + 16 * v, acc[m][v]);
      else if (left > 0)
        _mm512_mask_storeu_ps(y + m * ldy + c0 + 16 * v, static_cast<__mmask16>((1u << left) - 1u), acc[m][v]);
    }
}

using HalfPanelFn = void (*)(const QuantizedRow*, const uint8_t*, const DotLayout&, int, const float*, float*, int64_t,
                             int);

template <int BITS, bool OFF>
HalfPanelFn vnni_fn(int rows) {
  static constexpr HalfPanelFn table[7] = {nullptr,
                                           half_panel_vnni<1, BITS, OFF>,
                                           half_panel_vnni<2, BITS, OFF>,
                                           half_panel_vnni<3, BITS, OFF>,
                                           half_panel_vnni<4, BITS, OFF>,
                                           half_panel_vnni<5, BITS, OFF>,
                                           half_panel_vnni<6, BITS, OFF>};
  return table[rows];
}

HalfPanelFn pick_vnni(const DotLayout& l, int rows) {
  if (l.bits == 4) return l.offset ? vnni_fn<4, true>(rows) : vnni_fn<4, false>(rows);
  return l.offset ? vnni_fn<8, true>(rows) : vnni_fn<8, false>(rows);
}

// ---- AVX2 (no VNNI): vpmaddubsw (u8 x s8 -> pairs summed in int16) then vpmaddwd by ones (-> the 4-input lane sum in
// int32). Exact where no pair sum leaves int16: a 4-bit weight (<= 15) times |xq| <= 127, twice, is <= 3810. An 8-bit
// weight (stored q + 128, up to 255) could reach 64770, so it goes as its two nibbles, each a 4-bit product, the high
// one's sum times 16. 16 ymm registers: a quarter panel (16 columns: 2 ymm) at a time, up to 4 rows, the fp32
// accumulators in a small array on the stack (a row's 16 outputs, in L1), updated once a group in the definition's
// order, then copied to y.
__attribute__((target("avx2,fma,f16c"))) inline __m256 load_scales8(const uint8_t* grp, bool half, int64_t idx) {
  if (half) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grp + 2 * idx)));
  return _mm256_loadu_ps(reinterpret_cast<const float*>(grp) + idx);
}

template <int R, int BITS, bool OFF>
__attribute__((target("avx2,fma,f16c"))) void half_panel_avx2(const QuantizedRow* rows, const uint8_t* panel,
                                                              const DotLayout& l, int h, const float* bias, float* y,
                                                              int64_t ldy, int ncols) {
  const int64_t qb = l.quad_bytes(), QG = l.G / 4;
  panel += h * l.half_bytes();
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
  for (int u = 0; u < 2; ++u) {  // quarter u: the half's columns [16u, 16u + 16)
    const int c0 = kHalf * h + 16 * u, left = ncols - c0;
    if (left <= 0) break;
    alignas(32) float acc[R][16];
    for (int m = 0; m < R; ++m)
      for (int c = 0; c < 16; ++c) acc[m][c] = bias ? bias[c0 + c] : 0.0f;
    for (int64_t g = 0; g < l.NG; ++g) {
      const uint8_t* grp = panel + g * l.GB;
      const uint8_t* qd = grp + l.header;
      __m256i isum[R][2];
      for (int m = 0; m < R; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
      for (int64_t j = 0; j < QG; ++j) {
        // w[v]: columns 16u + 8v .. + 7, 4 inputs a lane (BITS 8: the low nibbles; hi: the high ones)
        __m256i w[2], wh[2];
        if (BITS == 4) {
          for (int v = 0; v < 2; ++v) {
            const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qd + j * qb + 32 * v));
            w[v] = u == 0 ? _mm256_and_si256(b, low4) : _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
          }
        } else {
          for (int v = 0; v < 2; ++v) {
            const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qd + j * qb + 64 * u + 32 * v));
            w[v] = _mm256_and_si256(b, low4);
            wh[v] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
          }
        }
        for (int m = 0; m < R; ++m) {
          const __m256i xb = _mm256_set1_epi32(rows[m].quads[g * QG + j]);
          for (int v = 0; v < 2; ++v) {
            __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(w[v], xb), ones);
            if (BITS == 8) s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(_mm256_maddubs_epi16(wh[v], xb), sixteen));
            isum[m][v] = _mm256_add_epi32(isum[m][v], s32);
          }
        }
      }
      for (int v = 0; v < 2; ++v) {
        const __m256 s = load_scales8(grp, l.half, 16 * u + 8 * v);
        const __m256 o = OFF ? load_scales8(grp, l.half, kHalf + 16 * u + 8 * v) : _mm256_setzero_ps();
        for (int m = 0; m < R; ++m) {
          __m256i is = isum[m][v];
          if (BITS == 8) is = _mm256_sub_epi32(is, _mm256_set1_epi32(128 * rows[m].xs[g]));  // the +128 bias
          __m256 a = _mm256_load_ps(acc[m] + 8 * v);
          a = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(rows[m].d[g])), _mm256_cvtepi32_ps(is), a);
          if (OFF) a = _mm256_fmadd_ps(o, _mm256_set1_ps(rows[m].dxs[g]), a);
          _mm256_store_ps(acc[m] + 8 * v, a);
        }
      }
    }
    for (int m = 0; m < R; ++m) std::memcpy(y + m * ldy + c0, acc[m], sizeof(float) * std::min(left, 16));
  }
}

template <int BITS, bool OFF>
HalfPanelFn avx2_fn(int rows) {
  static constexpr HalfPanelFn table[5] = {nullptr, half_panel_avx2<1, BITS, OFF>, half_panel_avx2<2, BITS, OFF>,
                                           half_panel_avx2<3, BITS, OFF>, half_panel_avx2<4, BITS, OFF>};
  return table[rows];
}

HalfPanelFn pick_avx2(const DotLayout& l, int rows) {
  if (l.bits == 4) return l.offset ? avx2_fn<4, true>(rows) : avx2_fn<4, false>(rows);
  return l.offset ? avx2_fn<8, true>(rows) : avx2_fn<8, false>(rows);
}
#endif

DotIsa resolve_dot_isa(int64_t isa) {
  TORCH_CHECK(isa >= kDotAuto && isa <= kDotVnni, "int8_dot_linear: isa must be 0 (auto), 1 (portable), 2 (AVX2) or ",
              "3 (AVX-512 VNNI), got ", isa);
  if (isa == kDotAuto) return cpu_has_avx512_vnni() ? kDotVnni : (cpu_has_avx2_fma() ? kDotAvx2 : kDotPortable);
  TORCH_CHECK(isa != kDotVnni || cpu_has_avx512_vnni(), "int8_dot_linear: this CPU has no AVX-512 VNNI (or HK_CPU_ISA ",
              "limits the kernels below it)");
  TORCH_CHECK(isa != kDotAvx2 || cpu_has_avx2_fma(), "int8_dot_linear: this CPU has no AVX2 + FMA (or HK_CPU_ISA ",
              "limits the kernels below it)");
  return static_cast<DotIsa>(isa);
}

constexpr int kTile = 6, kTileAvx2 = 4;  // rows a tile: the VNNI path's registers, the AVX2 path's

void dot_panels_into(const float* x, int64_t M, const uint8_t* wp, const DotLayout& l, int64_t N, const float* bias,
                     float* y, DotIsa isa) {
  const int64_t K = l.K(), NG = l.NG;
  // the quantized activations of all M rows, once a call (M x K bytes: a step's few rows, or a prefill chunk), in
  // the calling thread's scratch (kept between calls: no allocation, no zeroing a step). The worker threads reach it
  // through the pointers below: a thread_local named inside the lambdas would be each worker's own (empty) one.
  thread_local std::vector<int32_t> quads_buf, xs_buf;
  thread_local std::vector<float> d_buf, dxs_buf;
  if (quads_buf.size() < static_cast<size_t>(M * K / 4)) quads_buf.resize(M * K / 4);
  if (d_buf.size() < static_cast<size_t>(M * NG)) {
    d_buf.resize(M * NG);
    dxs_buf.resize(M * NG);
    xs_buf.resize(M * NG);
  }
  int32_t* const quads = quads_buf.data();
  int32_t* const xs = xs_buf.data();
  float* const d = d_buf.data();
  float* const dxs = dxs_buf.data();
  int8_t* const xq = reinterpret_cast<int8_t*>(quads);
  // a row is ~K cheap vector ops: a step's rows on this thread, a prefill chunk's split across the threads
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K)), [&](int64_t r0, int64_t r1) {
    for (int64_t m = r0; m < r1; ++m)
      quantize_row(x + m * K, l, isa, xq + m * K, d + m * NG, dxs + m * NG, xs + m * NG);
  });
  const int tile = isa == kDotAvx2 ? kTileAvx2 : kTile;
  for_each_panel_tile(M, N, bias, tile, [&](int64_t p, int64_t m0, int rows, int64_t n0, int ncols, const float* pb,
                                           int half) {
    QuantizedRow qr[kTile];
    for (int m = 0; m < rows; ++m) {
      const int64_t r = m0 + m;
      qr[m] = {quads + r * K / 4, d + r * NG, dxs + r * NG, xs + r * NG};
    }
    const uint8_t* panel = wp + p * 2 * l.half_bytes();
    float* yt = y + m0 * N + n0;
#ifdef HK_X86
    if (isa != kDotPortable) {  // the vector paths: one half panel a call
      const HalfPanelFn fn = isa == kDotVnni ? pick_vnni(l, rows) : pick_avx2(l, rows);
      if (half <= 0) fn(qr, panel, l, 0, pb, yt, N, ncols);
      if (half != 0 && ncols > 32) fn(qr, panel, l, 1, pb, yt, N, ncols);
      return;
    }
#endif
    const int c0 = half == 1 ? 32 : 0, c1 = half == 0 ? std::min(ncols, 32) : ncols;
    panel_rows_portable(qr, rows, panel, l, pb, yt, N, c0, c1);
  }, /*halves=*/true);
}

void check_dot_panel_count(const at::Tensor& packed, int64_t N) {
  const int64_t P = packed.size(0);
  TORCH_CHECK(N > (P - 1) * kPanel && N <= P * kPanel, "int8_dot_linear: N=", N, " does not match ", P, " panels");
}

// q int8 [N, K] (4 bits: 0..15), s fp32 [N, K/G], o fp32 [N, K/G] or None -> uint8 [P, 2, K/G, GB] (the layout above)
at::Tensor pack_int8_dot_weight_cpu(const at::Tensor& q, const at::Tensor& s, const std::optional<at::Tensor>& o,
                                    int64_t bits, bool half_scales) {
  // G % 4: the kernel sums 4 inputs a lane (the exact kernel, quantized_linear, takes other groups)
  const int64_t G = check_pack_arguments("pack_int8_dot_weight", q, s, o, bits, half_scales, 4);
  const int64_t N = q.size(0), K = q.size(1), NG = s.size(1);
  const at::Tensor sc = s.contiguous(), qc = q.contiguous();
  const at::Tensor oc = o.has_value() ? o->contiguous() : at::Tensor();
  const float* sp = sc.data_ptr<float>();
  const float* op = oc.defined() ? oc.data_ptr<float>() : nullptr;
  const int64_t header = kHalf * (half_scales ? 2 : 4) * (op ? 2 : 1), qb = kHalf * 4 * bits / 8;
  const int64_t GB = header + (G / 4) * qb, P = (N + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({P, 2, NG, GB}, q.options().dtype(at::kByte));
  uint8_t* out = packed.data_ptr<uint8_t>();
  const int8_t* qp = qc.data_ptr<int8_t>();
  const auto put = [half_scales](uint8_t* grp, int64_t idx, float v) {
    if (half_scales)
      reinterpret_cast<uint16_t*>(grp)[idx] = c10::Half(v).x;
    else
      reinterpret_cast<float*>(grp)[idx] = v;
  };
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t g = 0; g < NG; ++g) {
          uint8_t* grp = out + ((p * 2 + h) * NG + g) * GB;
          uint8_t* qd = grp + header;
          for (int64_t c = 0; c < kHalf; ++c) {
            const int64_t n = p * kPanel + h * kHalf + c;
            const bool real = n < N;  // padded columns: scale 0, q 0 (8-bit: stored 128)
            put(grp, c, real ? sp[n * NG + g] : 0.0f);
            if (op) put(grp, kHalf + c, real ? op[n * NG + g] : 0.0f);
            for (int64_t k = 0; k < G; ++k) {
              const int v = real ? qp[n * K + g * G + k] : 0;
              const int64_t j = k / 4, t = k % 4;
              if (bits == 8)
                qd[j * qb + (c / 16) * 64 + 4 * (c % 16) + t] = static_cast<uint8_t>(v + 128);
              else
                qd[j * qb + 4 * (c % 16) + t] |= static_cast<uint8_t>(v << (c >= 16 ? 4 : 0));
            }
          }
        }
  });
  return packed;
}

at::Tensor int8_dot_linear_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t bits, bool offset,
                               const std::optional<at::Tensor>& bias, int64_t isa_arg, bool half_scales) {
  const DotLayout l = dot_layout_of(packed, bits, offset, half_scales);
  check_dot_panel_count(packed, N);
  const int64_t K = l.K();
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) == K,
              "int8_dot_linear: x must be fp32 [..., K=", K, "], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat),
              "int8_dot_linear: bias must be fp32 [N=", N, "]");
  const DotIsa isa = resolve_dot_isa(isa_arg);
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y.view(out_sizes);
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  dot_panels_into(x2.data_ptr<float>(), M, packed.data_ptr<uint8_t>(), l, N, b.defined() ? b.data_ptr<float>() : nullptr,
                  y.data_ptr<float>(), isa);
  return y.view(out_sizes);
}

// 3: AVX-512 VNNI, 2: AVX2, 1: the portable loop (slow: a reference, not a path to run a model on)
int64_t int8_dot_linear_isa() { return resolve_dot_isa(kDotAuto); }

}  // namespace

void int8_dot_linear_into(const float* x, int64_t M, const at::Tensor& packed, int64_t N, int64_t bits, bool offset,
                          bool half_scales, const float* bias, float* y) {
  const DotLayout l = dot_layout_of(packed, bits, offset, half_scales);
  check_dot_panel_count(packed, N);
  if (M > 0) dot_panels_into(x, M, packed.data_ptr<uint8_t>(), l, N, bias, y, resolve_dot_isa(kDotAuto));
}

void check_int8_dot_panels(const at::Tensor& packed, int64_t N, int64_t K, int64_t bits, bool offset, bool half_scales) {
  const DotLayout l = dot_layout_of(packed, bits, offset, half_scales);
  check_dot_panel_count(packed, N);
  TORCH_CHECK(l.K() == K, "int8_dot_linear: the panels hold ", l.K(), " inputs a row, expected ", K);
}

TORCH_LIBRARY_FRAGMENT(hydra_kernels, m) {
  m.def("pack_int8_dot_weight(Tensor q, Tensor scales, Tensor? offsets, int bits, bool half_scales=False) -> Tensor");
  m.def("int8_dot_linear(Tensor x, Tensor packed, int N, int bits, bool offset, Tensor? bias=None, int isa=0, "
        "bool half_scales=False) -> Tensor");
  m.def("int8_dot_linear_isa() -> int", &int8_dot_linear_isa);
}

TORCH_LIBRARY_IMPL(hydra_kernels, CPU, m) {
  m.impl("pack_int8_dot_weight", &pack_int8_dot_weight_cpu);
  m.impl("int8_dot_linear", &int8_dot_linear_cpu);
}

}  // namespace hydra_kernels
