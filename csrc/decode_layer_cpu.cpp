// One decoder layer of a CPU decoding step (a plain token or a verified tree) in one op call.
//
// The layer is the Python one (hydra_kernels/model/layers.py TransformerBlock, attention.py step path), op for
// op: the same ATen ops and our kernels in the same order on the same values, so its output is bit-identical
// (tests/test_decode_layer.py). What changes is where the ~40 small ops of a layer are dispatched from: a
// Python call costs several microseconds of interpreter and argument parsing, a C++ call into ATen about one,
// and at 135M parameters a step's kernels take ~5 ms, so the Python around 30 layers was a third of a step.
//
// Linear layers come as (weights, kind): kind 0 = packed fp32 / bf16 panels (packed_linear), else the quantized
// panels of quantized_linear with kind = 10 * bits + offset (40, 41, 80, 81).
#include <ATen/ATen.h>
#include <ATen/TensorIndexing.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

namespace hydra_kernels {
namespace {

using at::indexing::Slice;

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t kind, int64_t N, const std::optional<at::Tensor>& b) {
  if (kind == 0) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("hydra_kernels::packed_linear", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&)>();
    return op.call(x, w, N, b);
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hydra_kernels::quantized_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, bool,
                                         const std::optional<at::Tensor>&, int64_t)>();
  return op.call(x, w, N, kind / 10, kind % 2 == 1, b, 0);
}

at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seqlens,
                          const at::Tensor& mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hydra_kernels::tree_attention", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, std::optional<double>)>();
  return op.call(q, k, v, seqlens, mask, std::nullopt);
}

// x [B, T, H] -> the layer's output [B, T, H]; kv this layer's buffer [2, B, S, Hkv, D], written at rows
// (batch_index [B, 1], rows [B, T]); attention over buffer rows [0, kv_len) through tree_attention.
at::Tensor decode_layer_cpu(const at::Tensor& x, const at::Tensor& attn_norm, const at::Tensor& ffn_norm, double eps,
                            const at::Tensor& wqkv, int64_t wqkv_kind, const std::optional<at::Tensor>& wqkv_bias,
                            const at::Tensor& wo, int64_t wo_kind, const std::optional<at::Tensor>& wo_bias,
                            const at::Tensor& w13, int64_t w13_kind, const std::optional<at::Tensor>& w13_bias,
                            const at::Tensor& w2, int64_t w2_kind, const std::optional<at::Tensor>& w2_bias,
                            int64_t n_heads, int64_t n_kv_heads, int64_t intermediate, const at::Tensor& cos,
                            const at::Tensor& sin, const at::Tensor& kv, const at::Tensor& batch_index,
                            const at::Tensor& rows, const at::Tensor& seqlens, const at::Tensor& tree_mask,
                            int64_t kv_len) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat, "decode_layer: x must be fp32 [B, T, H], got ",
              x.scalar_type(), " ", x.sizes());
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = cos.size(-1), half = D / 2;
  TORCH_CHECK(kv.dim() == 5 && kv.size(0) == 2 && kv.size(1) == B && kv.size(3) == n_kv_heads && kv.size(4) == D &&
                  kv_len <= kv.size(2),
              "decode_layer: kv must be [2, B, S >= kv_len, Hkv, D], got ", kv.sizes());
  const std::vector<int64_t> norm_shape{H};
  // attention: h = x + wo(attention(attention_norm(x)))
  const at::Tensor xn = at::rms_norm(x, norm_shape, attn_norm, eps);
  const at::Tensor heads =
      linear(xn, wqkv, wqkv_kind, (n_heads + 2 * n_kv_heads) * D, wqkv_bias).view({B, T, n_heads + 2 * n_kv_heads, D});
  const at::Tensor qk_in = heads.slice(2, 0, n_heads + n_kv_heads);  // q and k heads: one rotation (rope.py)
  const at::Tensor rotated = at::cat({qk_in.slice(-1, half, D).neg(), qk_in.slice(-1, 0, half)}, -1);
  const at::Tensor qk = qk_in * cos.unsqueeze(2) + rotated * sin.unsqueeze(2);
  const at::Tensor q = qk.slice(2, 0, n_heads), k = qk.slice(2, n_heads, n_heads + n_kv_heads);
  const at::Tensor v = heads.slice(2, n_heads + n_kv_heads, n_heads + 2 * n_kv_heads);
  const at::Tensor k_cache = kv.select(0, 0).slice(1, 0, kv_len), v_cache = kv.select(0, 1).slice(1, 0, kv_len);
  at::Tensor(kv).index_put_({Slice(), batch_index, rows}, at::stack({k, v}));  // in place (Tensor(a!))
  const at::Tensor o = tree_attention(q, k_cache, v_cache, seqlens, tree_mask);
  const at::Tensor h = x + linear(o.flatten(2), wo, wo_kind, H, wo_bias);
  // SwiGLU: out = h + w2(silu(gate) * up), [gate, up] = w13(ffn_norm(h))
  const at::Tensor gu = linear(at::rms_norm(h, norm_shape, ffn_norm, eps), w13, w13_kind, 2 * intermediate, w13_bias);
  return h + linear(at::silu(gu.slice(-1, 0, intermediate)) * gu.slice(-1, intermediate, 2 * intermediate), w2,
                    w2_kind, H, w2_bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hydra_kernels, m) {
  m.def(
      "decode_layer(Tensor x, Tensor attn_norm, Tensor ffn_norm, float eps, Tensor wqkv, int wqkv_kind, "
      "Tensor? wqkv_bias, Tensor wo, int wo_kind, Tensor? wo_bias, Tensor w13, int w13_kind, Tensor? w13_bias, "
      "Tensor w2, int w2_kind, Tensor? w2_bias, int n_heads, int n_kv_heads, int intermediate, Tensor cos, "
      "Tensor sin, Tensor(a!) kv, Tensor batch_index, Tensor rows, Tensor seqlens, Tensor tree_mask, int kv_len) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(hydra_kernels, CPU, m) { m.impl("decode_layer", &decode_layer_cpu); }

}  // namespace hydra_kernels
