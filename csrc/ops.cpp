// hydra_kernels._C: op schemas, input checks and CPU kernels. CUDA kernels: cuda_bindings.cpp.
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "hydra_kernels.h"
#include "step_kernels.h"
#include "tree_buffer.h"

namespace hydra_kernels {

// Inputs are checked here with messages that name the argument and what to change.
void check_commit_kv(const at::Tensor& kv, const at::Tensor& seqlens, const at::Tensor& idx, const at::Tensor& lens) {
  TORCH_CHECK(kv.dim() == 6 && kv.size(1) == 2, "commit_kv: kv_cache must be [n_layers, 2, B, S_max, Hkv, D], got ",
              kv.sizes());
  TORCH_CHECK(kv.is_contiguous(), "commit_kv: kv_cache must be contiguous (it is the model's static buffer)");
  const int64_t B = kv.size(2);
  TORCH_CHECK(idx.dim() == 2 && idx.size(0) == B, "commit_kv: accept_indices must be [B=", B, ", K+1], got ",
              idx.sizes());
  TORCH_CHECK(idx.size(1) <= HK_MAX_ACCEPT, "commit_kv: at most ", HK_MAX_ACCEPT, " accepted rows, got ", idx.size(1));
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == B && seqlens.dim() == 1 && seqlens.size(0) == B,
              "commit_kv: accept_lengths and cache_seqlens must be [B=", B, "]");
  for (const at::Tensor* t : {&seqlens, &idx, &lens}) {
    TORCH_CHECK(t->scalar_type() == at::kInt || t->scalar_type() == at::kLong,
                "commit_kv: index tensors must be int32 or int64, got ", t->scalar_type());
    TORCH_CHECK(t->device() == kv.device(), "commit_kv: index tensors must be on ", kv.device(), ", got ",
                t->device());
  }
}

void check_greedy_verify(const at::Tensor& target, const at::Tensor& tokens, const at::Tensor& paths) {
  TORCH_CHECK(tokens.dim() == 2 && target.sizes() == tokens.sizes(),
              "greedy_verify: target_tokens and tree_tokens must both be [B, T], got ", target.sizes(), " and ",
              tokens.sizes());
  TORCH_CHECK((paths.dim() == 2 || (paths.dim() == 3 && paths.size(0) == tokens.size(0))) && paths.size(-1) >= 1 &&
                  paths.scalar_type() == at::kLong,
              "greedy_verify: paths must be int64 [P, D+1] (one tree) or [B, P, D+1] (a tree per sequence), got ",
              paths.scalar_type(), " ", paths.sizes());
  TORCH_CHECK(paths.size(-2) < 65536, "greedy_verify: at most 65535 leaf paths");
  TORCH_CHECK(target.device() == tokens.device() && paths.device() == tokens.device(),
              "greedy_verify: all inputs must be on one device");
}

void check_tree_inputs(const at::Tensor& root, const at::Tensor& cand, const at::Tensor& source,
                       const at::Tensor& depths, const at::Tensor& seqlens) {
  TORCH_CHECK(root.dim() == 1 && cand.dim() == 2 && cand.size(0) == root.size(0),
              "tree_inputs: root must be [B] and candidates [B, C], got ", root.sizes(), " and ", cand.sizes());
  const int64_t T = source.size(-1);
  TORCH_CHECK(source.dim() == 1 && ((depths.dim() == 1 && depths.size(0) == T) ||
                                    (depths.dim() == 2 && depths.size(0) == root.size(0) && depths.size(1) == T)),
              "tree_inputs: node_source must be [T] and depths [T] (one tree) or [B, T] (a tree per sequence), got ",
              source.sizes(), " and ", depths.sizes());
  TORCH_CHECK(seqlens.dim() == 1 && seqlens.size(0) == root.size(0), "tree_inputs: cache_seqlens must be [B]");
  for (const at::Tensor* t : {&cand, &source, &depths, &seqlens})
    TORCH_CHECK(t->device() == root.device(), "tree_inputs: all inputs must be on ", root.device());
}

