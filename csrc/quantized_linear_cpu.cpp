// Small-M linear layers on the CPU over weights kept as quantized blocks (the GGUF formats: 4 or 8 bits per
// weight plus a scale, and an offset, per group of G consecutive inputs): y = x W^T + b, x fp32 [M, K].
//
// What a weight is: w[n, k] = fma(s[n, g], q[n, k], o[n, g]) with g = k / G (q an integer, s and o fp32),
// or s[n, g] * q[n, k] when the format has no offset. The Python side (hydra_kernels/model/gguf_blocks.py)
// decodes each GGUF format into (q, s, o) so that this is exactly the fp32 value gguf's dequantize gives
// (for every format whose s * q is exact, one rounding either way: see gguf_blocks.py).
//
// The accumulation is the fp32 packed kernel's (packed_linear_cpu.cpp): y[m, n] = bias[n], then the in-order
// FMA chain over k = 0..K-1 of x[m, k] * w[n, k]. So this kernel's output is bit-identical to packed_linear
// on the dequantized weight, whatever M, the row tiling, the thread split or the ISA: a quantized model
// decodes exactly the tokens of the same model loaded in fp32, and a token's logits do not depend on how
// many rows share the step (speculative decoding stays plain decoding).
//
// Why: decoding on a CPU streams every weight once a token; fp32 panels are ~4 bytes a weight, these
// ~0.75 (4-bit, G = 32) or ~1.1 (8-bit). The weights are dequantized in registers, once per tile of up to
// 6 rows (AVX-512) or 3 rows (AVX2), so a T-node verify step dequantizes each block ceil(T / 6) times.
//
// Layout (pack_quantized_weight): output rows in panels of 64 (N padded with zero rows), each panel K / G
// groups, each group of GB bytes:
//   [s: 64 fp32 or fp16][o: 64 fp32 or fp16, only with an offset][q: G rows x 64 columns]
// fp16 (half_scales) where every scale and offset is an fp16 value: GGUF's Q4_0 / Q4_1 / Q5_x / Q8_0 store d and m as
// fp16, so the same exact values at half the header bytes (a Q4_1 group of 32 inputs: 5 bits a weight, not 6; the
// projections of a SmolLM2 step stream at this VM's DRAM rate, so bytes are time); converted in registers (vcvtph2ps,
// exact). The K-quants' scales are products (d * sub-block scale) that fp16 may not hold: fp32.
// q 8-bit: int8, row-major (k, then column). q 4-bit: unsigned nibbles 0..15, two rows a byte: byte
// (i, c) = q[2i][c] | q[2i + 1][c] << 4, so one 64-byte line holds two rows of the panel.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "cpu_features.h"
#include "panel_loop.h"
#include "step_kernels.h"

