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
#include <string>
#include <vector>

#include "step_kernels.h"

namespace hydra_kernels {

int64_t first_argmax(const float* v, int64_t n) {
  int64_t best = 0;
  float bv = v[0];
  for (int64_t i = 1; i < n && !std::isnan(bv); ++i)
    if (std::isnan(v[i]) || v[i] > bv) best = i, bv = v[i];
  return best;
}

int64_t check_embedding(const char* op, const at::Tensor& embed, int64_t embed_kind, int64_t embed_rows, int64_t H) {
  if (embed_kind < 0) {
    TORCH_CHECK(embed.dim() == 2 && embed.size(1) == H && embed.scalar_type() == at::kFloat && embed.is_contiguous(),
                op, ": an fp32 embedding must be contiguous [V, H = ", H, "], got ", embed.sizes());
    return embed.size(0);
  }
  check_quantized_panels(embed, embed_rows, H, embed_kind % 100 / 10, embed_kind % 2 == 1, embed_kind >= 100);
  return embed_rows;
}

void embed_rows_into(const at::Tensor& embed, int64_t embed_kind, int64_t embed_rows, const int64_t* ids, int64_t n,
                     int64_t H, float* out) {
  if (embed_kind < 0) {
    for (int64_t r = 0; r < n; ++r) std::copy_n(embed.data_ptr<float>() + ids[r] * H, H, out + r * H);
  } else {
    quantized_rows_into(embed, embed_rows, embed_kind % 100 / 10, embed_kind % 2 == 1, embed_kind >= 100, ids, n, out);
  }
}

// The greedy forward both native steps share (step_kernels.h): tokens int64 [B, T] at RoPE positions [B, T] (host
// values), node i of sequence b written at cache row seqlens[b] + i and attending per tree_mask -> (each node's argmax
// token int64 [B, T], the final-normed hidden states [B, T, H]). Everything is checked before the stack writes a row.
std::tuple<at::Tensor, at::Tensor> greedy_forward_cpu(const char* op, const at::Tensor& tokens, const int64_t* positions,
                                                      const at::Tensor& tree_mask, const GreedyModel& m,
                                                      const at::Tensor& kv, const at::Tensor& seqlens, int64_t kv_len,
                                                      const std::optional<at::Tensor>& attend) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong && tokens.is_contiguous(), op,
              ": tokens must be contiguous int64, got ", tokens.scalar_type(), " ", tokens.sizes());
  const int64_t B = tokens.size(0), T = tokens.size(1), N = B * T;
  TORCH_CHECK(B > 0 && T > 0 && seqlens.dim() == 1 && seqlens.size(0) == B && seqlens.scalar_type() == at::kInt &&
                  seqlens.is_contiguous(),
              op, ": seqlens must be contiguous int32 [B = ", B, "], got ", seqlens.scalar_type(), " ", seqlens.sizes());
  TORCH_CHECK(m.final_norm.dim() == 1 && m.final_norm.scalar_type() == at::kFloat && m.final_norm.is_contiguous(), op,
              ": final_norm must be contiguous fp32 [H]");
  const int64_t H = m.final_norm.size(0);
  TORCH_CHECK(kv.dim() == 6, op, ": kv must be [L, 2, B, S, Hkv, D], got ", kv.sizes());
  const int64_t D = kv.size(5);
  TORCH_CHECK(m.cos_table.dim() == 2 && m.cos_table.sizes() == m.sin_table.sizes() && m.cos_table.size(1) == D &&
                  m.cos_table.scalar_type() == at::kFloat && m.sin_table.scalar_type() == at::kFloat &&
                  m.cos_table.is_contiguous() && m.sin_table.is_contiguous(),
              op, ": cos/sin tables must be contiguous fp32 [n, D = ", D, "], got ", m.cos_table.sizes());
  TORCH_CHECK(m.vocab > 0, op, ": vocab must be positive");
  // the embedding's and the LM head's layouts against H and vocab, before the stack writes a cache row
  const int64_t embed_rows = check_embedding(op, m.embed, m.embed_kind, m.embed_rows, H);
  check_step_weight(op, "the LM head", m.head, m.head_kind, m.vocab, H);
  const int64_t* tp = tokens.data_ptr<int64_t>();
  const int32_t* sp = seqlens.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < T; ++i) {
      const int64_t t = tp[b * T + i], pos = positions[b * T + i];
      TORCH_CHECK(0 <= t && t < embed_rows, op, ": token ", t, " of sequence ", b,
                  T > 1 ? " (node " + std::to_string(i) + ")" : std::string(), " outside the embedding's [0, ",
                  embed_rows, ")");
      TORCH_CHECK(0 <= pos && pos < m.cos_table.size(0), op, ": position ", pos, " of sequence ", b,
                  " outside the RoPE table's [0, ", m.cos_table.size(0), ")");
    }
  const auto f32 = tokens.options().dtype(at::kFloat);
  // the step's inputs: the embedded tokens [B, T, H], their RoPE rows [B, T, D], the cache rows [B, T]
  at::Tensor x = at::empty({B, T, H}, f32), cos = at::empty({B, T, D}, f32), sin = at::empty({B, T, D}, f32);
  embed_rows_into(m.embed, m.embed_kind, embed_rows, tp, N, H, x.data_ptr<float>());
  at::Tensor rows = at::empty({B, T}, tokens.options());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < T; ++i) {
      const int64_t r = b * T + i;
      std::copy_n(m.cos_table.data_ptr<float>() + positions[r] * D, D, cos.data_ptr<float>() + r * D);
      std::copy_n(m.sin_table.data_ptr<float>() + positions[r] * D, D, sin.data_ptr<float>() + r * D);
      rows.data_ptr<int64_t>()[r] = sp[b] + i;
    }
  // the stack checks the cache, the rows, the lengths, kv_len, the mask and the biases before its first layer writes
  // a row (each projection's panels are the caller's: stack_weights takes them from the model's own layers)
  const at::Tensor h = std::get<0>(decode_stack_cpu(x, m.weights, m.kinds, m.biases, m.norms, m.eps, m.n_heads,
                                                    m.n_kv_heads, m.intermediate, cos, sin, kv, rows, seqlens, tree_mask,
                                                    kv_len, {}, attend));
  at::Tensor hn = at::empty({B, T, H}, f32), logits = at::empty({N, m.vocab}, f32);
  rms_norm_rows_into(h.data_ptr<float>(), m.final_norm.data_ptr<float>(), static_cast<float>(m.final_eps), N, H,
                     hn.data_ptr<float>());
  step_linear(hn.data_ptr<float>(), N, m.head, m.head_kind, m.vocab, nullptr, logits.data_ptr<float>());
  at::Tensor next = at::empty({B, T}, tokens.options());
  for (int64_t r = 0; r < N; ++r)
    next.data_ptr<int64_t>()[r] = first_argmax(logits.data_ptr<float>() + r * m.vocab, m.vocab);
  return {next, hn};
}

