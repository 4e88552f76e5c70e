// A CPU decoding step's whole layer stack (a plain token or a verified tree) in one op call, and the row norm
// the model's RMSNorm runs on the CPU.
//
// Why one call for all layers: at SmolLM2-135M a step's kernels (the quantized projections and attention) take
// ~5 ms, and the work around them was as large again (2026-11-27, EPYC VM, loaded profile of a plain step:
// 9.8 ms a step, 7.3 ms of it inside 30 per-layer native calls, 2.4 ms of Python choosing their arguments;
// inside a layer, ~40 ATen ops of a few microseconds each: the composite rms_norm alone was 10 us a call).
// Here a layer is its four projections and attention (our kernels, called directly on one workspace: step_kernels.h)
// plus loops over rows for everything elementwise: the norms, RoPE with the cache write, the residual adds, SwiGLU's
// product. SiLU stays ATen's (at::silu_out: the module path's exp, so the values stay the module path's bit for bit).
//
// Exactness: every elementwise loop is the module path's math in its rounding order (x * cos + rot * sin as
// two rounded products and a rounded sum; GCC contracts a * b + c into an fma by default in C++, so setup.py
// builds the extension with -ffp-contract=off, and tests/test_decode_stack.py fails on a build without it), and the row
// norm below is the one RMSNorm.forward runs on the CPU (the op rms_norm_rows), so the stack's output, logits
// and KV cache equal the Python layers' bit for bit (tests/test_decode_stack.py). Each row's values depend
// only on that row (and, in attention, on its own keys), so a token's logits are the same alone and in a tree.
//
// Linear layers come as (weights, kind): kind 0 = packed fp32 / bf16 panels (packed_linear), else the quantized
// panels of quantized_linear with kind = 10 * bits + offset (40, 41, 80, 81), + 100 where the scales are stored fp16,
// + 1000 for int8_dot_linear's panels (step_kernels.h: QuantizedKind).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "step_kernels.h"

namespace hydra_kernels {
namespace {

constexpr int kLanes = 16;  // the norm's accumulator lanes: element i adds into lane i % 16 (an AVX-512 register)

// y = (x * r) * w, r = 1 / sqrt(sum(x^2) / H + eps). The sum runs in a fixed order whatever the ISA or the row
// count: lane l accumulates x[i]^2 for i = l mod 16 in increasing i (a product, then an add: no fma), then the
// lanes fold 16 -> 8 -> 4 -> 2 -> 1 (lane l += lane l + s). The compiler may vectorize the lanes, which keeps
// each lane's sequence of roundings, so the result is the same scalar or in vectors.
void rms_norm_row(const float* x, const float* w, float eps, int64_t H, float* y) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= H; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += x[i + l] * x[i + l];
  for (int l = 0; i + l < H; ++l) acc[l] += x[i + l] * x[i + l];
  for (int s = kLanes / 2; s > 0; s /= 2)
    for (int l = 0; l < s; ++l) acc[l] += acc[l + s];
  const float r = 1.0f / std::sqrt(acc[0] / static_cast<float>(H) + eps);
  for (i = 0; i < H; ++i) y[i] = (x[i] * r) * w[i];
}

}  // namespace

void rms_norm_rows_into(const float* x, const float* w, float eps, int64_t M, int64_t H, float* y) {
  // a row is ~3H flops: prefill chunks (hundreds of rows) split across threads, a step's few rows do not
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, H));
  at::parallel_for(0, M, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_norm_row(x + r * H, w, eps, H, y + r * H);
  });
}

namespace {

// x [..., H] fp32 -> rms_norm_row of each row (the CPU RMSNorm of model/layers.py).
at::Tensor rms_norm_rows_cpu(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.dim() >= 1,
              "rms_norm_rows: x and weight must be fp32, got ", x.scalar_type(), " and ", w.scalar_type());
  const int64_t H = x.size(-1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == H, "rms_norm_rows: weight must be [H = ", H, "], got ", w.sizes());
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor y = at::empty_like(xc);
  rms_norm_rows_into(xc.data_ptr<float>(), wc.data_ptr<float>(), static_cast<float>(eps), xc.numel() / std::max<int64_t>(1, H), H,
                     y.data_ptr<float>());
  return y;
}

}  // namespace