namespace hydra_kernels {
namespace {

constexpr int64_t kPanel = kPanelColumns;  // output rows (weight rows) per panel
// bytes of one vector of the panel's scales or offsets: fp32, or fp16 where every one is an fp16 value (GGUF's Q4_0, Q4_1,
// Q5_x and Q8_0 store fp16 d and m: half the header bytes, 1 bit a weight instead of 2, the same exact values)
constexpr int64_t header_bytes(bool half) { return kPanel * (half ? 2 : 4); }

enum Isa : int64_t { kAuto = 0, kPortable = 1, kAvx2 = 2, kAvx512 = 3 };

struct Layout {
  int bits;         // 4 or 8
  bool offset;      // o stored (w = fma(s, q, o)) or not (w = s * q)
  bool half;        // s and o stored fp16 (converted exactly in registers), else fp32
  int64_t G;        // inputs per group
  int64_t NG;       // groups per row: K = NG * G
  int64_t GB;       // bytes per group
  int64_t header;   // bytes before q in a group
  int64_t K() const { return NG * G; }
};

Layout layout_of(const at::Tensor& packed, int64_t bits, bool offset, bool half) {
  TORCH_CHECK(bits == 4 || bits == 8, "quantized_linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "quantized_linear: packed must come from pack_quantized_weight (uint8 [P, K/G, group bytes], "
              "contiguous), got ", packed.scalar_type(), " ", packed.sizes());
  Layout l;
  l.bits = static_cast<int>(bits);
  l.offset = offset;
  l.half = half;
  l.NG = packed.size(1);
  l.GB = packed.size(2);
  l.header = header_bytes(half) * (offset ? 2 : 1);
  const int64_t qbytes = l.GB - l.header, row_bytes = kPanel * bits / 8;
  TORCH_CHECK(qbytes > 0 && qbytes % row_bytes == 0, "quantized_linear: group of ", l.GB, " bytes does not fit bits=",
              bits, ", offset=", offset, ", half_scales=", half);
  l.G = qbytes / row_bytes;
  TORCH_CHECK(bits == 8 || l.G % 2 == 0, "quantized_linear: a 4-bit group must hold an even number of inputs");
  return l;
}

// ---- one weight, the definition every path computes ---------------------------------------------------------
inline float dequant(float s, float q, bool off, float o) { return off ? __builtin_fmaf(s, q, o) : s * q; }

// A group's scale or offset of column c, as stored: fp32, or fp16 (whose conversion to fp32 is exact)
inline float scale_at(const float* p, int64_t c) { return p[c]; }
inline float scale_at(const uint16_t* p, int64_t c) { return c10::detail::fp16_ieee_to_fp32_value(p[c]); }

inline int q_at(const uint8_t* qd, int bits, int64_t k, int64_t c) {
  if (bits == 8) return static_cast<int8_t>(qd[k * kPanel + c]);
  const uint8_t b = qd[(k / 2) * kPanel + c];
  return (k % 2 == 0) ? (b & 0x0F) : (b >> 4);
}

// Portable order: y[m, c] = bias[c], then fma(x[m, k], w[c, k], y[m, c]) for k ascending; columns [c0, c1).
template <typename S>
void panel_rows_portable(const float* x, int64_t ldx, int rows, const uint8_t* panel, const Layout& l,
                         const float* bias, float* y, int64_t ldy, int c0, int c1) {
  for (int m = 0; m < rows; ++m)
    for (int c = c0; c < c1; ++c) {
      float acc = bias ? bias[c] : 0.0f;
      for (int64_t g = 0; g < l.NG; ++g) {
        const uint8_t* grp = panel + g * l.GB;
        const S* s = reinterpret_cast<const S*>(grp);
        const uint8_t* qd = grp + l.header;
        for (int64_t k = 0; k < l.G; ++k) {
          const float w = dequant(scale_at(s, c), static_cast<float>(q_at(qd, l.bits, k, c)), l.offset,
                                  l.offset ? scale_at(s + kPanel, c) : 0.0f);
          acc = __builtin_fmaf(x[m * ldx + g * l.G + k], w, acc);
        }
      }
      y[m * ldy + c] = acc;
    }
}

#ifdef HK_X86
// ---- AVX-512: up to 6 rows x 64 columns of accumulators (24 zmm) ------------------------------------------
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <bool OFF, typename S>
__attribute__((target("avx512f"))) inline __m512 dequant16(const S* s, const S* o, __m512i q) {
  const __m512 qf = _mm512_cvtepi32_ps(q);
  return OFF ? _mm512_fmadd_ps(load16(s), qf, load16(o)) : _mm512_mul_ps(load16(s), qf);
}

// Columns [c0, c0 + 16 J) of the panel: J = 4 the whole panel (c0 = 0), J = 2 one half (c0 = 0 or 32; for_each_panel_tile
// hands a thread half a panel where the panels do not split evenly over the threads). A column's sum is the same either way.
template <int R, int BITS, bool OFF, int J, typename S>
__attribute__((target("avx512f"))) void panel_rows_avx512(const float* x, int64_t ldx, const uint8_t* panel,
                                                           const Layout& l, int64_t c0, const float* bias, float* y,
                                                           int64_t ldy, int ncols) {
  constexpr int64_t kAhead = 1024;  // prefetch distance in bytes of the panel stream (16 lines)
  __m512 acc[R][J];
  for (int j = 0; j < J; ++j) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + c0 + 16 * j) : _mm512_setzero_ps();
    for (int m = 0; m < R; ++m) acc[m][j] = b;
  }
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  for (int64_t g = 0; g < l.NG; ++g) {
    const uint8_t* grp = panel + g * l.GB;
    const S* s = reinterpret_cast<const S*>(grp) + c0;
    const S* o = s + kPanel;  // read only when OFF
    const uint8_t* qd = grp + l.header + c0;
    const float* xg = x + g * l.G;
    if (BITS == 4) {
      for (int64_t i = 0; i < l.G / 2; ++i) {  // rows 2i and 2i + 1 of the group: one 64-byte line
        const uint8_t* line = qd + i * kPanel;
        _mm_prefetch(reinterpret_cast<const char*>(line + kAhead), _MM_HINT_T0);
        for (int j = 0; j < J; ++j) {
          const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line + 16 * j)));
          const __m512 w0 = dequant16<OFF, S>(s + 16 * j, o + 16 * j, _mm512_and_si512(v, low4));
          const __m512 w1 = dequant16<OFF, S>(s + 16 * j, o + 16 * j, _mm512_srli_epi32(v, 4));
          for (int m = 0; m < R; ++m) {
            acc[m][j] = _mm512_fmadd_ps(_mm512_set1_ps(xg[m * ldx + 2 * i]), w0, acc[m][j]);
            acc[m][j] = _mm512_fmadd_ps(_mm512_set1_ps(xg[m * ldx + 2 * i + 1]), w1, acc[m][j]);
          }
        }
      }
    } else {
      for (int64_t k = 0; k < l.G; ++k) {
        const uint8_t* row = qd + k * kPanel;
        _mm_prefetch(reinterpret_cast<const char*>(row + kAhead), _MM_HINT_T0);
        for (int j = 0; j < J; ++j) {
          const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * j)));
          const __m512 w = dequant16<OFF, S>(s + 16 * j, o + 16 * j, v);
          for (int m = 0; m < R; ++m) acc[m][j] = _mm512_fmadd_ps(_mm512_set1_ps(xg[m * ldx + k]), w, acc[m][j]);
        }
      }
    }
  }
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < J; ++j) {
      const int left = ncols - static_cast<int>(c0) - 16 * j;
      if (left >= 16) {
        _mm512_storeu_ps(y + m * ldy + c0 + 16 * j, acc[m][j]);
      } else if (left > 0) {
        _mm512_mask_storeu_ps(y + m * ldy + c0 + 16 * j, static_cast<__mmask16>((1u << left) - 1u), acc[m][j]);
      }
    }
}

