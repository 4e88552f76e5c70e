// tree_attention on the CPU.
//
// fp32 (the CPU model's dtype): a hand-written kernel. A query row (b, i, h)'s keys are the committed
// prefix [0, seqlens[b]) then the row's tree ancestors-or-self in node order, read in place through the
// cache's strides; its scores, max, exp and weighted V sum run in a fixed order with fp32 accumulation
// (spelled out before the AVX-512 code below). A row's result therefore depends only on its own query
// and keys, not on T, the rest of the tree, the batch, the tiling or the threads: a token's attention
// output is bit-identical in a 1-token decoding step and inside a verified tree (with the packed
// linears, so is the whole forward: exact by construction). With AVX-512 the rows of a KV head are
// computed together so that each K and V row is read from memory once per step, not once per query
// row (G per decoding step, G * T per tree step); without it, one row at a time in the same order.
// Both are much faster than the library kernel at these sizes (T <= 32 rows, hundreds of keys: its
// setup was most of the ~100 us per layer).
//
// Other dtypes: the tree mask expanded to a [B, 1, T, S] key mask, then ATen's CPU flash-attention
// kernel (blocked online softmax, fp32 accumulation, GQA, strided K/V read in place).
//
// Why not the reference's formula: it permutes the [B, S, Hkv, D] cache to [B, Hkv, S, D] and the
// batched matmul then copies K and V of every layer on every step (measured 3x slower at batch 1,
// 14x at batch 64 on a 2-core Xeon). Both paths here read the cache through its strides.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "cpu_features.h"
#include "step_kernels.h"
#include "tree_buffer.h"

namespace hydra_kernels {
namespace {

void check_tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seqlens,
                          const at::Tensor& tree_mask) {
  TORCH_CHECK(q.dim() == 4, "tree_attention: q must be [B, T, Hq, D], got ", q.sizes());
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes(), "tree_attention: k_cache and v_cache must both be [B, S_max, Hkv, D], got ",
              k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3), "tree_attention: k_cache ", k.sizes(),
              " does not match q ", q.sizes(), " in batch or head_dim");
  TORCH_CHECK(q.size(2) % k.size(2) == 0, "tree_attention: Hq=", q.size(2), " is not a multiple of Hkv=", k.size(2));
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "tree_attention: q, k_cache, v_cache must share a dtype");
  const int64_t T = q.size(1);
  TORCH_CHECK(T <= k.size(1), "tree_attention: T=", T, " tree tokens do not fit a cache of ", k.size(1), " rows");
  const bool shared = tree_mask.dim() == 2, per_seq = tree_mask.dim() == 3 && tree_mask.size(0) == q.size(0);
  TORCH_CHECK((shared || per_seq) && tree_mask.size(-2) == T && tree_mask.size(-1) == T &&
                  tree_mask.scalar_type() == at::kBool,
              "tree_attention: tree_mask must be bool [T, T] = [", T, ", ", T, "] (one tree) or [B, T, T] = [", q.size(0),
              ", ", T, ", ", T, "] (a tree per sequence), got ", tree_mask.scalar_type(), " ", tree_mask.sizes());
  TORCH_CHECK(seqlens.dim() == 1 && seqlens.size(0) == q.size(0) &&
                  (seqlens.scalar_type() == at::kInt || seqlens.scalar_type() == at::kLong),
              "tree_attention: cache_seqlens must be int32/int64 [B]");
  for (const at::Tensor* t : {&k, &v, &seqlens, &tree_mask})
    TORCH_CHECK(t->device() == q.device(), "tree_attention: all inputs must be on one device");
}

// allowed[b, 0, i, j]: j < seqlens[b] (committed prefix), or j - seqlens[b] = node n in [0, T) with
// tree_mask[(b,) i, n] (ancestor-or-self). Rows past the tree stay masked.
at::Tensor key_mask(const at::Tensor& seqlens, const at::Tensor& tree_mask, int64_t B, int64_t T, int64_t S) {
  at::Tensor allowed = at::empty({B, 1, T, S}, tree_mask.options());
  const TreeBuffer tm = tree_buffer(tree_mask, 2, at::kBool);  // [T, T] shared or [B, T, T]
  const bool* tmp = tm.t.data_ptr<bool>();
  at::Tensor sl = seqlens.to(at::kLong).contiguous();
  const int64_t* s = sl.data_ptr<int64_t>();
  bool* out = allowed.data_ptr<bool>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = s[b];
    TORCH_CHECK(len >= 0 && len + T <= S, "tree_attention: seqlens[", b, "] + T = ", len + T,
                " exceeds the cache's rows");
    for (int64_t i = 0; i < T; ++i) {
      bool* row = out + (b * T + i) * S;
      std::memset(row, 1, static_cast<size_t>(len));
      std::memcpy(row + len, tmp + b * tm.batch_stride + i * T, static_cast<size_t>(T));
      std::memset(row + len + T, 0, static_cast<size_t>(S - len - T));
    }
  }
  return allowed;
}

// ---- fp32 row kernel ------------------------------------------------------------------------------
// One query row against L keys: key_rows[j] is the cache row of key j (prefix rows, then tree rows).
struct RowArgs {
  const float* q;      // [D]
  const float* k;      // cache base of (b, kv head): row r at k + r * row_stride
  const float* v;
  int64_t row_stride;  // elements between consecutive cache rows
  const int64_t* key_rows;
  int64_t L, D;
  float scale;
  float* scores;  // [L] scratch
  float* out;     // [D]
};

// The row kernel's arithmetic, one order on every machine without the AVX-512 passes: each score is a dot product over D
// in 8 lanes (lane l takes the inputs d = l mod 8 in increasing d, one fma each), the lanes folded 8 -> 4 -> 2 -> 1
// (lane l += lane l + w, w = 4, 2, 1); the softmax and the weighted sum of V as written. The compiler may vectorize the lanes and
// the columns of the V sum, which keeps each one's sequence of roundings, so the result is the same compiled for AVX2 +
// FMA (attend_row_avx2: vfmadd for std::fma, 8 lanes one ymm) or without (attend_row_portable: libm's fmaf, exact
// too). Before: one fma chain over D, a libm call each, ~60% of an AVX2 step (2026-11-29, EPYC VM under
// HK_CPU_ISA=avx2, perf of a SmolLM2 step).
constexpr int kDotLanes = 8;