namespace {

// tokens int64 [B]: each sequence's last token, written at cache row seqlens[b] (its position) -> (the next tokens int64
// [B], the final-normed hidden states fp32 [B, H] that picked them: a drafter's features); with commit, seqlens int32 [B]
// advanced by one (KVCache.advance; without it the caller commits: a speculative run's plain step, which commits only its
// active sequences after its drafter has seen the step). embed: the token table, fp32 [V, H] (embed_kind -1) or quantized panels of
// embed_rows rows (embed_kind: the quantized kind, 100 * fp16 scales + 10 * bits + offset). The stack's arguments as
// decode_stack's; final_norm fp32 [H] with final_eps; head: the LM head's panels of `vocab` rows (head_kind as a stack
// weight's kind: 0 packed fp32 / bf16, else quantized), no bias; cos_table / sin_table fp32 [n, D], rows >= every
// position; attention over cache rows [0, kv_len). attend: int64 [B] or none (decode_stack's: a sequence with attend 0,
// one whose next token nobody reads, skips its attention and gets an unspecified token and hidden state; the others'
// are the same bit for bit).
std::tuple<at::Tensor, at::Tensor> plain_greedy_step_cpu(const at::Tensor& tokens, const at::Tensor& embed, int64_t embed_kind, int64_t embed_rows,
                                 at::TensorList weights, at::IntArrayRef kinds,
                                 const c10::List<std::optional<at::Tensor>>& biases, at::TensorList norms, double eps,
                                 int64_t n_heads, int64_t n_kv_heads, int64_t intermediate, const at::Tensor& final_norm,
                                 double final_eps, const at::Tensor& head, int64_t head_kind, int64_t vocab,
                                 const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& kv,
                                 at::Tensor seqlens, int64_t kv_len, bool commit,
                                 const std::optional<at::Tensor>& attend) {
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong && tokens.is_contiguous(),
              "plain_greedy_step: tokens must be contiguous int64 [B], got ", tokens.scalar_type(), " ", tokens.sizes());
  const int64_t B = tokens.size(0);
  TORCH_CHECK(seqlens.dim() == 1 && seqlens.size(0) == B && seqlens.scalar_type() == at::kInt && seqlens.is_contiguous(),
              "plain_greedy_step: seqlens must be contiguous int32 [B = ", B, "], got ", seqlens.scalar_type(), " ",
              seqlens.sizes());
  std::vector<int64_t> positions(seqlens.data_ptr<int32_t>(), seqlens.data_ptr<int32_t>() + B);  // a plain row's position
  const GreedyModel m{embed, embed_kind, embed_rows, weights, kinds, biases, norms, eps, n_heads, n_kv_heads,
                      intermediate, final_norm, final_eps, head, head_kind, vocab, cos_table, sin_table};
  const at::Tensor one_node = at::ones({1, 1}, tokens.options().dtype(at::kBool));
  auto [next, hn] = greedy_forward_cpu("plain_greedy_step", tokens.view({B, 1}), positions.data(), one_node, m, kv,
                                       seqlens, kv_len, attend);
  if (commit) {
    int32_t* spw = seqlens.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b) ++spw[b];  // the step's row committed (KVCache.advance)
  }
  return {next.view({B}), hn.view({B, hn.size(2)})};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hydra_kernels, m) {
  m.def(
      "plain_greedy_step(Tensor tokens, Tensor embed, int embed_kind, int embed_rows, Tensor[] weights, int[] kinds, "
      "Tensor?[] biases, Tensor[] norms, float eps, int n_heads, int n_kv_heads, int intermediate, Tensor final_norm, "
      "float final_eps, Tensor head, int head_kind, int vocab, Tensor cos_table, Tensor sin_table, Tensor(a!) kv, "
      "Tensor(b!) seqlens, int kv_len, bool commit=True, Tensor? attend=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hydra_kernels, CPU, m) { m.impl("plain_greedy_step", &plain_greedy_step_cpu); }

}  // namespace hydra_kernels