// ---- AVX2 + FMA: 16 ymm registers, so up to 3 rows x 32 columns (12 accumulators), one half-panel a call ----
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <bool OFF, typename S>
__attribute__((target("avx2,fma,f16c"))) inline __m256 dequant8(const S* s, const S* o, __m256i q) {
  const __m256 qf = _mm256_cvtepi32_ps(q);
  return OFF ? _mm256_fmadd_ps(load8(s), qf, load8(o)) : _mm256_mul_ps(load8(s), qf);
}

template <int R, int BITS, bool OFF, typename S>
__attribute__((target("avx2,fma,f16c"))) void half_panel_rows_avx2(const float* x, int64_t ldx, const uint8_t* panel,
                                                             const Layout& l, int64_t c0, const float* bias,
                                                             float* y, int64_t ldy, int ncols) {
  constexpr int64_t kAhead = 1024;
  __m256 acc[R][4];
  for (int j = 0; j < 4; ++j) {
    const __m256 b = bias ? _mm256_loadu_ps(bias + c0 + 8 * j) : _mm256_setzero_ps();
    for (int m = 0; m < R; ++m) acc[m][j] = b;
  }
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  for (int64_t g = 0; g < l.NG; ++g) {
    const uint8_t* grp = panel + g * l.GB;
    const S* s = reinterpret_cast<const S*>(grp) + c0;
    const S* o = s + kPanel;
    const uint8_t* qd = grp + l.header;
    const float* xg = x + g * l.G;
    if (BITS == 4) {
      for (int64_t i = 0; i < l.G / 2; ++i) {
        const uint8_t* line = qd + i * kPanel + c0;
        _mm_prefetch(reinterpret_cast<const char*>(line + kAhead), _MM_HINT_T0);
        for (int j = 0; j < 4; ++j) {
          const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(line + 8 * j)));
          const __m256 w0 = dequant8<OFF, S>(s + 8 * j, o + 8 * j, _mm256_and_si256(v, low4));
          const __m256 w1 = dequant8<OFF, S>(s + 8 * j, o + 8 * j, _mm256_srli_epi32(v, 4));
          for (int m = 0; m < R; ++m) {
            acc[m][j] = _mm256_fmadd_ps(_mm256_set1_ps(xg[m * ldx + 2 * i]), w0, acc[m][j]);
            acc[m][j] = _mm256_fmadd_ps(_mm256_set1_ps(xg[m * ldx + 2 * i + 1]), w1, acc[m][j]);
          }
        }
      }
    } else {
      for (int64_t k = 0; k < l.G; ++k) {
        const uint8_t* row = qd + k * kPanel + c0;
        _mm_prefetch(reinterpret_cast<const char*>(row + kAhead), _MM_HINT_T0);
        for (int j = 0; j < 4; ++j) {
          const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * j)));
          const __m256 w = dequant8<OFF, S>(s + 8 * j, o + 8 * j, v);
          for (int m = 0; m < R; ++m) acc[m][j] = _mm256_fmadd_ps(_mm256_set1_ps(xg[m * ldx + k]), w, acc[m][j]);
        }
      }
    }
  }
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < 4; ++j) {
      const int left = ncols - static_cast<int>(c0) - 8 * j;
      if (left <= 0) continue;
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, acc[m][j]);
      std::memcpy(y + m * ldy + c0 + 8 * j, tmp, sizeof(float) * std::min(left, 8));
    }
}