__attribute__((always_inline)) inline float dot_in_lanes(const float* q, const float* k, int64_t D) {
  float acc[kDotLanes] = {};
  int64_t d = 0;
  for (; d + kDotLanes <= D; d += kDotLanes)
    for (int l = 0; l < kDotLanes; ++l) acc[l] = std::fma(q[d + l], k[d + l], acc[l]);
  for (int l = 0; d + l < D; ++l) acc[l] = std::fma(q[d + l], k[d + l], acc[l]);
  for (int w = kDotLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

__attribute__((always_inline)) inline void attend_row_body(const RowArgs& a) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < a.L; ++j) {
    a.scores[j] = dot_in_lanes(a.q, a.k + a.key_rows[j] * a.row_stride, a.D) * a.scale;
    m = std::max(m, a.scores[j]);
  }
  float l = 0.0f;
  for (int64_t d = 0; d < a.D; ++d) a.out[d] = 0.0f;
  for (int64_t j = 0; j < a.L; ++j) {
    const float p = std::exp(a.scores[j] - m);
    l += p;
    const float* vr = a.v + a.key_rows[j] * a.row_stride;
    for (int64_t d = 0; d < a.D; ++d) a.out[d] = std::fma(p, vr[d], a.out[d]);
  }
  const float inv = 1.0f / l;  // no key at all: 0 * inf = NaN, as the reference's softmax over nothing
  for (int64_t d = 0; d < a.D; ++d) a.out[d] *= inv;
}

void attend_row_portable(const RowArgs& a) { attend_row_body(a); }

#ifdef HK_X86
__attribute__((target("avx2,fma"))) void attend_row_avx2(const RowArgs& a) { attend_row_body(a); }
#endif

#ifdef HK_X86
// GCC 12 reports the headers' _mm512_undefined_ps() pass-through operands (e.g. inside
// _mm512_reduce_add_ps) as uninitialized once they are inlined here: false positives.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// e^x for x <= 0 (scores minus their max): x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 Taylor
// polynomial (relative error < 2e-7, about 1 ulp), times 2^n by scalef. Below -87 the result is 0.
__attribute__((target("avx512f"))) inline __m512 exp_nonpositive(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 split hi + lo: r exact-ish
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}

// ---- AVX-512: the rows of a KV head together --------------------------------------------------------
// The math of one query row, bit for bit (what the former one-row-at-a-time AVX-512 kernel computed;
// the portable loop above keeps its own scalar order):
//   score_j = reduce(acc_j) * scale, acc_j (16 lanes) = q[0:16] * k_j[0:16] for chunk 0, then
//             acc_j = fmadd(q[16c:16c+16], k_j[16c:16c+16], acc_j) for c = 1..nd-1 (nd = ceil(D / 16),
//             lanes past D load 0 in q and k); reduce = _mm512_reduce_add_ps's tree (GCC's order:
//             lane i + lane i+8, then i + i+4, then i + i+2, then the last two);
//   m       = max of the scores (exact, so any order gives the same m);
//   p_j     = exp_nonpositive(score_j - m), 16 keys at a time from key 0 over the row's scores laid out
//             [prefix..., tree keys...], lsum += p lane-wise, l = _mm512_reduce_add_ps(lsum);
//   o       = fmadd(p_j, v_j, o) over the keys in key order (per 16-lane chunk), out = o * (1 / l).
// Key order: the committed prefix 0..len-1, then the row's tree ancestors-or-self in node order.
//
// Why not one row at a time: the G query heads of a KV head, times the T tree rows, all attend to the
// same prefix K and V rows. Row by row, a decoding step read each K/V row G times (SmolLM2: 3) and a
// T-node step G * T times (18 at T = 6), and paid one horizontal reduce per score. Here, per batch of
// (b, KV head) pairs (as many as fit ~16 MiB of scratch), in three passes, each split over the threads:
//   pass 1  units (sequence b, all its KV heads, a range of prefix keys): for each block of 16 keys, the
//           K rows (every head: one contiguous span per cache row) are loaded once and stay in L1
//           while each of the heads' G * T query rows takes its 16 scores from them, two rows at a time,
//           with one reduction tree for the 16 keys (scores_16); the last range also does each row's
//           tree keys. Scores go to a per-row scratch [prefix..., tree keys...] with a running max
//           per key range;
//   pass 2  per row: m (max of its ranges' maxima), p_j and l, in place, exactly as above;
//   pass 3  units (pair, 16-column chunk of D); a thread's units are adjacent columns of the V rows:
//           for each block of prefix keys (its span of V fits L1) the V chunks are loaded once and
//           every row of those heads accumulates them in key order (register tiles of R rows x NC
//           chunks, parked in scratch between key blocks); then each row's tree keys and * 1/l.
// Splitting keys (pass 1) and columns (pass 3) rather than heads keeps two threads busy at batch 1
// with SmolLM2's 3 KV heads, and each thread streams contiguous memory. Tiling and splitting only
// choose which row / chunk / key block is computed when, never the operations of a row's sum.

