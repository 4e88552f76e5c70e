// CUDA implementations of the hydra_kernels ops: the same checks as the CPU kernels, then the
// launchers of cuda_kernels.cu on the current stream (no host synchronisation).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "hydra_kernels.h"
#include "tree_buffer.h"

namespace hydra_kernels {

void check_commit_kv(const at::Tensor& kv, const at::Tensor& seqlens, const at::Tensor& idx, const at::Tensor& lens);
void check_greedy_verify(const at::Tensor& target, const at::Tensor& tokens, const at::Tensor& paths);
void check_tree_inputs(const at::Tensor& root, const at::Tensor& cand, const at::Tensor& source,
                       const at::Tensor& depths, const at::Tensor& seqlens);

namespace {

at::Tensor i64(const at::Tensor& t) { return t.to(at::kLong).contiguous(); }
void* stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

void commit_kv_cuda(at::Tensor kv, const at::Tensor& seqlens, const at::Tensor& idx, const at::Tensor& lens) {
  check_commit_kv(kv, seqlens, idx, lens);
  const int64_t row_bytes = kv.size(4) * kv.size(5) * kv.element_size();
  TORCH_CHECK(row_bytes % 4 == 0, "commit_kv: a row (Hkv * D elements) must be a multiple of 4 bytes");
  const c10::cuda::CUDAGuard guard(kv.device());
  at::Tensor s = i64(seqlens), ix = i64(idx), n = i64(lens);
  hk_commit_kv_cuda(static_cast<uint32_t*>(kv.data_ptr()), kv.size(0) * 2, kv.size(2), kv.size(3), row_bytes / 4,
                    s.data_ptr<int64_t>(), ix.data_ptr<int64_t>(), ix.size(1), n.data_ptr<int64_t>(), stream());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> greedy_verify_cuda(const at::Tensor& target,
                                                                                  const at::Tensor& tokens,
                                                                                  const at::Tensor& paths) {
  check_greedy_verify(target, tokens, paths);
  const c10::cuda::CUDAGuard guard(tokens.device());
  at::Tensor tg = i64(target), tk = i64(tokens);
  const TreeBuffer tree = tree_buffer(paths, 2, at::kLong);  // [P, D1] shared or [B, P, D1]
  const int64_t B = tk.size(0), P = paths.size(-2), D1 = paths.size(-1);
  auto opts = tk.options();
  at::Tensor len = at::empty({B}, opts), acc = at::empty({B, D1}, opts), root = at::empty({B}, opts),
             last = at::empty({B}, opts);
  hk_greedy_verify_cuda(tg.data_ptr<int64_t>(), tk.data_ptr<int64_t>(), B, tk.size(1), tree.t.data_ptr<int64_t>(),
                        tree.batch_stride, P, D1, len.data_ptr<int64_t>(), acc.data_ptr<int64_t>(),
                        root.data_ptr<int64_t>(), last.data_ptr<int64_t>(), stream());
  return {len, acc, root, last};
}

std::tuple<at::Tensor, at::Tensor> tree_inputs_cuda(const at::Tensor& root, const at::Tensor& cand,
                                                    const at::Tensor& source, const at::Tensor& depths,
                                                    const at::Tensor& seqlens) {
  check_tree_inputs(root, cand, source, depths, seqlens);
  const c10::cuda::CUDAGuard guard(root.device());
  at::Tensor r = i64(root), c = i64(cand), src = i64(source), s = i64(seqlens);
  const TreeBuffer depth = tree_buffer(depths, 1, at::kLong);  // [T] shared or [B, T]
  const int64_t B = r.size(0), T = src.size(0);
  at::Tensor tokens = at::empty({B, T}, r.options()), positions = at::empty({B, T}, r.options());
  hk_tree_inputs_cuda(r.data_ptr<int64_t>(), c.data_ptr<int64_t>(), c.size(1), src.data_ptr<int64_t>(),
                      depth.t.data_ptr<int64_t>(), depth.batch_stride, s.data_ptr<int64_t>(), B, T,
                      tokens.data_ptr<int64_t>(), positions.data_ptr<int64_t>(), stream());
  return {tokens, positions};
}

}  // namespace

TORCH_LIBRARY_IMPL(hydra_kernels, CUDA, m) {
  m.impl("commit_kv", &commit_kv_cuda);
  m.impl("greedy_verify", &greedy_verify_cuda);
  m.impl("tree_inputs", &tree_inputs_cuda);
}

}  // namespace hydra_kernels
