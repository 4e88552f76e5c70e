// tree_attention on the CPU: the tree mask expanded to a [B, 1, T, S] key mask, then ATen's CPU
// flash-attention kernel (blocked online softmax, fp32 accumulation, GQA, strided K/V read in place).
//
// Why not the reference's formula: it permutes the [B, S, Hkv, D] cache to [B, Hkv, S, D] and the
// batched matmul then copies K and V of every layer on every step (measured 3x slower at batch 1,
// 14x at batch 64 on a 2-core Xeon). The flash kernel reads the cache through its strides.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <vector>

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
  TORCH_CHECK(tree_mask.dim() == 2 && tree_mask.size(0) == T && tree_mask.size(1) == T &&
                  tree_mask.scalar_type() == at::kBool,
              "tree_attention: tree_mask must be bool [T, T] = [", T, ", ", T, "], got ", tree_mask.scalar_type(), " ",
              tree_mask.sizes());
  TORCH_CHECK(seqlens.dim() == 1 && seqlens.size(0) == q.size(0) &&
                  (seqlens.scalar_type() == at::kInt || seqlens.scalar_type() == at::kLong),
              "tree_attention: cache_seqlens must be int32/int64 [B]");
  for (const at::Tensor* t : {&k, &v, &seqlens, &tree_mask})
    TORCH_CHECK(t->device() == q.device(), "tree_attention: all inputs must be on one device");
}

// allowed[b, 0, i, j]: j < seqlens[b] (committed prefix), or j - seqlens[b] = node n in [0, T) with
// tree_mask[i, n] (ancestor-or-self). Rows past the tree stay masked.
at::Tensor key_mask(const at::Tensor& seqlens, const at::Tensor& tree_mask, int64_t B, int64_t T, int64_t S) {
  at::Tensor allowed = at::empty({B, 1, T, S}, tree_mask.options());
  at::Tensor tm = tree_mask.contiguous();
  at::Tensor sl = seqlens.to(at::kLong).contiguous();
  const bool* tmp = tm.data_ptr<bool>();
  const int64_t* s = sl.data_ptr<int64_t>();
  bool* out = allowed.data_ptr<bool>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = s[b];
    TORCH_CHECK(len >= 0 && len + T <= S, "tree_attention: seqlens[", b, "] + T = ", len + T,
                " exceeds the cache's rows");
    for (int64_t i = 0; i < T; ++i) {
      bool* row = out + (b * T + i) * S;
      std::memset(row, 1, static_cast<size_t>(len));
      std::memcpy(row + len, tmp + i * T, static_cast<size_t>(T));
      std::memset(row + len + T, 0, static_cast<size_t>(S - len - T));
    }
  }
  return allowed;
}

at::Tensor tree_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seqlens,
                              const at::Tensor& tree_mask, std::optional<double> sm_scale) {
  check_tree_attention(q, k, v, seqlens, tree_mask);
  const int64_t B = q.size(0), T = q.size(1);
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