// 16 keys' lane sums at once, each in _mm512_reduce_add_ps's order. Its tree for one vector x: halves
// 8 lanes apart added (x[i] + x[i+8], i < 8), then 4 apart, then 2 apart, then the last two. Here each
// level adds the same two partial sums for two vectors at a time (a 2-row transpose: shuffle the
// partial sums of both into one register, add): 15 vector adds and 30 shuffles for 16 sums, instead
// of 16 horizontal reduces. Each lane is bit-identical to _mm512_reduce_add_ps of its vector (IEEE
// addition is commutative; only the grouping counts, and it is the same).
//   level 1: a, b        -> [a's 8 sums | b's 8 sums]            (256-bit halves of each)
//   level 2: u(a,b), u(c,d) -> 128-bit block: a's, b's, c's, d's 4 sums
//   level 3: w0, w1      -> block n: [w0 block n: 2 sums, w1 block n: 2 sums]
//   level 4: x0, x1      -> block n, lane e: the total of vector 4e + n
// Vectors are combined as soon as they are ready (a binary counter), so few registers are live.
__attribute__((target("avx512f"))) inline __m512 sum_level1(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0xEE), _mm512_shuffle_f32x4(a, b, 0x44));  // high + low
}
__attribute__((target("avx512f"))) inline __m512 sum_level2(__m512 u0, __m512 u1) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0xDD), _mm512_shuffle_f32x4(u0, u1, 0x88));
}
__attribute__((target("avx512f"))) inline __m512 sum_level3(__m512 w0, __m512 w1) {
  return _mm512_add_ps(_mm512_shuffle_ps(w0, w1, 0x44), _mm512_shuffle_ps(w0, w1, 0xEE));  // lanes 0+2, 1+3
}
__attribute__((target("avx512f"))) inline __m512 sum_level4(__m512 x0, __m512 x1) {
  return _mm512_add_ps(_mm512_shuffle_ps(x0, x1, 0x88), _mm512_shuffle_ps(x0, x1, 0xDD));  // lane 0 + 1
}

constexpr __mmask16 kAllLanes = 0xFFFF;
constexpr int64_t kPrefetchRows = 16;  // cache rows ahead that passes 1 and 3 prefetch (measured: 16-32)

// Loops over compile-time chunk / row counts are unrolled before GCC decides where arrays live, so
// register tiles (acc[R][NC], the score sums) stay in registers instead of being stored every key.
#define HK_UNROLL _Pragma("GCC unroll 16")

inline __mmask16 first_lanes(int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1u); }

// Prefetch (into L1) n floats from p: one touch per 64-byte line.
inline void prefetch_floats(const float* p, int64_t n) {
  for (int64_t d = 0; d < n; d += 16) _mm_prefetch(reinterpret_cast<const char*>(p + d), _MM_HINT_T0);
}

constexpr int slot_key(int s) { return 4 * (s % 4) + s / 4; }  // the key held in slot s (see scores_16)

template <int ND>
__attribute__((target("avx512f"))) inline void load_q(const float* q, __mmask16 tail, __m512 (&out)[ND]) {
  HK_UNROLL
  for (int c = 0; c < ND; ++c) out[c] = _mm512_maskz_loadu_ps(c == ND - 1 ? tail : kAllLanes, q + 16 * c);
}

// q . k for one key, lane-wise: q[0:16] * k[0:16], then fmadd over the chunks c = 1..ND-1 in order
// (lanes past D load 0 in both).
template <int ND>
__attribute__((target("avx512f"))) inline __m512 dot_lanes(const __m512 (&q)[ND], const float* k, __mmask16 tail) {
  __m512 acc = _mm512_mul_ps(q[0], _mm512_maskz_loadu_ps(ND == 1 ? tail : kAllLanes, k));
  HK_UNROLL
  for (int c = 1; c < ND; ++c)
    acc = _mm512_fmadd_ps(q[c], _mm512_maskz_loadu_ps(c == ND - 1 ? tail : kAllLanes, k + 16 * c), acc);
  return acc;
}

// Where the K row of key j (0..15) of a block is: a full prefix block (rows base + j * ss), or a list.
struct StridedKeys {
  const float* base;
  int64_t ss;
  const float* operator()(int j) const { return base + j * ss; }
};
struct ListedKeys {
  const float* const* rows;  // [16]
  const float* operator()(int j) const { return rows[j]; }
};

// The scores of 16 keys for NR query rows at once (the K chunks of a key loaded once for them): lane j
// of out[r] is row r's score of key j. Slot s of the reduction holds key slot_key(s), since level 4
// leaves the total of slot 4e + n in lane 4n + e.
template <int ND, int NR, class Keys>
__attribute__((target("avx512f"))) inline void scores_16(const __m512 (&q)[NR][ND], Keys keys, __mmask16 tail,
                                                         __m512 scale, __m512 (&out)[NR]) {
  __m512 x[NR][2];
  HK_UNROLL
  for (int h = 0; h < 2; ++h) {
    __m512 w[NR][2];
    HK_UNROLL
    for (int m = 0; m < 2; ++m) {
      __m512 u[NR][2];
      HK_UNROLL
      for (int t = 0; t < 2; ++t) {
        const int s = 8 * h + 4 * m + 2 * t;
        const float* ka = keys(slot_key(s));
        const float* kb = keys(slot_key(s + 1));
        HK_UNROLL
        for (int r = 0; r < NR; ++r) u[r][t] = sum_level1(dot_lanes<ND>(q[r], ka, tail), dot_lanes<ND>(q[r], kb, tail));
      }
      HK_UNROLL
      for (int r = 0; r < NR; ++r) w[r][m] = sum_level2(u[r][0], u[r][1]);
    }
    HK_UNROLL
    for (int r = 0; r < NR; ++r) x[r][h] = sum_level3(w[r][0], w[r][1]);
  }
  HK_UNROLL
  for (int r = 0; r < NR; ++r) out[r] = _mm512_mul_ps(sum_level4(x[r][0], x[r][1]), scale);
}

// Stores a block's scores (lanes mk) and folds them into a row's lane-wise running max: max(s, m) is
// s > m ? s : m, so a NaN score is skipped, as std::max(m, s) skipped it in the row kernel.
__attribute__((target("avx512f"))) inline void keep_scores(float* dst, __mmask16 mk, __m512 s, float* mx) {
  _mm512_mask_storeu_ps(dst, mk, s);
  _mm512_storeu_ps(mx, _mm512_mask_max_ps(_mm512_loadu_ps(mx), mk, s, _mm512_loadu_ps(mx)));
}