void step_linear(const float* x, int64_t M, const at::Tensor& w, int64_t kind, int64_t N, const float* bias, float* y) {
  if (kind == 0)
    packed_linear_into(x, M, w, N, bias, y);
  else if (const QuantizedKind k(kind); k.int8_dot)
    int8_dot_linear_into(x, M, w, N, k.bits, k.offset, k.half, bias, y);
  else
    quantized_linear_into(x, M, w, N, k.bits, k.offset, k.half, bias, y);
}

void check_quantized_kind(const at::Tensor& w, int64_t kind, int64_t N, int64_t K) {
  const QuantizedKind k(kind);
  if (k.int8_dot)
    check_int8_dot_panels(w, N, K, k.bits, k.offset, k.half);
  else
    check_quantized_panels(w, N, K, k.bits, k.offset, k.half);
}

void check_step_weight(const char* op, const char* name, const at::Tensor& w, int64_t kind, int64_t N, int64_t K) {
  if (kind != 0) return check_quantized_kind(w, kind, N, K);
  TORCH_CHECK(w.dim() == 3 && w.size(1) == K && w.size(2) == 64 && w.is_contiguous() &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16) && N > (w.size(0) - 1) * 64 &&
                  N <= w.size(0) * 64,
              op, ": ", name, " must be packed panels [ceil(", N, " / 64), ", K, ", 64] (fp32 or bf16) for its [", N,
              ", ", K, "] weight, got ", w.scalar_type(), " ", w.sizes());
}

namespace {

// Rotate-half RoPE of one head (reference.apply_rope): out[d] = x[d] * c[d] + rot[d] * s[d], rot = (-x[half:],
// x[:half]); each product rounded, then the sum (ATen's mul, mul, add).
inline void rope_head(const float* x, const float* c, const float* s, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) {
    const float a = x[d] * c[d], b = -x[d + half] * s[d];
    out[d] = a + b;
  }
  for (int64_t d = half; d < D; ++d) {
    const float a = x[d] * c[d], b = x[d - half] * s[d];
    out[d] = a + b;
  }
}

struct Shape {
  int64_t B, T, H, Hq, Hkv, D, I, S;
};

// One step's buffers, reused by every layer (one allocation a step, where each layer made ~10): the normed inputs,
// q / k / v, attention's output, the residual stream between the two halves, the FFN's gate and up, its product.
struct Workspace {
  at::Tensor t;
  float *xn, *qkv, *q, *o, *h, *hn, *gu, *act;
  at::Tensor gate_view, act_view;  // [M, I] views of gu's gate half and of act, for at::silu_out
  Workspace(const Shape& s, const at::TensorOptions& opts) {
    const int64_t M = s.B * s.T, NH = s.Hq + 2 * s.Hkv;
    const int64_t sizes[8] = {M * s.H, M * NH * s.D, M * s.Hq * s.D, M * s.Hq * s.D, M * s.H, M * s.H, M * 2 * s.I, M * s.I};
    int64_t total = 0;
    for (int64_t n : sizes) total += n;
    t = at::empty({total}, opts);
    float* p = t.data_ptr<float>();
    float** slots[8] = {&xn, &qkv, &q, &o, &h, &hn, &gu, &act};
    for (int i = 0; i < 8; ++i) {
      *slots[i] = p;
      p += sizes[i];
    }
    gate_view = t.narrow(0, gu - t.data_ptr<float>(), M * 2 * s.I).view({M, 2 * s.I}).narrow(1, 0, s.I);
    act_view = t.narrow(0, act - t.data_ptr<float>(), M * s.I).view({M, s.I});
  }
};