// (x, ldx, panel, layout, first column c0, bias, y, ldy, ncols): a panel's columns from c0 (all, or one half)
using PanelFn = void (*)(const float*, int64_t, const uint8_t*, const Layout&, int64_t, const float*, float*,
                         int64_t, int);

template <int BITS, bool OFF, int J, typename S>
PanelFn avx512_fn(int rows) {
  static constexpr PanelFn table[7] = {nullptr,
                                       panel_rows_avx512<1, BITS, OFF, J, S>,
                                       panel_rows_avx512<2, BITS, OFF, J, S>,
                                       panel_rows_avx512<3, BITS, OFF, J, S>,
                                       panel_rows_avx512<4, BITS, OFF, J, S>,
                                       panel_rows_avx512<5, BITS, OFF, J, S>,
                                       panel_rows_avx512<6, BITS, OFF, J, S>};
  return table[rows];
}

template <int BITS, bool OFF, typename S>
PanelFn avx2_fn(int rows) {
  static constexpr PanelFn table[4] = {nullptr, half_panel_rows_avx2<1, BITS, OFF, S>, half_panel_rows_avx2<2, BITS, OFF, S>,
                                      half_panel_rows_avx2<3, BITS, OFF, S>};
  return table[rows];
}

template <int J, typename S>
PanelFn pick_avx512_of(const Layout& l, int rows) {
  if (l.bits == 4) return l.offset ? avx512_fn<4, true, J, S>(rows) : avx512_fn<4, false, J, S>(rows);
  return l.offset ? avx512_fn<8, true, J, S>(rows) : avx512_fn<8, false, J, S>(rows);
}

template <int J>
PanelFn pick_avx512(const Layout& l, int rows) {
  return l.half ? pick_avx512_of<J, uint16_t>(l, rows) : pick_avx512_of<J, float>(l, rows);
}

template <typename S>
PanelFn pick_avx2_of(const Layout& l, int rows) {
  if (l.bits == 4) return l.offset ? avx2_fn<4, true, S>(rows) : avx2_fn<4, false, S>(rows);
  return l.offset ? avx2_fn<8, true, S>(rows) : avx2_fn<8, false, S>(rows);
}

PanelFn pick_avx2(const Layout& l, int rows) { return l.half ? pick_avx2_of<uint16_t>(l, rows) : pick_avx2_of<float>(l, rows); }
#endif