// One call's shapes and scratch. The (b, KV head) pairs p = b * Hkv + g are taken in groups [p0, p1)
// whose scores fit the scratch; the G * T query rows of pair p are rho = i * G + (h - g * G), i.e. q
// row (b, i, h) with h = g * G + rho % G, i = rho / G. Scratch, per pair of the group and row:
//   scores [sstride]    the row's scores [prefix..., tree keys...], then p_j in place (pass 2)
//   mx     [nranges, 16] lane-wise max of the scores of each key range of pass 1
//   o      [ND, 16]     pass-3 accumulators between key blocks
//   inv_l               1 / l
struct Attn {
  const float* q;  // [B, T, Hq, D] contiguous
  float* out;      // [B, T, Hq, D]
  const float* k;  // [B, S, Hkv, D] through the strides below (unit stride in D)
  const float* v;
  int64_t sb, ss, sh;
  int64_t T, Hq, Hkv, G, D, rows;  // rows = G * T per pair
  float scale;
  __mmask16 tail;        // lanes of the last 16-chunk of D
  const int64_t* lens;   // [B]
  const int32_t* nodes;  // [B, T, T]: node i's ancestors-or-self in node order, nt[b * T + i] of them
  const int32_t* nt;     // [B, T]
  int64_t p0, nranges, sstride;
  float *scores, *mx, *o, *inv_l;

  const float* qrow(int64_t b, int64_t g, int64_t rho) const {
    return q + ((b * T + rho / G) * Hq + g * G + rho % G) * D;
  }
  float* outrow(int64_t b, int64_t g, int64_t rho) const { return out + ((b * T + rho / G) * Hq + g * G + rho % G) * D; }
  int64_t row(int64_t p, int64_t rho) const { return (p - p0) * rows + rho; }  // scratch row of pair p
  const int32_t* row_nodes(int64_t b, int64_t rho) const { return nodes + (b * T + rho / G) * T; }
  int64_t row_nt(int64_t b, int64_t rho) const { return nt[b * T + rho / G]; }
};

// Pass 1, one unit: sequence b, its KV heads [g0, g1) (adjacent in every cache row, so the unit streams
// one contiguous span per key), prefix keys [j0, j1), which is key range `range` of b; with_tree: also
// every row's tree keys. The 16 K rows of a key block (all heads) are loaded from memory once and stay
// in L1 while each of the heads' G * T rows takes its 16 scores from them.
template <int ND>
__attribute__((target("avx512f"))) void scores_unit(const Attn& a, int64_t b, int64_t g0, int64_t g1, int64_t j0,
                                                    int64_t j1, int64_t range, bool with_tree) {
  const __m512 scale = _mm512_set1_ps(a.scale);
  const float* kb = a.k + b * a.sb;
  const int64_t len = a.lens[b], span = (g1 - 1 - g0) * a.sh + a.D;
  std::vector<const float*> qrows((g1 - g0) * a.rows);  // q row of (head g, rho)
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t rho = 0; rho < a.rows; ++rho) qrows[(g - g0) * a.rows + rho] = a.qrow(b, g, rho);
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t rho = 0; rho < a.rows; ++rho)
      _mm512_storeu_ps(a.mx + (a.row(b * a.Hkv + g, rho) * a.nranges + range) * 16,
                       _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
  for (int64_t jb = j0; jb < j1; jb += 16) {
    const int64_t nk = std::min<int64_t>(16, j1 - jb);
    const __mmask16 mk = first_lanes(nk);
    for (int64_t j = jb + kPrefetchRows; j < std::min(len, jb + kPrefetchRows + 16); ++j)
      prefetch_floats(kb + j * a.ss + g0 * a.sh, span);  // the K rows 16 ahead: all heads of the unit
    for (int64_t g = g0; g < g1; ++g) {
      const float* kg = kb + g * a.sh;
      const float* kp[16];  // a partial block: its missing keys read key 0's row, their lanes dropped
      if (nk < 16)
        for (int j = 0; j < 16; ++j) kp[j] = kg + (jb + (j < nk ? j : 0)) * a.ss;
      const int64_t r0 = a.row(b * a.Hkv + g, 0), mxs = a.nranges * 16;
      float* sc = a.scores + r0 * a.sstride + jb;
      float* mx = a.mx + (r0 * a.nranges + range) * 16;
      const float* const* qr = qrows.data() + (g - g0) * a.rows;
      int64_t rho = 0;
      for (; rho + 2 <= a.rows; rho += 2, sc += 2 * a.sstride, mx += 2 * mxs) {  // two rows per K load
        __m512 q[2][ND], s[2];
        load_q<ND>(qr[rho], a.tail, q[0]);
        load_q<ND>(qr[rho + 1], a.tail, q[1]);
        if (nk == 16)
          scores_16<ND, 2>(q, StridedKeys{kg + jb * a.ss, a.ss}, a.tail, scale, s);
        else
          scores_16<ND, 2>(q, ListedKeys{kp}, a.tail, scale, s);
        keep_scores(sc, mk, s[0], mx);
        keep_scores(sc + a.sstride, mk, s[1], mx + mxs);
      }
      if (rho < a.rows) {
        __m512 q[1][ND], s[1];
        load_q<ND>(qr[rho], a.tail, q[0]);
        if (nk == 16)
          scores_16<ND, 1>(q, StridedKeys{kg + jb * a.ss, a.ss}, a.tail, scale, s);
        else
          scores_16<ND, 1>(q, ListedKeys{kp}, a.tail, scale, s);
        keep_scores(sc, mk, s[0], mx);
      }
    }
  }
  if (!with_tree) return;
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t rho = 0; rho < a.rows; ++rho) {  // tree keys: stored after the row's prefix scores
      const int64_t r = a.row(b * a.Hkv + g, rho), nt = a.row_nt(b, rho);
      const int32_t* nodes = a.row_nodes(b, rho);
      __m512 q[1][ND];
      load_q<ND>(a.qrow(b, g, rho), a.tail, q[0]);
      for (int64_t t0 = 0; t0 < nt; t0 += 16) {
        const int64_t nk = std::min<int64_t>(16, nt - t0);
        const float* kp[16];
        for (int j = 0; j < 16; ++j) kp[j] = kb + (len + nodes[t0 + (j < nk ? j : 0)]) * a.ss + g * a.sh;
        __m512 s[1];
        scores_16<ND, 1>(q, ListedKeys{kp}, a.tail, scale, s);
        keep_scores(a.scores + r * a.sstride + len + t0, first_lanes(nk), s[0], a.mx + (r * a.nranges + range) * 16);
      }
    }
}

