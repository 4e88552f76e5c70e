// A tree buffer (ancestor mask, depths, leaf paths) as the ops take it: one tree shared by the batch
// ([...], or a [B, ...] view expanded with batch stride 0) or a tree per sequence ([B, ...], padded to a
// common T). Kernels index sequence b's tree at data + b * batch_stride, so both forms run one kernel
// and the shared tree is read in place: no per-step expansion or copy.
#pragma once
#include <ATen/core/Tensor.h>

namespace hydra_kernels {

struct TreeBuffer {
  at::Tensor t;          // `dtype`, inner dims contiguous: [...] (shared) or [B, ...]
  int64_t batch_stride;  // elements between two sequences' trees; 0: one tree for the batch
};

// x: inner_dims dims (shared) or inner_dims + 1 (per sequence). No copy when x already is `dtype` with
// contiguous inner dims (the shared static tree, every step).
inline TreeBuffer tree_buffer(const at::Tensor& x, int64_t inner_dims, at::ScalarType dtype) {
  at::Tensor t = x.dim() > inner_dims && x.stride(0) == 0 ? x.select(0, 0) : x;
  t = t.to(dtype).contiguous();
  return {t, t.dim() > inner_dims ? t.stride(0) : 0};
}

}  // namespace hydra_kernels