Isa resolve_isa(int64_t isa) {
  TORCH_CHECK(isa >= kAuto && isa <= kAvx512, "quantized_linear: isa must be 0 (auto), 1 (portable), 2 (AVX2) or ",
              "3 (AVX-512), got ", isa);
  if (isa == kAuto) return cpu_has_avx512() ? kAvx512 : (cpu_has_avx2_fma() ? kAvx2 : kPortable);
  TORCH_CHECK(isa != kAvx512 || cpu_has_avx512(), "quantized_linear: this CPU has no AVX-512 (or HK_CPU_ISA ",
              "limits the kernels below it)");
  TORCH_CHECK(isa != kAvx2 || cpu_has_avx2_fma(), "quantized_linear: this CPU has no AVX2 + FMA (or HK_CPU_ISA ",
              "limits the kernels below it)");
  return static_cast<Isa>(isa);
}

// Rows [m0, m0 + rows) of one panel, by the chosen ISA (rows <= the ISA's tile): its columns [0, ncols) (half < 0), or
// only those of half 0 ([0, 32)) or half 1 ([32, 64)) of them.
void panel_tile(Isa isa, const float* x, int64_t ldx, int rows, const uint8_t* panel, const Layout& l,
                const float* bias, float* y, int64_t ldy, int ncols, int half) {
#ifdef HK_X86
  if (isa == kAvx512)
    return half < 0 ? pick_avx512<4>(l, rows)(x, ldx, panel, l, 0, bias, y, ldy, ncols)
                    : pick_avx512<2>(l, rows)(x, ldx, panel, l, 32 * half, bias, y, ldy, ncols);
  if (isa == kAvx2) {
    if (half <= 0) pick_avx2(l, rows)(x, ldx, panel, l, 0, bias, y, ldy, ncols);
    if (half != 0 && ncols > 32) pick_avx2(l, rows)(x, ldx, panel, l, 32, bias, y, ldy, ncols);
    return;
  }
#endif
  const int c0 = half == 1 ? 32 : 0, c1 = half == 0 ? std::min(ncols, 32) : ncols;
  if (l.half)
    panel_rows_portable<uint16_t>(x, ldx, rows, panel, l, bias, y, ldy, c0, c1);
  else
    panel_rows_portable<float>(x, ldx, rows, panel, l, bias, y, ldy, c0, c1);
}

// q int8 [N, K] (4 bits: values 0..15), s fp32 [N, K/G], o fp32 [N, K/G] or None -> uint8 [P, K/G, GB].
// half_scales: store s and o as fp16 (each must be an fp16 value: checked), else fp32.
at::Tensor pack_quantized_weight_cpu(const at::Tensor& q, const at::Tensor& s, const std::optional<at::Tensor>& o,
                                     int64_t bits, bool half_scales) {
  // a 4-bit byte holds two inputs of one column
  const int64_t G = check_pack_arguments("pack_quantized_weight", q, s, o, bits, half_scales, bits == 4 ? 2 : 1);
  const int64_t N = q.size(0), K = q.size(1), NG = s.size(1);
  const int64_t header = header_bytes(half_scales) * (o.has_value() ? 2 : 1), GB = header + G * kPanel * bits / 8;
  const int64_t P = (N + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({P, NG, GB}, q.options().dtype(at::kByte));
  const at::Tensor qc = q.contiguous(), sc = s.contiguous();
  const at::Tensor oc = o.has_value() ? o->contiguous() : at::Tensor();
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  const float* op = oc.defined() ? oc.data_ptr<float>() : nullptr;
  uint8_t* out = packed.data_ptr<uint8_t>();
  // a group's scales and offsets as stored: fp32, or the fp16 bits of each
  const auto put = [half_scales](uint8_t* header_start, int64_t idx, float v) {
    if (half_scales)
      reinterpret_cast<uint16_t*>(header_start)[idx] = c10::Half(v).x;
    else
      reinterpret_cast<float*>(header_start)[idx] = v;
  };
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t g = 0; g < NG; ++g) {
        uint8_t* grp = out + (p * NG + g) * GB;
        uint8_t* qd = grp + header;
        for (int64_t c = 0; c < kPanel && p * kPanel + c < N; ++c) {
          const int64_t n = p * kPanel + c;
          put(grp, c, sp[n * NG + g]);
          if (op) put(grp, kPanel + c, op[n * NG + g]);
          for (int64_t k = 0; k < G; ++k) {
            const int8_t v = qp[n * K + g * G + k];
            if (bits == 8) {
              qd[k * kPanel + c] = static_cast<uint8_t>(v);
            } else {
              qd[(k / 2) * kPanel + c] |= static_cast<uint8_t>(v << (4 * (k % 2)));
            }
          }
        }
      }
  });
  return packed;
}