// Pass 2, one row of pair p: m, p_j = exp(s_j - m) in place 16 keys at a time from key 0, 1 / l; and
// the row's pass-3 accumulators zeroed.
__attribute__((target("avx512f"))) void softmax_row(const Attn& a, int64_t p, int64_t rho) {
  const int64_t b = p / a.Hkv, r = a.row(p, rho), L = a.lens[b] + a.row_nt(b, rho), nd = (a.D + 15) / 16;
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t range = 0; range < a.nranges; ++range)
    m = std::max(m, _mm512_reduce_max_ps(_mm512_loadu_ps(a.mx + (r * a.nranges + range) * 16)));
  const __m512 mv = _mm512_set1_ps(m);
  float* sc = a.scores + r * a.sstride;
  __m512 lsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < L; j += 16) {
    const __mmask16 mk = first_lanes(L - j);
    const __m512 e = _mm512_maskz_mov_ps(mk, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sc + j), mv)));
    _mm512_mask_storeu_ps(sc + j, mk, e);
    lsum = _mm512_add_ps(lsum, e);
  }
  a.inv_l[r] = 1.0f / _mm512_reduce_add_ps(lsum);  // no key at all: 0 * inf = NaN, as the reference
  for (int64_t c = 0; c < nd; ++c) _mm512_storeu_ps(a.o + (r * nd + c) * 16, _mm512_setzero_ps());
}

// Pass 3 kernel: rows [r0, r0 + R) of pair p, chunks [c0, c0 + NC) of D (the last one's lanes: `last`),
// prefix keys [j0, j1): o += p_j * v_j in key order, the R x NC accumulators in registers, the V chunks
// of a key loaded once for the R rows. PF: also prefetch the same chunks kPrefetchRows rows ahead (a
// prefetch never faults, so rows past the prefix need no test).
template <int NC, int R, bool PF>
__attribute__((target("avx512f"))) void accumulate(const Attn& a, int64_t p, int64_t r0, int64_t c0, const float* vb,
                                                   int64_t j0, int64_t j1, __mmask16 last) {
  const int64_t nd = (a.D + 15) / 16, ss = a.ss, pf = kPrefetchRows * a.ss;
  float* o = a.o + a.row(p, r0) * nd * 16 + c0 * 16;
  const float* sc[R];
  HK_UNROLL
  for (int r = 0; r < R; ++r) sc[r] = a.scores + a.row(p, r0 + r) * a.sstride;
  __m512 acc[R][NC];
  HK_UNROLL
  for (int r = 0; r < R; ++r)
    HK_UNROLL
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_loadu_ps(o + (r * nd + c) * 16);
  const float* vr = vb + j0 * ss + c0 * 16;
  for (int64_t j = j0; j < j1; ++j, vr += ss) {
    if constexpr (PF)
      HK_UNROLL
      for (int c = 0; c < NC; ++c) _mm_prefetch(reinterpret_cast<const char*>(vr + pf + 16 * c), _MM_HINT_T0);
    __m512 vv[NC];
    HK_UNROLL
    for (int c = 0; c < NC; ++c) vv[c] = _mm512_maskz_loadu_ps(c == NC - 1 ? last : kAllLanes, vr + 16 * c);
    HK_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512 pj = _mm512_set1_ps(sc[r][j]);
      HK_UNROLL
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_fmadd_ps(pj, vv[c], acc[r][c]);
    }
  }
  HK_UNROLL
  for (int r = 0; r < R; ++r)
    HK_UNROLL
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + (r * nd + c) * 16, acc[r][c]);
}

// rows per pass-3 register tile: R * NC accumulators + NC V chunks within the 32 zmm registers
template <int NC>
constexpr int kTileRows = NC <= 2 ? 8 : 4;

// rows [r0, r0 + min(n, kTileRows)) of pair p; returns how many
template <int NC, int R = kTileRows<NC>>
int64_t accumulate_n(int64_t n, bool pf, const Attn& a, int64_t p, int64_t r0, int64_t c0, const float* vb,
                     int64_t j0, int64_t j1, __mmask16 last) {
  if constexpr (R > 1)
    if (n < R) return accumulate_n<NC, R - 1>(n, pf, a, p, r0, c0, vb, j0, j1, last);
  if (pf)
    accumulate<NC, R, true>(a, p, r0, c0, vb, j0, j1, last);
  else
    accumulate<NC, R, false>(a, p, r0, c0, vb, j0, j1, last);
  return R;
}

