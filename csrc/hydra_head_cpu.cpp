// One depth of Hydra's greedy drafting on the CPU in one op call: each node's first-block input cat(h, E(path)) built
// from the token embedding, the ResBlock (res(x) + SiLU(W x + b)), the LM-head rows of the draft vocabulary and each
// node's top-k guesses mapped to token ids.
//
// Why: a drafted step of the default drafter runs one such depth per head. With the draft vocabulary's rows at 4096
// (2.5 MB of Q8_0 rows, ~0.07 ms) and the first block's two bf16 linears (~0.05 ms), the module path around them (the
// embedding lookup, the concatenation, SiLU, the add, the argmax, the id map: ~10 ATen calls and the modules' Python)
// took about as long again: ~0.25 ms a depth where the kernels take ~0.13 (2026-11-29, EPYC VM, SmolLM2 heads).
//
// Exactness: every part is the function the module path runs (the embedding's quantized_rows lookup or row copy; the
// linears' own kernels through step_linear; ATen's silu; an fp32 add; torch.argmax's first maximum for k = 1, ATen's
// topk otherwise; ATen's softmax for the probabilities), so the guesses and their probabilities equal HydraDrafter's
// module path bit for bit (tests/test_hydra_head_native.py).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

#include "step_kernels.h"

namespace hydra_kernels {
namespace {

void check_bias(const std::optional<at::Tensor>& b, int64_t H, const char* name) {
  if (b.has_value())
    TORCH_CHECK(b->dim() == 1 && b->size(0) == H && b->scalar_type() == at::kFloat && b->is_contiguous(),
                "hydra_head_topk: ", name, " must be contiguous fp32 [H = ", H, "], got ", b->scalar_type(), " ",
                b->sizes());
}

const float* bias_ptr(const std::optional<at::Tensor>& b) { return b.has_value() ? b->data_ptr<float>() : nullptr; }

// h fp32 [B, H]: the drafter's hidden state per sequence; paths int64 [B, n, L]: each of the depth's n parent nodes as
// its path of L = depth + 1 tokens (root first); embed as a native step's (fp32 [V, H] with embed_kind -1, or quantized
// panels of embed_rows rows); w_lin / w_res: the first block's linear and residual projection [H, (L + 1) H] as stack
// weights of their kinds (0: packed panels), biases fp32 [H] or none; lm: the LM-head rows of the draft vocabulary
// [vocab, H] (lm_kind as a stack weight's), no bias; vocab_ids int64 [vocab]: draft index -> token id (none: the
// identity). -> (the k best guesses' token ids int64 [B, n, k], best first; their probabilities fp32 [B, n, k], the
// softmax over the draft rows: the adaptive budget's confidence signal).
std::tuple<at::Tensor, at::Tensor> hydra_head_topk_cpu(const at::Tensor& h, const at::Tensor& paths, const at::Tensor& embed, int64_t embed_kind,
                               int64_t embed_rows, const at::Tensor& w_lin, int64_t lin_kind,
                               const std::optional<at::Tensor>& b_lin, const at::Tensor& w_res, int64_t res_kind,
                               const std::optional<at::Tensor>& b_res, const at::Tensor& lm, int64_t lm_kind,
                               int64_t vocab, const std::optional<at::Tensor>& vocab_ids, int64_t k) {
  constexpr const char* op = "hydra_head_topk";
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(), op,
              ": h must be contiguous fp32 [B, H], got ", h.scalar_type(), " ", h.sizes());
  const int64_t B = h.size(0), H = h.size(1);
  TORCH_CHECK(paths.dim() == 3 && paths.size(0) == B && paths.scalar_type() == at::kLong && paths.is_contiguous(), op,
              ": paths must be contiguous int64 [B = ", B, ", n, L], got ", paths.scalar_type(), " ", paths.sizes());
  const int64_t n = paths.size(1), L = paths.size(2), M = B * n, K = (L + 1) * H;
  TORCH_CHECK(L >= 1 && H > 0, op, ": a path holds at least the root, got L = ", L);
  TORCH_CHECK(vocab > 0 && 1 <= k && k <= vocab, op, ": k must be in [1, vocab = ", vocab, "], got ", k);
  const int64_t rows = check_embedding(op, embed, embed_kind, embed_rows, H);
  check_step_weight(op, "w_lin", w_lin, lin_kind, H, K);
  check_step_weight(op, "w_res", w_res, res_kind, H, K);
  check_step_weight(op, "lm", lm, lm_kind, vocab, H);
  check_bias(b_lin, H, "b_lin");
  check_bias(b_res, H, "b_res");
  if (vocab_ids.has_value())
    TORCH_CHECK(vocab_ids->dim() == 1 && vocab_ids->size(0) == vocab && vocab_ids->scalar_type() == at::kLong &&
                    vocab_ids->is_contiguous(),
                op, ": vocab_ids must be contiguous int64 [vocab = ", vocab, "], got ", vocab_ids->sizes());
  const int64_t* pp = paths.data_ptr<int64_t>();
  for (int64_t i = 0; i < M * L; ++i)
    TORCH_CHECK(0 <= pp[i] && pp[i] < rows, op, ": token ", pp[i], " outside the embedding's [0, ", rows, ")");
  at::Tensor out = at::empty({B, n, k}, paths.options());
  if (M == 0) return {out, at::empty({B, n, k}, h.options())};

