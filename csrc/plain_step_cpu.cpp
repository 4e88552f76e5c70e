// A whole plain greedy decoding step on the CPU in one op call: each sequence's last token through the embedding,
// RoPE, the layer stack (decode_stack_cpu.cpp), the final norm, the LM head and the argmax, its cache row committed.
//
// Why: with the layer stack native (one call for 30 layers), a SmolLM2 plain step still spent ~0.55 ms of ~5.9 in
// Python and ATen around the stack and the LM head (the embedding lookup and its id checks, the RoPE rows, the step's
// masks and rows, the final norm, the argmax, the seqlens advance, the modules' attribute walks), while the second
// thread waited in libgomp (2026-11-28, EPYC VM: perf of a plain generate(), 29% of the worker's samples waiting).
//
// Exactness: every part is the function the module path runs (the quantized_rows lookup or a row copy of an fp32
// table; the RoPE table's rows; decode_stack_cpu; rms_norm_rows_into, the CPU RMSNorm; the LM head's own kernel;
// torch.argmax's first maximum, a NaN counting as the maximum), so the tokens, the KV cache and seqlens equal
// Llama.step + KVCache.advance + Llama.greedy_tokens bit for bit (tests/test_plain_step.py).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <optional>

#include "step_kernels.h"

namespace hydra_kernels {
namespace {

// torch.argmax of a row: the first maximum; a NaN is larger than every number (the first NaN wins).
int64_t first_argmax(const float* v, int64_t n) {
  int64_t best = 0;
  float bv = v[0];
  for (int64_t i = 1; i < n && !std::isnan(bv); ++i)
    if (std::isnan(v[i]) || v[i] > bv) best = i, bv = v[i];
  return best;
}

// tokens int64 [B]: each sequence's last token, written at cache row seqlens[b] (its position) -> (the next tokens int64
// [B], the final-normed hidden states fp32 [B, H] that picked them: a drafter's features); with commit, seqlens int32 [B]
// advanced by one (KVCache.advance; without it the caller commits: a speculative run's plain step, which commits only its
// active sequences after its drafter has seen the step). embed: the token table, fp32 [V, H] (embed_kind -1) or quantized panels of
// embed_rows rows (embed_kind: the quantized kind, 100 * fp16 scales + 10 * bits + offset). The stack's arguments as
// decode_stack's; final_norm fp32 [H] with final_eps; head: the LM head's panels of `vocab` rows (head_kind as a stack
// weight's kind: 0 packed fp32 / bf16, else quantized), no bias; cos_table / sin_table fp32 [n, D], rows >= every
// position; attention over cache rows [0, kv_len).
std::tuple<at::Tensor, at::Tensor> plain_greedy_step_cpu(const at::Tensor& tokens, const at::Tensor& embed, int64_t embed_kind, int64_t embed_rows,
                                 at::TensorList weights, at::IntArrayRef kinds,
                                 const c10::List<std::optional<at::Tensor>>& biases, at::TensorList norms, double eps,
                                 int64_t n_heads, int64_t n_kv_heads, int64_t intermediate, const at::Tensor& final_norm,
                                 double final_eps, const at::Tensor& head, int64_t head_kind, int64_t vocab,
                                 const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& kv,
                                 at::Tensor seqlens, int64_t kv_len, bool commit) {
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong && tokens.is_contiguous(),
              "plain_greedy_step: tokens must be contiguous int64 [B], got ", tokens.scalar_type(), " ", tokens.sizes());
  const int64_t B = tokens.size(0);
  TORCH_CHECK(B > 0 && seqlens.dim() == 1 && seqlens.size(0) == B && seqlens.scalar_type() == at::kInt &&
                  seqlens.is_contiguous(),
              "plain_greedy_step: seqlens must be contiguous int32 [B = ", B, "], got ", seqlens.scalar_type(), " ",
              seqlens.sizes());
  TORCH_CHECK(final_norm.dim() == 1 && final_norm.scalar_type() == at::kFloat && final_norm.is_contiguous(),
              "plain_greedy_step: final_norm must be contiguous fp32 [H]");
  const int64_t H = final_norm.size(0);
  TORCH_CHECK(kv.dim() == 6, "plain_greedy_step: kv must be [L, 2, B, S, Hkv, D], got ", kv.sizes());
  const int64_t D = kv.size(5);
  TORCH_CHECK(cos_table.dim() == 2 && cos_table.sizes() == sin_table.sizes() && cos_table.size(1) == D &&
                  cos_table.scalar_type() == at::kFloat && sin_table.scalar_type() == at::kFloat &&
                  cos_table.is_contiguous() && sin_table.is_contiguous(),
              "plain_greedy_step: cos/sin tables must be contiguous fp32 [n, D = ", D, "], got ", cos_table.sizes());
  if (embed_kind < 0) {
    TORCH_CHECK(embed.dim() == 2 && embed.size(1) == H && embed.scalar_type() == at::kFloat && embed.is_contiguous(),
                "plain_greedy_step: an fp32 embedding must be contiguous [V, H = ", H, "], got ", embed.sizes());
    embed_rows = embed.size(0);
  }
  TORCH_CHECK(vocab > 0, "plain_greedy_step: vocab must be positive");
  // the embedding's and the LM head's layouts against H and vocab, before the stack writes a cache row
  if (embed_kind >= 0)
    check_quantized_panels(embed, embed_rows, H, embed_kind % 100 / 10, embed_kind % 2 == 1, embed_kind >= 100);
  if (head_kind == 0) {
    TORCH_CHECK(head.dim() == 3 && head.size(1) == H && head.size(2) == 64 && head.is_contiguous() &&
                    (head.scalar_type() == at::kFloat || head.scalar_type() == at::kBFloat16) &&
                    vocab > (head.size(0) - 1) * 64 && vocab <= head.size(0) * 64,
                "plain_greedy_step: the LM head must be packed panels [ceil(vocab / 64), H = ", H, ", 64] for vocab ", vocab,
                ", got ", head.scalar_type(), " ", head.sizes());
  } else {
    check_quantized_panels(head, vocab, H, head_kind % 100 / 10, head_kind % 2 == 1, head_kind >= 100);
  }
  const int64_t* tp = tokens.data_ptr<int64_t>();
  const int32_t* sp = seqlens.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(0 <= tp[b] && tp[b] < embed_rows, "plain_greedy_step: token ", tp[b], " of sequence ", b,
                " outside the embedding's [0, ", embed_rows, ")");
    TORCH_CHECK(0 <= sp[b] && sp[b] < cos_table.size(0), "plain_greedy_step: position ", sp[b], " of sequence ", b,
                " outside the RoPE table's [0, ", cos_table.size(0), ")");
  }
  const auto f32 = tokens.options().dtype(at::kFloat);
  // the step's inputs: the embedded tokens [B, 1, H], their RoPE rows [B, 1, D], cache rows and a one-node tree
  at::Tensor x = at::empty({B, 1, H}, f32), cos = at::empty({B, 1, D}, f32), sin = at::empty({B, 1, D}, f32);
  if (embed_kind < 0) {
    for (int64_t b = 0; b < B; ++b) std::copy_n(embed.data_ptr<float>() + tp[b] * H, H, x.data_ptr<float>() + b * H);
  } else {
    quantized_rows_into(embed, embed_rows, embed_kind % 100 / 10, embed_kind % 2 == 1, embed_kind >= 100, tp, B,
                        x.data_ptr<float>());
  }
  at::Tensor rows = at::empty({B, 1}, tokens.options());
  for (int64_t b = 0; b < B; ++b) {
    std::copy_n(cos_table.data_ptr<float>() + sp[b] * D, D, cos.data_ptr<float>() + b * D);
    std::copy_n(sin_table.data_ptr<float>() + sp[b] * D, D, sin.data_ptr<float>() + b * D);
    rows.data_ptr<int64_t>()[b] = sp[b];
  }
  const at::Tensor tree = at::ones({1, 1}, tokens.options().dtype(at::kBool));
  // the stack checks the cache, the rows, the lengths, kv_len and the biases before its first layer writes a row (each
  // projection's panels are the caller's: stack_weights takes them from the model's own layers)
  const at::Tensor h = std::get<0>(decode_stack_cpu(x, weights, kinds, biases, norms, eps, n_heads, n_kv_heads, intermediate,
                                                    cos, sin, kv, rows, seqlens, tree, kv_len, {}));
  at::Tensor hn = at::empty({B, H}, f32), logits = at::empty({B, vocab}, f32);
  rms_norm_rows_into(h.data_ptr<float>(), final_norm.data_ptr<float>(), static_cast<float>(final_eps), B, H,
                     hn.data_ptr<float>());
  step_linear(hn.data_ptr<float>(), B, head, head_kind, vocab, nullptr, logits.data_ptr<float>());
  at::Tensor next = at::empty({B}, tokens.options());
  for (int64_t b = 0; b < B; ++b) next.data_ptr<int64_t>()[b] = first_argmax(logits.data_ptr<float>() + b * vocab, vocab);
  if (commit) {
    int32_t* spw = seqlens.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b) ++spw[b];  // the step's row committed (KVCache.advance)
  }
  return {next, hn};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hydra_kernels, m) {
  m.def(
      "plain_greedy_step(Tensor tokens, Tensor embed, int embed_kind, int embed_rows, Tensor[] weights, int[] kinds, "
      "Tensor?[] biases, Tensor[] norms, float eps, int n_heads, int n_kv_heads, int intermediate, Tensor final_norm, "
      "float final_eps, Tensor head, int head_kind, int vocab, Tensor cos_table, Tensor sin_table, Tensor(a!) kv, "
      "Tensor(b!) seqlens, int kv_len, bool commit=True) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hydra_kernels, CPU, m) { m.impl("plain_greedy_step", &plain_greedy_step_cpu); }

}  // namespace hydra_kernels