// Pass 3, the units [u0, u1) of the group: unit = (pair, 16-chunk c of D), u = (p - p0) * nd + c. A
// thread's units are consecutive, so for one sequence b they are one contiguous span of each V row (its
// heads' chunks side by side): key blocks whose span fits L1 are loaded once and every row of every
// head of the span accumulates from them. Then each row's tree keys (per chunk, in node order) and the
// output row's chunks: o * (1 / l).
__attribute__((target("avx512f"))) void values_units(const Attn& a, int64_t u0, int64_t u1) {
  const int64_t nd = (a.D + 15) / 16;
  while (u0 < u1) {
    const int64_t b = (a.p0 + u0 / nd) / a.Hkv;
    int64_t ue = std::min(u1, ((b + 1) * a.Hkv - a.p0) * nd);  // b's units end there
    struct Seg { int64_t p, c0, c1; };
    Seg segs[64];
    int nseg = 0;
    for (int64_t u = u0; u < ue;) {  // (pair, chunk range) pieces of [u0, ue)
      const int64_t p = a.p0 + u / nd, c0 = u % nd, c1 = std::min(nd, c0 + (ue - u));
      segs[nseg++] = {p, c0, c1};
      u += c1 - c0;
      if (nseg == 64 && u < ue) {  // (> 64 heads in one thread's span: the rest in another round)
        ue = u;
        break;
      }
    }
    const int64_t len = a.lens[b], chunks = ue - u0;
    const int64_t kb = std::clamp<int64_t>(512 / chunks / 16 * 16, 16, 512);  // <= 32 KiB of V per key block
    for (int64_t j0 = 0; j0 < len; j0 += kb) {
      const int64_t j1 = std::min(len, j0 + kb);
      for (int s = 0; s < nseg; ++s) {
        const Seg& sg = segs[s];
        const float* vb = a.v + b * a.sb + (sg.p % a.Hkv) * a.sh;
        for (int64_t c0 = sg.c0; c0 < sg.c1; c0 += 4) {
          const int64_t nc = std::min<int64_t>(4, sg.c1 - c0);
          const __mmask16 last = c0 + nc == nd ? a.tail : kAllLanes;
          for (int64_t r0 = 0; r0 < a.rows;) {
            const bool pf = r0 == 0;  // the first row tile prefetches the chunks ahead
            const int64_t n = a.rows - r0;
            switch (nc) {
              case 1: r0 += accumulate_n<1>(n, pf, a, sg.p, r0, c0, vb, j0, j1, last); break;
              case 2: r0 += accumulate_n<2>(n, pf, a, sg.p, r0, c0, vb, j0, j1, last); break;
              case 3: r0 += accumulate_n<3>(n, pf, a, sg.p, r0, c0, vb, j0, j1, last); break;
              default: r0 += accumulate_n<4>(n, pf, a, sg.p, r0, c0, vb, j0, j1, last); break;
            }
          }
        }
      }
    }
    for (int s = 0; s < nseg; ++s) {  // tree keys, then the output
      const Seg& sg = segs[s];
      const int64_t g = sg.p % a.Hkv;
      const float* vb = a.v + b * a.sb + g * a.sh;
      for (int64_t rho = 0; rho < a.rows; ++rho) {
        const int64_t r = a.row(sg.p, rho), nt = a.row_nt(b, rho);
        const int32_t* nodes = a.row_nodes(b, rho);
        const float* pt = a.scores + r * a.sstride + len;
        const __m512 inv = _mm512_set1_ps(a.inv_l[r]);
        float* dst = a.outrow(b, g, rho);
        for (int64_t c = sg.c0; c < sg.c1; ++c) {
          const __mmask16 mk = c == nd - 1 ? a.tail : kAllLanes;
          __m512 acc = _mm512_loadu_ps(a.o + (r * nd + c) * 16);
          for (int64_t t = 0; t < nt; ++t)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(pt[t]), _mm512_maskz_loadu_ps(mk, vb + (len + nodes[t]) * a.ss + 16 * c), acc);
          _mm512_mask_storeu_ps(dst + 16 * c, mk, _mm512_mul_ps(acc, inv));
        }
      }
    }
    u0 = ue;
  }
}

// Pass 1's key ranges per sequence: about two units per thread, each of at least kMinRangeKeys keys, and where it
// can be, as many units as split evenly over the threads (parallel_for hands each thread ceil(units / threads)): at
// batch 1 the one run of 3 KV heads took 1 range below 256 keys and 3 from 384, so one thread scored all or 2/3 of
// the keys while the other waited (2026-11-28, EPYC VM, perf of a plain SmolLM2 step: pass 1 on the calling thread
// 3.4x the other's samples). Ranges only choose which keys a unit scores: every score and the row's max are the same.
constexpr int64_t kMinRangeKeys = 32;

inline int64_t max_key_ranges(int64_t threads, int64_t max_len) {
  return std::max<int64_t>(1, std::min<int64_t>(2 * threads, max_len / kMinRangeKeys));
}

// total_len: the runs' keys together. A run holding more than 1 / threads of them (a long sequence beside short or
// finished ones) is cut into at least threads * max_len / total_len ranges, so that balanced_spans can give every thread
// a share of it.
inline int64_t key_ranges(int64_t threads, int64_t nruns, int64_t max_len, int64_t total_len) {
  int64_t nr = (2 * threads + nruns - 1) / nruns;
  if (total_len > 0) nr = std::max(nr, (threads * max_len + total_len - 1) / total_len);
  nr = std::clamp<int64_t>(nr, 1, max_key_ranges(threads, max_len));
  for (int64_t even = nr; even > 1; --even)
    if ((nruns * even) % threads == 0) return even;
  return nr;
}

// f(u0, u1) over contiguous spans of the units [0, n), one span per thread, of about equal total cost(u), in parallel
// (all on the calling thread where !parallel). Why not parallel_for's equal counts of units: a sequence's units are
// adjacent and the batch's sequences differ in length (ragged prompts; a finished sequence attends to nothing), so
// equal counts gave one thread a long sequence's work and the other nothing (EPYC VM, 2026-12-01, a SmolLM2 plain step
// at batch 2 over 8000 keys: 47.4 ms with both attending, 45.3 with one finished, 5.8 with neither). A span only
// chooses which thread computes a unit, never a unit's arithmetic.
template <class Cost, class F>
void balanced_spans(int64_t n, int64_t threads, bool parallel, Cost cost, F f) {
  if (!parallel || threads <= 1 || n <= 1) {
    if (n > 0) f(int64_t{0}, n);
    return;
  }
  std::vector<double> prefix(n + 1, 0.0);
  for (int64_t u = 0; u < n; ++u) prefix[u + 1] = prefix[u] + static_cast<double>(cost(u));
  const int64_t spans = std::min(threads, n);
  std::vector<int64_t> bound(spans + 1, n);
  bound[0] = 0;
  for (int64_t t = 1; t < spans; ++t) {  // the unit boundary nearest t / spans of the total cost
    const double target = prefix[n] * static_cast<double>(t) / static_cast<double>(spans);
    int64_t u = std::lower_bound(prefix.begin(), prefix.end(), target) - prefix.begin();
    if (u > 0 && target - prefix[u - 1] <= prefix[u] - target) --u;
    bound[t] = std::clamp<int64_t>(u, bound[t - 1], n);
  }
  at::parallel_for(0, spans, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      if (bound[t] < bound[t + 1]) f(bound[t], bound[t + 1]);
  });
}