void quantized_panels_into(const float* xp, int64_t M, const uint8_t* wp, const Layout& l, int64_t N, const float* bp,
                           float* yp, Isa isa) {
  const int tile = isa == kAvx512 ? 6 : (isa == kAvx2 ? 3 : 6);
  const int64_t K = l.K();
  for_each_panel_tile(M, N, bp, tile, [&](int64_t p, int64_t m0, int rows, int64_t n0, int ncols, const float* pb, int half) {
    panel_tile(isa, xp + m0 * K, K, rows, wp + p * l.NG * l.GB, l, pb, yp + m0 * N + n0, N, ncols, half);
  }, /*halves=*/true);
}

void check_panel_count(const at::Tensor& packed, int64_t N) {
  const int64_t P = packed.size(0);
  TORCH_CHECK(N > (P - 1) * kPanel && N <= P * kPanel, "quantized_linear: N=", N, " does not match ", P, " panels");
}

at::Tensor quantized_linear_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t bits, bool offset,
                                const std::optional<at::Tensor>& bias, int64_t isa_arg, bool half_scales) {
  const Layout l = layout_of(packed, bits, offset, half_scales);
  check_panel_count(packed, N);
  const int64_t K = l.K();
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) == K,
              "quantized_linear: x must be fp32 [..., K=", K, "], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat),
              "quantized_linear: bias must be fp32 [N=", N, "]");
  const Isa isa = resolve_isa(isa_arg);
  at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y.view(out_sizes);
  at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  quantized_panels_into(x2.data_ptr<float>(), M, packed.data_ptr<uint8_t>(), l, N, b.defined() ? b.data_ptr<float>() : nullptr,
                        y.data_ptr<float>(), isa);
  return y.view(out_sizes);
}

// Weight rows `ids` dequantized to fp32 [n, K]: the embedding lookup of a quantized table, and the whole
// weight (ids = 0..N-1) where an fp32 copy is needed (state_dict, .to(), autograd).
template <typename S>
void rows_into(const uint8_t* wp, const Layout& l, const int64_t* ip, int64_t n, float* op) {
  const int64_t K = l.K();
  at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p = ip[i] / kPanel, c = ip[i] % kPanel;
      for (int64_t g = 0; g < l.NG; ++g) {
        const uint8_t* grp = wp + (p * l.NG + g) * l.GB;
        const S* s = reinterpret_cast<const S*>(grp);
        for (int64_t k = 0; k < l.G; ++k)
          op[i * K + g * l.G + k] = dequant(scale_at(s, c), static_cast<float>(q_at(grp + l.header, l.bits, k, c)), l.offset,
                                            l.offset ? scale_at(s + kPanel, c) : 0.0f);
      }
    }
  });
}

at::Tensor quantized_rows_cpu(const at::Tensor& packed, const at::Tensor& ids, int64_t N, int64_t bits, bool offset,
                              bool half_scales) {
  const Layout l = layout_of(packed, bits, offset, half_scales);
  TORCH_CHECK(N > (packed.size(0) - 1) * kPanel && N <= packed.size(0) * kPanel, "quantized_rows: N=", N,
              " does not match ", packed.size(0), " panels");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "quantized_rows: ids must be int64 [n]");
  const int64_t K = l.K(), n = ids.size(0);
  at::Tensor idc = ids.contiguous();
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "quantized_rows: id ", ip[i], " outside [0, ", N, ")");
  at::Tensor out = at::empty({n, K}, packed.options().dtype(at::kFloat));
  quantized_rows_into(packed, N, bits, offset, half_scales, ip, n, out.data_ptr<float>());
  return out;
}

// The fastest ISA this CPU runs the kernel with: 3 AVX-512, 2 AVX2 + FMA, 1 portable (slow).
int64_t quantized_linear_isa() { return resolve_isa(kAuto); }

}  // namespace