// One layer: x [B, T, H] (contiguous) -> y (its output, [B, T, H]); kv_layer this layer's buffer [2, B, S, Hkv, D]
// (contiguous), rows [B, T] the new tokens' cache rows (checked in [0, S) by the caller); attention over the rows
// [0, kv_len) of each sequence, with the step's lengths and tree (attn).
void layer(const float* x, float* y, const Shape& s, const float* attn_norm, const float* ffn_norm, float eps,
           const at::TensorList w, const std::vector<const float*>& bias, int64_t wbase, const std::vector<int64_t>& kinds,
           const float* cos, const float* sin, float* kvp, const int64_t* rows, TreeAttentionStep& attn, Workspace& ws) {
  const int64_t M = s.B * s.T, NH = s.Hq + 2 * s.Hkv, D = s.D;
  rms_norm_rows_into(x, attn_norm, eps, M, s.H, ws.xn);
  step_linear(ws.xn, M, w[wbase], kinds[wbase], NH * D, bias[wbase], ws.qkv);  // [B, T, NH*D]
  // RoPE on the q and k heads; k and v written to the cache rows; q kept for attention
  const int64_t plane = s.B * s.S * s.Hkv * D;  // the V buffer's offset from the K buffer's
  for (int64_t m = 0; m < M; ++m) {
    const int64_t b = m / s.T;
    const float *row = ws.qkv + m * NH * D, *c = cos + m * D, *sn = sin + m * D;
    for (int64_t h = 0; h < s.Hq; ++h) rope_head(row + h * D, c, sn, D, ws.q + (m * s.Hq + h) * D);
    float* kdst = kvp + (b * s.S + rows[m]) * s.Hkv * D;
    for (int64_t h = 0; h < s.Hkv; ++h) {
      rope_head(row + (s.Hq + h) * D, c, sn, D, kdst + h * D);
      std::copy_n(row + (s.Hq + s.Hkv + h) * D, D, kdst + plane + h * D);
    }
  }
  tree_attention_into(attn, ws.q, kvp, kvp + plane, s.S * s.Hkv * D, s.Hkv * D, D, ws.o);
  // h = x + wo(o)
  step_linear(ws.o, M, w[wbase + 1], kinds[wbase + 1], s.H, bias[wbase + 1], ws.h);
  for (int64_t i = 0; i < M * s.H; ++i) ws.h[i] = x[i] + ws.h[i];
  // y = h + w2(silu(gate) * up), [gate, up] = w13(ffn_norm(h))
  rms_norm_rows_into(ws.h, ffn_norm, eps, M, s.H, ws.hn);
  step_linear(ws.hn, M, w[wbase + 2], kinds[wbase + 2], 2 * s.I, bias[wbase + 2], ws.gu);  // [B, T, 2I]
  at::silu_out(ws.act_view, ws.gate_view);  // ATen's SiLU: the module path's values
  {
    const float* up = ws.gu + s.I;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t i = 0; i < s.I; ++i) ws.act[m * s.I + i] = ws.act[m * s.I + i] * up[m * 2 * s.I + i];
  }
  step_linear(ws.act, M, w[wbase + 3], kinds[wbase + 3], s.H, bias[wbase + 3], y);
  for (int64_t i = 0; i < M * s.H; ++i) y[i] = ws.h[i] + y[i];
}

}  // namespace