// The three passes over pairs [p0, p1), each split over the threads (units of pass 1 and 3 above).
template <int ND>
void attend_group(Attn& a, int64_t p1, int64_t threads, bool parallel) {
  const int64_t p0 = a.p0;
  // pass 1 units: (sequence b's heads in [p0, p1), key range); nranges ranges per sequence (key_ranges)
  struct Run { int64_t b, g0, g1; };
  std::vector<Run> runs;
  for (int64_t p = p0; p < p1;) {
    const int64_t b = p / a.Hkv, pe = std::min(p1, (b + 1) * a.Hkv);
    runs.push_back({b, p - b * a.Hkv, pe - b * a.Hkv});
    p = pe;
  }
  const int64_t nruns = static_cast<int64_t>(runs.size());
  int64_t max_len = 0, total_len = 0;
  for (const Run& r : runs) max_len = std::max(max_len, a.lens[r.b]), total_len += a.lens[r.b];
  a.nranges = parallel ? key_ranges(threads, nruns, max_len, total_len) : 1;
  const int64_t nr = a.nranges;
  // a unit's keys: range `range` of its run's prefix (step keys each, the last one shorter), its heads, + its tree rows
  auto range_keys = [&](int64_t w, int64_t* j0, int64_t* j1) {
    const Run& run = runs[w / nr];
    const int64_t range = w % nr, len = a.lens[run.b], step = (len + nr * 16 - 1) / (nr * 16) * 16;
    *j0 = std::min(len, range * step), *j1 = std::min(len, (range + 1) * step);
  };
  balanced_spans(
      nruns * nr, threads, parallel,
      [&](int64_t w) {
        int64_t j0, j1;
        range_keys(w, &j0, &j1);
        return (j1 - j0 + (w % nr == nr - 1 ? a.T : 0)) * (runs[w / nr].g1 - runs[w / nr].g0);
      },
      [&](int64_t w0, int64_t w1) {
        for (int64_t w = w0; w < w1; ++w) {
          const Run& run = runs[w / nr];
          int64_t j0, j1;
          range_keys(w, &j0, &j1);
          scores_unit<ND>(a, run.b, run.g0, run.g1, j0, j1, w % nr, w % nr == nr - 1);
        }
      });
  const int64_t rows = (p1 - p0) * a.rows;
  balanced_spans(
      rows, threads, parallel,
      [&](int64_t r) { return a.lens[(p0 + r / a.rows) / a.Hkv] + a.row_nt((p0 + r / a.rows) / a.Hkv, r % a.rows); },
      [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) softmax_row(a, p0 + r / a.rows, r % a.rows);
      });
  const int64_t units = (p1 - p0) * ND;
  balanced_spans(
      units, threads, parallel, [&](int64_t u) { return a.lens[(p0 + u / ND) / a.Hkv] + a.T; },
      [&](int64_t u0, int64_t u1) { values_units(a, u0, u1); });
}

template <int ND = 1>
void attend_group_nd(int64_t nd, Attn& a, int64_t p1, int64_t threads, bool parallel) {
  if constexpr (ND < 16)
    if (nd != ND) return attend_group_nd<ND + 1>(nd, a, p1, threads, parallel);
  attend_group<ND>(a, p1, threads, parallel);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#endif

// q [B, T, Hq, D] fp32; k, v [B, S, Hkv, D] fp32, unit stride in D and equal strides (the caller takes this path only
// then): tree_attention_step, then tree_attention_into (below the anonymous namespace).
at::Tensor tree_attention_fp32(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seqlens,
                               const at::Tensor& tree_mask, double scale) {
  const at::Tensor q = q_in.contiguous();
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3);
  TreeAttentionStep step = tree_attention_step(seqlens, tree_mask, B, T, Hq, k.size(2), D, k.size(1), scale);
  at::Tensor out = at::empty({B, T, Hq, D}, q.options());
  tree_attention_into(step, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), k.stride(0), k.stride(1),
                      k.stride(2), out.data_ptr<float>());
  return out;
}

at::Tensor tree_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seqlens,
                              const at::Tensor& tree_mask, std::optional<double> sm_scale) {
  check_tree_attention(q, k, v, seqlens, tree_mask);
  const int64_t B = q.size(0), T = q.size(1);
  if (q.scalar_type() == at::kFloat && k.stride(3) == 1 && v.strides() == k.strides())
    return tree_attention_fp32(q, k, v, seqlens, tree_mask,
                               sm_scale.has_value() ? *sm_scale : 1.0 / std::sqrt(static_cast<double>(q.size(3))));
  // Only rows [0, max_b seqlens[b] + T) can be attended: the rest of the buffer is never read. (The
  // masked rows inside that range are added -inf, so they must hold finite values, as the model's
  // zero-initialised, step-written buffer always does.)
  const int64_t S = std::min<int64_t>(k.size(1), seqlens.max().item<int64_t>() + T);
  at::Tensor allowed = key_mask(seqlens, tree_mask, B, T, S);
  at::Tensor ks = k.narrow(1, 0, S), vs = v.narrow(1, 0, S);
  // [B, T, H, D] -> [B, H, T, D] views (no copies); GQA: query head h reads KV head h / (Hq / Hkv)
  at::Tensor out = at::scaled_dot_product_attention(q.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2), allowed,
                                                    0.0, false, sm_scale, /*enable_gqa=*/q.size(2) != k.size(2));
  return out.transpose(1, 2);
}

}  // namespace