int64_t check_pack_arguments(const char* op, const at::Tensor& q, const at::Tensor& s, const std::optional<at::Tensor>& o,
                             int64_t bits, bool half_scales, int64_t g_multiple) {
  TORCH_CHECK(bits == 4 || bits == 8, op, ": bits must be 4 or 8, got ", bits);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, op, ": q must be int8 [N, K], got ", q.scalar_type(), " ",
              q.sizes());
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(s.dim() == 2 && s.size(0) == N && s.scalar_type() == at::kFloat && s.size(1) > 0 && K % s.size(1) == 0, op,
              ": scales must be fp32 [N=", N, ", K/G] with G dividing K=", K, ", got ", s.scalar_type(), " ", s.sizes());
  TORCH_CHECK(!o.has_value() || (o->sizes() == s.sizes() && o->scalar_type() == at::kFloat), op,
              ": offsets must be fp32 shaped like the scales ", s.sizes());
  const int64_t G = K / s.size(1);
  TORCH_CHECK(G % g_multiple == 0, op, ": groups must hold a multiple of ", g_multiple, " inputs here, got ", G);
  if (bits == 4)
    TORCH_CHECK(q.numel() == 0 || (q.min().item<int>() >= 0 && q.max().item<int>() <= 15), op,
                ": 4-bit q must hold values 0..15");
  if (half_scales)
    for (const at::Tensor* t : {&s, o.has_value() ? &*o : nullptr}) {
      if (t == nullptr) continue;
      const at::Tensor c = t->contiguous();
      const float* v = c.data_ptr<float>();
      for (int64_t i = 0; i < c.numel(); ++i)
        TORCH_CHECK(static_cast<float>(c10::Half(v[i])) == v[i], op, ": half_scales needs every scale and offset to ",
                    "be an fp16 value, got ", v[i]);
    }
  return G;
}

void quantized_linear_into(const float* x, int64_t M, const at::Tensor& packed, int64_t N, int64_t bits, bool offset,
                           bool half_scales, const float* bias, float* y) {
  const Layout l = layout_of(packed, bits, offset, half_scales);
  check_panel_count(packed, N);
  if (M > 0) quantized_panels_into(x, M, packed.data_ptr<uint8_t>(), l, N, bias, y, resolve_isa(kAuto));
}

void check_quantized_panels(const at::Tensor& packed, int64_t N, int64_t K, int64_t bits, bool offset, bool half_scales) {
  const Layout l = layout_of(packed, bits, offset, half_scales);
  check_panel_count(packed, N);
  TORCH_CHECK(l.K() == K, "quantized_linear: the panels hold ", l.K(), " inputs a row, expected ", K);
}

void quantized_rows_into(const at::Tensor& packed, int64_t N, int64_t bits, bool offset, bool half_scales,
                         const int64_t* ids, int64_t n, float* out) {
  const Layout l = layout_of(packed, bits, offset, half_scales);
  check_panel_count(packed, N);
  if (l.half)
    rows_into<uint16_t>(packed.data_ptr<uint8_t>(), l, ids, n, out);
  else
    rows_into<float>(packed.data_ptr<uint8_t>(), l, ids, n, out);
}

TORCH_LIBRARY_FRAGMENT(hydra_kernels, m) {
  m.def("pack_quantized_weight(Tensor q, Tensor scales, Tensor? offsets, int bits, bool half_scales=False) -> Tensor");
  m.def("quantized_linear(Tensor x, Tensor packed, int N, int bits, bool offset, Tensor? bias=None, int isa=0, "
        "bool half_scales=False) -> Tensor");
  m.def("quantized_rows(Tensor packed, Tensor ids, int N, int bits, bool offset, bool half_scales=False) -> Tensor");
  m.def("quantized_linear_isa() -> int", &quantized_linear_isa);
}

TORCH_LIBRARY_IMPL(hydra_kernels, CPU, m) {
  m.impl("pack_quantized_weight", &pack_quantized_weight_cpu);
  m.impl("quantized_linear", &quantized_linear_cpu);
  m.impl("quantized_rows", &quantized_rows_cpu);
}

}  // namespace hydra_kernels