namespace {

std::vector<int64_t> as_i64(const at::Tensor& t) {
  at::Tensor c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

}  // namespace

void commit_kv_cpu(at::Tensor kv, const at::Tensor& seqlens, const at::Tensor& idx, const at::Tensor& lens) {
  check_commit_kv(kv, seqlens, idx, lens);
  const int64_t planes = kv.size(0) * 2, B = kv.size(2), S = kv.size(3), k1 = idx.size(1);
  const int64_t row_bytes = kv.size(4) * kv.size(5) * kv.element_size();
  auto s = as_i64(seqlens), ix = as_i64(idx), n = as_i64(lens);
  char* base = static_cast<char*>(kv.data_ptr());
  std::vector<char> staged(static_cast<size_t>(k1 * row_bytes));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = n[b];
    TORCH_CHECK(len >= 0 && len <= k1, "commit_kv: accept_lengths[", b, "] = ", len, " is outside [0, ", k1, "]");
    for (int64_t i = 0; i < len; ++i) {
      const int64_t src = s[b] + ix[b * k1 + i];
      TORCH_CHECK(ix[b * k1 + i] >= 0 && src < S && s[b] + i < S, "commit_kv: row out of range for sequence ", b);
    }
    for (int64_t p = 0; p < planes; ++p) {
      char* plane = base + ((p * B + b) * S) * row_bytes;
      // gather every source row first: sources and destinations may overlap
      for (int64_t i = 0; i < len; ++i)
        std::memcpy(staged.data() + i * row_bytes, plane + (s[b] + ix[b * k1 + i]) * row_bytes, row_bytes);
      for (int64_t i = 0; i < len; ++i)
        std::memcpy(plane + (s[b] + i) * row_bytes, staged.data() + i * row_bytes, row_bytes);
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> greedy_verify_cpu(const at::Tensor& target,
                                                                                 const at::Tensor& tokens,
                                                                                 const at::Tensor& paths) {
  check_greedy_verify(target, tokens, paths);
  const int64_t B = tokens.size(0), T = tokens.size(1), P = paths.size(-2), D1 = paths.size(-1);
  auto tgt = as_i64(target), tok = as_i64(tokens);
  const TreeBuffer tree = tree_buffer(paths, 2, at::kLong);  // [P, D1] shared or [B, P, D1]
  auto opts = tokens.options().dtype(at::kLong);
  at::Tensor accept_len = at::empty({B}, opts), next_root = at::empty({B}, opts), last = at::empty({B}, opts);
  at::Tensor accept_idx = at::full({B, D1}, -1, opts);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* pth = tree.t.data_ptr<int64_t>() + b * tree.batch_stride;  // this sequence's leaf paths
    int64_t best = 0, best_len = -1;
    for (int64_t p = 0; p < P; ++p) {  // accepted prefix of leaf path p; the first longest wins
      const int64_t* path = &pth[p * D1];
      int64_t k = 1;
      while (k < D1 && path[k] >= 0 && tok[b * T + path[k]] == tgt[b * T + path[k - 1]]) ++k;
      if (k > best_len) best_len = k, best = p;
    }
    int64_t* out = accept_idx.data_ptr<int64_t>() + b * D1;
    for (int64_t i = 0; i < best_len; ++i) out[i] = pth[best * D1 + i];
    const int64_t ln = pth[best * D1 + best_len - 1];
    accept_len.data_ptr<int64_t>()[b] = best_len;
    last.data_ptr<int64_t>()[b] = ln;
    next_root.data_ptr<int64_t>()[b] = tgt[b * T + ln];
  }
  return {accept_len, accept_idx, next_root, last};
}

namespace {

std::tuple<at::Tensor, at::Tensor> tree_inputs_cpu(const at::Tensor& root, const at::Tensor& cand,
                                                   const at::Tensor& source, const at::Tensor& depths,
                                                   const at::Tensor& seqlens) {
  check_tree_inputs(root, cand, source, depths, seqlens);
  const int64_t B = root.size(0), T = source.size(0), C = cand.size(1);
  auto r = as_i64(root), c = as_i64(cand), src = as_i64(source), s = as_i64(seqlens);
  const TreeBuffer depth = tree_buffer(depths, 1, at::kLong);  // [T] shared or [B, T]
  const int64_t* d = depth.t.data_ptr<int64_t>();
  auto opts = root.options().dtype(at::kLong);
  at::Tensor tokens = at::empty({B, T}, opts), positions = at::empty({B, T}, opts);
  int64_t* tk = tokens.data_ptr<int64_t>();
  int64_t* ps = positions.data_ptr<int64_t>();
  for (int64_t t = 1; t < T; ++t)
    TORCH_CHECK(src[t] >= 0 && src[t] < C, "tree_inputs: node_source[", t, "] outside [0, ", C, ")");
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      tk[b * T + t] = t == 0 ? r[b] : c[b * C + src[t]];
      ps[b * T + t] = s[b] + d[b * depth.batch_stride + t];
    }
  return {tokens, positions};
}

int64_t abi_version() { return HK_ABI_VERSION; }

}  // namespace

TORCH_LIBRARY(hydra_kernels, m) {
  m.def("commit_kv(Tensor(a!) kv_cache, Tensor cache_seqlens, Tensor accept_indices, Tensor accept_lengths) -> ()");
  m.def("greedy_verify(Tensor target_tokens, Tensor tree_tokens, Tensor paths) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("tree_inputs(Tensor root, Tensor candidates, Tensor node_source, Tensor depths, Tensor cache_seqlens)"
        " -> (Tensor, Tensor)");
  m.def("abi_version() -> int", &abi_version);  // no tensor argument: a catch-all kernel
}

TORCH_LIBRARY_IMPL(hydra_kernels, CPU, m) {
  m.impl("commit_kv", &commit_kv_cpu);
  m.impl("greedy_verify", &greedy_verify_cpu);
  m.impl("tree_inputs", &tree_inputs_cpu);
}

}  // namespace hydra_kernels

// The Python module: importing it runs the registrations above (no Python functions of its own).
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "hydra_kernels native ops (torch.ops.hydra_kernels)",
                                   -1, nullptr};
  return PyModule_Create(&def);
}