TreeAttentionStep tree_attention_step(const at::Tensor& seqlens, const at::Tensor& tree_mask, int64_t B, int64_t T,
                                      int64_t Hq, int64_t Hkv, int64_t D, int64_t cache_rows, double scale) {
  TreeAttentionStep st;
  st.B = B, st.T = T, st.Hq = Hq, st.Hkv = Hkv, st.D = D, st.scale = static_cast<float>(scale);
  const TreeBuffer tm = tree_buffer(tree_mask, 2, at::kBool);  // [T, T] shared (batch stride 0) or [B, T, T]
  st.mask = tm.t, st.mp = tm.t.data_ptr<bool>(), st.mb = tm.batch_stride;
  const at::Tensor sl = seqlens.to(at::kLong).contiguous();
  const int64_t* lens = sl.data_ptr<int64_t>();
  st.lens.assign(lens, lens + B);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] + T <= cache_rows, "tree_attention: seqlens[", b, "] + T = ", lens[b] + T,
                " exceeds the cache's rows");
    st.max_len = std::max(st.max_len, lens[b]);
    st.total_len += lens[b] + T;
  }
#ifdef HK_X86
  st.avx512 = cpu_has_avx512() && D <= 256;
  if (st.avx512) {
    st.nodes.resize(B * T * T);
    st.nt.resize(B * T);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < T; ++i) {
        const bool* mrow = st.mp + b * st.mb + i * T;
        int32_t n = 0;
        for (int64_t m = 0; m < T; ++m)
          if (mrow[m]) st.nodes[(b * T + i) * T + n++] = static_cast<int32_t>(m);
        st.nt[b * T + i] = n;
      }
    const int64_t nd = (D + 15) / 16, rows = (Hq / Hkv) * T, threads = at::get_num_threads();
    st.sstride = (st.max_len + T + 15) / 16 * 16;
    // ~4 flops per (row, key, d) in each of passes 1 and 3: small problems run on the calling thread. Inside a
    // decoding step the K/V rows come from DRAM (the layers' weights evicted them), so splitting pays from ~2^16
    // (SmolLM2, T = 1: from ~115 cached rows): a plain step at 300 rows 5% faster, at 200 2-3%, at 40-100 the
    // same (2026-11-27, EPYC VM, interleaved; 2^18 had been sized on a hot cache)
    st.parallel = threads > 1 && Hq * T * st.total_len * D >= (1 << 16);
    st.threads = threads;
    st.max_ranges = max_key_ranges(threads, st.max_len);
    // scratch floats per pair; pairs per group: as many as fit ~16 MiB (at least one)
    st.per_pair = rows * (st.sstride + st.max_ranges * 16 + nd * 16 + 1);
    st.group = std::clamp<int64_t>((int64_t{1} << 22) / st.per_pair, 1, B * Hkv);
    st.scratch = at::empty({st.group * st.per_pair}, at::TensorOptions().dtype(at::kFloat));
  }
#endif
  return st;
}

void tree_attention_into(TreeAttentionStep& st, const float* qp, const float* kp, const float* vp, int64_t sb,
                         int64_t ss, int64_t sh, float* op) {
  const int64_t B = st.B, T = st.T, Hq = st.Hq, Hkv = st.Hkv, D = st.D, G = Hq / Hkv;
  if (B * T * Hq * D == 0) return;
#ifdef HK_X86
  if (st.avx512) {  // AVX-512: the passes above over groups of (b, KV head) pairs
    const int64_t nd = (D + 15) / 16, rows = G * T, pairs = B * Hkv, group = st.group;
    Attn a{};
    a.q = qp, a.out = op, a.k = kp, a.v = vp, a.sb = sb, a.ss = ss, a.sh = sh;
    a.T = T, a.Hq = Hq, a.Hkv = Hkv, a.G = G, a.D = D, a.rows = rows, a.scale = st.scale;
    a.tail = static_cast<__mmask16>(D % 16 == 0 ? 0xFFFF : (1u << (D % 16)) - 1u);
    a.lens = st.lens.data(), a.nodes = st.nodes.data(), a.nt = st.nt.data(), a.sstride = st.sstride;
    float* s0 = st.scratch.data_ptr<float>();
    a.scores = s0, a.mx = s0 + group * rows * st.sstride, a.o = a.mx + group * rows * st.max_ranges * 16;
    a.inv_l = a.o + group * rows * nd * 16;
    for (int64_t p0 = 0; p0 < pairs; p0 += group) {
      a.p0 = p0;
      attend_group_nd(nd, a, std::min(pairs, p0 + group), st.threads, st.parallel);
    }
    return;
  }
#endif
  // otherwise rows (b, i, h) one at a time, in parallel. grain: a row is ~L * D * 4 flops; small problems stay on one
  // thread (no fork/join for T = 1)
  const int64_t* lens = st.lens.data();
  const bool* mp = st.mp;
  const int64_t mb = st.mb, max_len = st.max_len, nrows = B * T * Hq;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, (max_len + T) * D));
#ifdef HK_X86
  void (*const attend_row)(const RowArgs&) = cpu_has_avx2_fma() ? attend_row_avx2 : attend_row_portable;
#else
  void (*const attend_row)(const RowArgs&) = attend_row_portable;
#endif
  at::parallel_for(0, nrows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> key_rows(max_len + T);
    std::vector<float> scores(max_len + T + 16);
    int64_t cached_bi = -1, L = 0;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t h = r % Hq, bi = r / Hq, i = bi % T, b = bi / T;
      if (bi != cached_bi) {  // the row's keys: prefix, then ancestors-or-self in node order
        const int64_t len = lens[b];
        for (int64_t j = 0; j < len; ++j) key_rows[j] = j;
        L = len;
        const bool* mrow = mp + b * mb + i * T;  // node i's ancestors-or-self in sequence b's tree
        for (int64_t n = 0; n < T; ++n)
          if (mrow[n]) key_rows[L++] = len + n;
        cached_bi = bi;
      }
      attend_row({qp + r * D, kp + b * sb + (h / G) * sh, vp + b * sb + (h / G) * sh, ss, key_rows.data(), L,
                           D, st.scale, scores.data(), op + r * D});
    }
  });
}

TORCH_LIBRARY_FRAGMENT(hydra_kernels, m) {
  m.def("tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor tree_mask, "
        "float? sm_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(hydra_kernels, CPU, m) { m.impl("tree_attention", &tree_attention_cpu); }

}  // namespace hydra_kernels
