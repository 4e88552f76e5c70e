// A whole greedy speculative verify step on the CPU in one op call: a tree of T drafted nodes per sequence through the
// embedding, RoPE, the layer stack, the final norm and the LM head (plain_step_cpu.cpp's greedy forward), each node's
// argmax, greedy acceptance along the tree's leaf paths (the greedy_verify op's kernel) and the commit of the accepted
// rows (commit_kv's kernel, seqlens advanced).
//
// Why: the module path's verify step (Llama.step, Llama.greedy_tokens, ops.greedy_verify, commit_step) spends
// ~0.5-0.7 ms of Python and ATen calls beyond the kernels at SmolLM2-135M (2026-11-28, EPYC VM,
// benchmarks/bench_verify_step.py: batch 1, 2 nodes, 7.05 ms against 6.49 here, a plain step 5.40), paid by every
// drafted step on top of its rows.
//
// Exactness: the same functions the module path runs (the greedy forward is the plain step's, row for row; then the
// greedy_verify and commit_kv kernels), so the tokens, the acceptance, the KV cache and seqlens equal
// speculative.greedy_verify_step's bit for bit (tests/test_tree_step.py).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "hydra_kernels.h"
#include "step_kernels.h"
#include "tree_buffer.h"

namespace hydra_kernels {
namespace {

// tokens int64 [B, T] (node 0 each sequence's root), tree_mask bool [T, T] or [B, T, T] (ancestor-or-self), depths
// [T] or [B, T] (node i's position seqlens[b] + depth; or positions int64 [B, T] given), paths int64 [P, D + 1] or
// [B, P, D + 1] (the leaf paths, -1 padded), active int64 [B] (0: a finished sequence commits nothing); the model's
// arguments as plain_greedy_step's -> (the final-normed hidden states [B, T, H], the argmax after every node [B, T],
// accept_lengths [B], accept_indices [B, D + 1], next_root [B], last_node [B], the committed lengths n [B]), the
// accepted rows moved after each prefix and seqlens advanced by n. attend: int64 [B] or none (decode_stack's: a
// sequence with attend 0 skips its attention, its outputs unspecified; give it active 0 too, or it commits them).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> tree_greedy_step_cpu(
    const at::Tensor& tokens, const at::Tensor& tree_mask, const at::Tensor& depths,
    const std::optional<at::Tensor>& positions, const at::Tensor& paths, const at::Tensor& active,
    const at::Tensor& embed, int64_t embed_kind, int64_t embed_rows, at::TensorList weights, at::IntArrayRef kinds,
    const c10::List<std::optional<at::Tensor>>& biases, at::TensorList norms, double eps, int64_t n_heads,
    int64_t n_kv_heads, int64_t intermediate, const at::Tensor& final_norm, double final_eps, const at::Tensor& head,
    int64_t head_kind, int64_t vocab, const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& kv,
    at::Tensor seqlens, int64_t kv_len, const std::optional<at::Tensor>& attend) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong && tokens.is_contiguous(),
              "tree_greedy_step: tokens must be contiguous int64 [B, T], got ", tokens.scalar_type(), " ", tokens.sizes());
  const int64_t B = tokens.size(0), T = tokens.size(1);
  TORCH_CHECK(seqlens.dim() == 1 && seqlens.size(0) == B && seqlens.scalar_type() == at::kInt && seqlens.is_contiguous(),
              "tree_greedy_step: seqlens must be contiguous int32 [B = ", B, "], got ", seqlens.scalar_type(), " ",
              seqlens.sizes());
  TORCH_CHECK(active.dim() == 1 && active.size(0) == B && active.scalar_type() == at::kLong,
              "tree_greedy_step: active must be int64 [B = ", B, "], got ", active.scalar_type(), " ", active.sizes());
  check_greedy_verify(tokens, tokens, paths);  // the paths' shape, before anything is written
  TORCH_CHECK(paths.size(-1) <= HK_MAX_ACCEPT, "tree_greedy_step: at most ", HK_MAX_ACCEPT,
              " accepted rows (paths of depth + 1), got ", paths.size(-1));
  {  // every path entry a node of the tree or -1 (the kernels index tokens with them)
    const at::Tensor pc = paths.contiguous();
    const int64_t* pp = pc.data_ptr<int64_t>();
    for (int64_t i = 0; i < pc.numel(); ++i)
      TORCH_CHECK(pp[i] >= -1 && pp[i] < T, "tree_greedy_step: a leaf path names node ", pp[i], ", outside [-1, ", T,
                  ")");
  }
  const int32_t* sp = seqlens.data_ptr<int32_t>();
  std::vector<int64_t> pos(B * T);  // each node's RoPE position
  if (positions.has_value()) {
    const at::Tensor p = positions->to(at::kLong).contiguous();
    TORCH_CHECK(p.dim() == 2 && p.size(0) == B && p.size(1) == T, "tree_greedy_step: positions must be [B, T] = [", B,
                ", ", T, "], got ", p.sizes());
    std::copy_n(p.data_ptr<int64_t>(), B * T, pos.data());
  } else {
    TORCH_CHECK((depths.dim() == 1 && depths.size(0) == T) || (depths.dim() == 2 && depths.size(0) == B &&
                                                                 depths.size(1) == T),
                "tree_greedy_step: depths must be [T] = [", T, "] or [B, T] = [", B, ", ", T, "], got ", depths.sizes());
    const TreeBuffer d = tree_buffer(depths, 1, at::kLong);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < T; ++i) pos[b * T + i] = sp[b] + d.t.data_ptr<int64_t>()[b * d.batch_stride + i];
  }
  const GreedyModel m{embed, embed_kind, embed_rows, weights, kinds, biases, norms, eps, n_heads, n_kv_heads,
                      intermediate, final_norm, final_eps, head, head_kind, vocab, cos_table, sin_table};
  auto [target, hidden] = greedy_forward_cpu("tree_greedy_step", tokens, pos.data(), tree_mask, m, kv, seqlens, kv_len,
                                             attend);
  auto [len, idx, next_root, last] = greedy_verify_cpu(target, tokens, paths);
  const at::Tensor n = len * active;  // a finished sequence commits nothing (commit_step)
  commit_kv_cpu(kv, seqlens, idx, n);
  int32_t* spw = seqlens.data_ptr<int32_t>();
  const int64_t* np = n.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) spw[b] += static_cast<int32_t>(np[b]);  // KVCache.advance
  return {hidden, target, len, idx, next_root, last, n};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hydra_kernels, m) {
  m.def(
      "tree_greedy_step(Tensor tokens, Tensor tree_mask, Tensor depths, Tensor? positions, Tensor paths, Tensor active, "
      "Tensor embed, int embed_kind, int embed_rows, Tensor[] weights, int[] kinds, Tensor?[] biases, Tensor[] norms, "
      "float eps, int n_heads, int n_kv_heads, int intermediate, Tensor final_norm, float final_eps, Tensor head, "
      "int head_kind, int vocab, Tensor cos_table, Tensor sin_table, Tensor(a!) kv, Tensor(b!) seqlens, int kv_len, "
      "Tensor? attend=None) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hydra_kernels, CPU, m) { m.impl("tree_greedy_step", &tree_greedy_step_cpu); }

}  // namespace hydra_kernels
