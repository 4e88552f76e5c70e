// tree_attention on the CPU.
//
// fp32 (the CPU model's dtype): a hand-written kernel, one query row (b, i, h) at a time. Its keys
// are the committed prefix [0, seqlens[b]) then the row's tree ancestors-or-self in node order, read
// in place through the cache's strides; scores, max, exp and the weighted V sum run in that order
// with fp32 accumulation. A row's result therefore depends only on its own query and keys, not on T
// or the rest of the tree: a token's attention output is bit-identical in a 1-token decoding step and
// inside a verified tree (with the packed linears, so is the whole forward: exact by construction).
// It is also ~5x faster than the library kernel at these sizes (T <= 32 rows, hundreds of keys: the
// work is a few microseconds per row, the generic kernel's setup was most of the ~100 us per layer).
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

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "cpu_features.h"
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

void attend_row_portable(const RowArgs& a) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < a.L; ++j) {
    const float* kr = a.k + a.key_rows[j] * a.row_stride;
    float s = 0.0f;
    for (int64_t d = 0; d < a.D; ++d) s = std::fma(a.q[d], kr[d], s);
    a.scores[j] = s * a.scale;
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

#ifdef HK_X86
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

// The same math 16 lanes at a time: D in chunks of 16 (a masked tail for D % 16), scores' exp 16 keys
// at a time. The order of every sum is fixed by D and L alone.
__attribute__((target("avx512f"))) void attend_row_avx512(const RowArgs& a) {
  const int64_t D = a.D, nd = (D + 15) / 16;
  const __mmask16 tail = static_cast<__mmask16>(D % 16 == 0 ? 0xFFFF : (1u << (D % 16)) - 1u);
  constexpr int kMaxChunks = 16;  // D <= 256
  __m512 q[kMaxChunks];
  for (int64_t c = 0; c < nd; ++c)
    q[c] = _mm512_maskz_loadu_ps(c == nd - 1 ? tail : static_cast<__mmask16>(0xFFFF), a.q + 16 * c);
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < a.L; ++j) {
    const float* kr = a.k + a.key_rows[j] * a.row_stride;
    __m512 acc = _mm512_mul_ps(q[0], _mm512_maskz_loadu_ps(nd == 1 ? tail : static_cast<__mmask16>(0xFFFF), kr));
    for (int64_t c = 1; c < nd; ++c)
      acc = _mm512_fmadd_ps(q[c], _mm512_maskz_loadu_ps(c == nd - 1 ? tail : static_cast<__mmask16>(0xFFFF), kr + 16 * c),
                            acc);
    const float s = _mm512_reduce_add_ps(acc) * a.scale;
    a.scores[j] = s;
    m = std::max(m, s);
  }
  // p_j = exp(s_j - m) in place, 16 at a time; l = sum of p_j in a fixed lane-then-reduce order
  const __m512 mv = _mm512_set1_ps(m);
  __m512 lsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < a.L; j += 16) {
    const int64_t left = a.L - j;
    const __mmask16 mk = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1u);
    const __m512 p = _mm512_maskz_mov_ps(mk, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, a.scores + j), mv)));
    _mm512_mask_storeu_ps(a.scores + j, mk, p);
    lsum = _mm512_add_ps(lsum, p);
  }
  const float l = _mm512_reduce_add_ps(lsum);
  __m512 o[kMaxChunks];
  for (int64_t c = 0; c < nd; ++c) o[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < a.L; ++j) {
    const float* vr = a.v + a.key_rows[j] * a.row_stride;
    const __m512 p = _mm512_set1_ps(a.scores[j]);
    for (int64_t c = 0; c < nd; ++c)
      o[c] = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(c == nd - 1 ? tail : static_cast<__mmask16>(0xFFFF), vr + 16 * c),
                             o[c]);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / l);
  for (int64_t c = 0; c < nd; ++c)
    _mm512_mask_storeu_ps(a.out + 16 * c, c == nd - 1 ? tail : static_cast<__mmask16>(0xFFFF), _mm512_mul_ps(o[c], inv));
}

#endif

// q [B, T, Hq, D] fp32; k, v [B, S, Hkv, D] fp32, unit stride in D and equal strides (the caller takes
// this path only then); rows (b, i, h) in parallel.
at::Tensor tree_attention_fp32(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seqlens,
                               const at::Tensor& tree_mask, double scale) {
  const at::Tensor q = q_in.contiguous();
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3), Hkv = k.size(2), G = Hq / Hkv;
  const TreeBuffer tm = tree_buffer(tree_mask, 2, at::kBool);  // [T, T] shared (batch stride 0) or [B, T, T]
  const at::Tensor sl = seqlens.to(at::kLong).contiguous();
  const bool* mp = tm.t.data_ptr<bool>();
  const int64_t mb = tm.batch_stride;
  const int64_t* lens = sl.data_ptr<int64_t>();
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] + T <= k.size(1), "tree_attention: seqlens[", b, "] + T = ", lens[b] + T,
                " exceeds the cache's rows");
    max_len = std::max(max_len, lens[b]);
  }
  at::Tensor out = at::empty({B, T, Hq, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t sb = k.stride(0), ss = k.stride(1), sh = k.stride(2);
  const bool fast = cpu_has_avx512() && D <= 256;
  // grain: a row is ~L * D * 4 flops; small problems stay on one thread (no fork/join for T = 1)
  const int64_t rows = B * T * Hq, grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, (max_len + T) * D));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
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
      RowArgs a{qp + r * D, kp + b * sb + (h / G) * sh, vp + b * sb + (h / G) * sh, ss, key_rows.data(), L, D,
                static_cast<float>(scale), scores.data(), op + r * D};
#ifdef HK_X86
      if (fast) {
        attend_row_avx512(a);
        continue;
      }
#endif
      attend_row_portable(a);
    }
  });
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

TORCH_LIBRARY_FRAGMENT(hydra_kernels, m) {
  m.def("tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor tree_mask, "
        "float? sm_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(hydra_kernels, CPU, m) { m.impl("tree_attention", &tree_attention_cpu); }

}  // namespace hydra_kernels