  const auto f32 = h.options();
  // x [M, (L + 1) H]: row (b, i) = h[b], then the embeddings of its path's L tokens (contiguous, as torch.cat lays them)
  at::Tensor x = at::empty({M, K}, f32);
  float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r) {
    std::copy_n(h.data_ptr<float>() + (r / n) * H, H, xp + r * K);
    embed_rows_into(embed, embed_kind, rows, pp + r * L, L, H, xp + r * K + H);
  }
  at::Tensor lin = at::empty({M, H}, f32), y = at::empty({M, H}, f32), logits = at::empty({M, vocab}, f32);
  step_linear(xp, M, w_lin, lin_kind, H, bias_ptr(b_lin), lin.data_ptr<float>());
  step_linear(xp, M, w_res, res_kind, H, bias_ptr(b_res), y.data_ptr<float>());
  at::silu_(lin);  // ATen's SiLU: the module path's F.silu values
  y.add_(lin);     // res + SiLU(lin), one fp32 add per value
  step_linear(y.data_ptr<float>(), M, lm, lm_kind, vocab, nullptr, logits.data_ptr<float>());
  int64_t* op_ = out.data_ptr<int64_t>();
  if (k == 1) {
    for (int64_t r = 0; r < M; ++r) op_[r] = first_argmax(logits.data_ptr<float>() + r * vocab, vocab);
  } else {
    out.view({M, k}).copy_(std::get<1>(at::topk(logits, k, -1)));
  }
  // the guesses' probabilities: ATen's softmax over the draft rows, gathered (HeadDrafter.head_guesses' values)
  at::Tensor probs = at::softmax(logits, -1).gather(1, out.view({M, k})).view({B, n, k});
  if (vocab_ids.has_value()) {
    const int64_t* ids = vocab_ids->data_ptr<int64_t>();
    for (int64_t i = 0; i < M * k; ++i) op_[i] = ids[op_[i]];
  }
  return {out, probs};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hydra_kernels, m) {
  m.def(
      "hydra_head_topk(Tensor h, Tensor paths, Tensor embed, int embed_kind, int embed_rows, Tensor w_lin, int lin_kind, "
      "Tensor? b_lin, Tensor w_res, int res_kind, Tensor? b_res, Tensor lm, int lm_kind, int vocab, Tensor? vocab_ids, "
      "int k) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hydra_kernels, CPU, m) { m.impl("hydra_head_topk", &hydra_head_topk_cpu); }

}  // namespace hydra_kernels