// The decode_stack op (its contract: step_kernels.h).
std::tuple<at::Tensor, at::Tensor> decode_stack_cpu(
    const at::Tensor& x_in, at::TensorList weights, at::IntArrayRef kinds, const c10::List<std::optional<at::Tensor>>& biases,
    at::TensorList norms, double eps, int64_t n_heads, int64_t n_kv_heads, int64_t intermediate, const at::Tensor& cos_in,
    const at::Tensor& sin_in, const at::Tensor& kv, const at::Tensor& rows_in, const at::Tensor& seqlens,
    const at::Tensor& tree_mask, int64_t kv_len, at::IntArrayRef capture, const std::optional<at::Tensor>& attend) {
  TORCH_CHECK(x_in.dim() == 3 && x_in.scalar_type() == at::kFloat, "decode_stack: x must be fp32 [B, T, H], got ",
              x_in.scalar_type(), " ", x_in.sizes());
  const int64_t L = kv.size(0), B = x_in.size(0), T = x_in.size(1), H = x_in.size(2);
  TORCH_CHECK(kv.dim() == 6 && kv.size(1) == 2 && kv.size(2) == B && kv.size(4) == n_kv_heads &&
                  kv.scalar_type() == at::kFloat && kv.is_contiguous(),
              "decode_stack: kv must be a contiguous fp32 [L, 2, B, S, Hkv = ", n_kv_heads, ", D] buffer, got ",
              kv.scalar_type(), " ", kv.sizes());
  const int64_t S = kv.size(3), D = kv.size(5);
  TORCH_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "decode_stack: n_heads ", n_heads,
              " must be a multiple of n_kv_heads ", n_kv_heads);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 4 * L && static_cast<int64_t>(kinds.size()) == 4 * L &&
                  static_cast<int64_t>(biases.size()) == 4 * L && static_cast<int64_t>(norms.size()) == 2 * L,
              "decode_stack: 4 weights, kinds and biases and 2 norms per layer for ", L, " layers, got ", weights.size(),
              ", ", kinds.size(), ", ", biases.size(), ", ", norms.size());
  for (const at::Tensor& n : norms)
    TORCH_CHECK(n.dim() == 1 && n.size(0) == H && n.scalar_type() == at::kFloat && n.is_contiguous(),
                "decode_stack: norm weights must be contiguous fp32 [H = ", H, "]");
  TORCH_CHECK(cos_in.sizes() == sin_in.sizes() && cos_in.dim() == 3 && cos_in.size(0) == B && cos_in.size(1) == T &&
                  cos_in.size(2) == D && cos_in.scalar_type() == at::kFloat && sin_in.scalar_type() == at::kFloat,
              "decode_stack: cos/sin must be fp32 [B, T, D] = [", B, ", ", T, ", ", D, "], got ", cos_in.sizes());
  TORCH_CHECK(L > 0 && D % 2 == 0, "decode_stack: at least one layer and an even head_dim (RoPE), got ", L, " and ", D);
  TORCH_CHECK(rows_in.dim() == 2 && rows_in.size(0) == B && rows_in.size(1) == T && rows_in.scalar_type() == at::kLong,
              "decode_stack: rows must be int64 [B, T] = [", B, ", ", T, "]");
  TORCH_CHECK(0 < kv_len && kv_len <= S, "decode_stack: kv_len ", kv_len, " must be in (0, ", S, "]");
  // Everything the layers rely on is checked before the first layer writes its cache rows: the rows, then the
  // committed lengths and the tree mask that attention reads (tree_attention checks them again, per layer)
  const at::Tensor rows = rows_in.contiguous();
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t m = 0; m < B * T; ++m)  // a row outside the buffer would write another sequence's memory
    TORCH_CHECK(0 <= rp[m] && rp[m] < S, "decode_stack: cache row ", rp[m], " outside the buffer's [0, ", S, ")");
  TORCH_CHECK(seqlens.dim() == 1 && seqlens.size(0) == B &&
                  (seqlens.scalar_type() == at::kInt || seqlens.scalar_type() == at::kLong),
              "decode_stack: seqlens must be int32/int64 [B = ", B, "]");
  const at::Tensor lens = seqlens.to(at::kLong).contiguous();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lens.data_ptr<int64_t>()[b];
    TORCH_CHECK(0 <= n && n + T <= kv_len, "decode_stack: seqlens[", b, "] = ", n, ": the step's rows [", n, ", ", n + T,
                ") must lie in the attention's [0, kv_len = ", kv_len, ")");
  }
  TORCH_CHECK(tree_mask.scalar_type() == at::kBool &&
                  ((tree_mask.dim() == 2) || (tree_mask.dim() == 3 && tree_mask.size(0) == B)) &&
                  tree_mask.size(-1) == T && tree_mask.size(-2) == T,
              "decode_stack: tree_mask must be bool [T, T] or [B, T, T] with T = ", T, ", got ", tree_mask.sizes());
  for (int64_t c : capture) TORCH_CHECK(0 <= c && c < L, "decode_stack: capture layer ", c, " not in [0, ", L, ")");
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const std::vector<int64_t> kind_list(kinds.begin(), kinds.end());
  std::vector<const float*> bias_ptrs(biases.size(), nullptr);
  const int64_t outputs[4] = {(n_heads + 2 * n_kv_heads) * D, H, 2 * intermediate, H};  // wqkv, wo, w13, w2
  const int64_t inputs[4] = {H, n_heads * D, H, intermediate};
  for (size_t i = 0; i < weights.size(); ++i)  // each weight's layout against its projection's shape
    check_step_weight("decode_stack", "a layer weight", weights[i], kind_list[i], outputs[i % 4], inputs[i % 4]);
  for (size_t i = 0; i < biases.size(); ++i) {
    const std::optional<at::Tensor> b = biases.get(i);
    if (!b.has_value()) continue;
    TORCH_CHECK(b->scalar_type() == at::kFloat && b->dim() == 1 && b->is_contiguous() && b->size(0) == outputs[i % 4],
                "decode_stack: bias ", i, " must be a contiguous fp32 vector of its projection's ", outputs[i % 4],
                " outputs, got ", b->scalar_type(), " ", b->sizes());
    bias_ptrs[i] = b->data_ptr<float>();
  }
  const Shape s{B, T, H, n_heads, n_kv_heads, D, intermediate, S};
  // the prefix each sequence attends over: its committed length, or none where attend is 0 (a finished sequence of
  // the batch, whose outputs nobody reads): at 8k tokens a sequence's attention is ~3/4 of its share of a step
  // (Xeon AMX VM, 2026-11-30, benchmarks/bench_verify_step.py --context 8000: batch 1 25 ms, batch 2 44 ms), which a
  // batch kept paying for every sequence that had finished, until its last one did
  at::Tensor attend_lens = lens;
  if (attend.has_value()) {
    TORCH_CHECK(attend->dim() == 1 && attend->size(0) == B && attend->scalar_type() == at::kLong,
                "decode_stack: attend must be int64 [B = ", B, "], got ", attend->scalar_type(), " ", attend->sizes());
    attend_lens = lens.clone();
    const at::Tensor a = attend->contiguous();
    for (int64_t b = 0; b < B; ++b)
      if (a.data_ptr<int64_t>()[b] == 0) attend_lens.data_ptr<int64_t>()[b] = 0;
  }
  // the step's lengths and trees, once for all layers (each reads them the same way)
  TreeAttentionStep attn = tree_attention_step(attend_lens, tree_mask, B, T, n_heads, n_kv_heads, D, kv_len,
                                               1.0 / std::sqrt(static_cast<double>(D)));
  Workspace ws(s, x_in.options());
  // layer outputs alternate between two buffers; the last layer writes the returned tensor
  at::Tensor out = at::empty({B, T, H}, x_in.options()), ping = at::empty({2, B * T * H}, x_in.options());
  const int64_t C = static_cast<int64_t>(capture.size()), M = B * T;
  at::Tensor feats = C ? at::empty({B, T, C * H}, x_in.options()) : at::empty({0}, x_in.options());
  const at::Tensor x0 = x_in.contiguous();
  const float* x = x0.data_ptr<float>();
  float* kv0 = kv.data_ptr<float>();
  const int64_t kv_layer_stride = kv.stride(0);
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t c = 0; c < C; ++c)  // a captured layer's input: column block c of the features (at::cat's layout)
      if (capture[c] == l)
        for (int64_t m = 0; m < M; ++m) std::copy_n(x + m * H, H, feats.data_ptr<float>() + (m * C + c) * H);
    float* y = l == L - 1 ? out.data_ptr<float>() : ping.data_ptr<float>() + (l % 2) * M * H;
    layer(x, y, s, norms[2 * l].data_ptr<float>(), norms[2 * l + 1].data_ptr<float>(), static_cast<float>(eps), weights,
          bias_ptrs, 4 * l, kind_list, cos.data_ptr<float>(), sin.data_ptr<float>(), kv0 + l * kv_layer_stride, rp, attn,
          ws);
    x = y;
  }
  return {out, feats};
}

TORCH_LIBRARY_FRAGMENT(hydra_kernels, m) {
  m.def("rms_norm_rows(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def(
      "decode_stack(Tensor x, Tensor[] weights, int[] kinds, Tensor?[] biases, Tensor[] norms, float eps, int n_heads, "
      "int n_kv_heads, int intermediate, Tensor cos, Tensor sin, Tensor(a!) kv, Tensor rows, Tensor seqlens, "
      "Tensor tree_mask, int kv_len, int[] capture, Tensor? attend=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hydra_kernels, CPU, m) {
  m.impl("rms_norm_rows", &rms_norm_rows_cpu);
  m.impl("decode_stack", &decode_stack_cpu);
}

}  // namespace hydra_kernels
