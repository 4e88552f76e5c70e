// C signatures of the CUDA launchers. Raw pointers and sizes only, so cuda_kernels.cu compiles with
// nvcc alone (no torch headers): fast to build, and checkable on a machine without a GPU.
#pragma once
#include <cstdint>

#ifdef __cplusplus
extern "C" {
#endif

// kv: [n_planes = n_layers * 2][B][S][row_words] viewed as 32-bit words (a row = Hkv * D elements).
// For each plane and sequence b: row seqlens[b] + idx[b, i] -> row seqlens[b] + i, i < lens[b].
// k1 = idx.size(1) <= HK_MAX_ACCEPT. Index tensors are int64 (the bindings convert).
void hk_commit_kv_cuda(uint32_t* kv, int64_t n_planes, int64_t B, int64_t S, int64_t row_words,
                       const int64_t* seqlens, const int64_t* idx, int64_t k1, const int64_t* lens, void* stream);

// Tree buffers of a batch: sequence b's at ptr + b * batch_stride (0: one tree shared by the batch).

// One block per sequence. target, tokens: [B][T]; sequence b's leaf paths: [P][D1] (-1 padded) at
// paths + b * paths_bstride. Outputs: accept_len [B], accept_idx [B][D1] (-1 after the length),
// next_root [B], last_node [B].
void hk_greedy_verify_cuda(const int64_t* target, const int64_t* tokens, int64_t B, int64_t T,
                           const int64_t* paths, int64_t paths_bstride, int64_t P, int64_t D1, int64_t* accept_len,
                           int64_t* accept_idx, int64_t* next_root, int64_t* last_node, void* stream);

// tokens[b, 0] = root[b]; tokens[b, t] = candidates[b, source[t]] (t >= 1);
// positions[b, t] = seqlens[b] + depths[b * depths_bstride + t].
void hk_tree_inputs_cuda(const int64_t* root, const int64_t* candidates, int64_t C, const int64_t* source,
                         const int64_t* depths, int64_t depths_bstride, const int64_t* seqlens, int64_t B, int64_t T,
                         int64_t* tokens, int64_t* positions, void* stream);

#ifdef __cplusplus
}
#endif

#define HK_MAX_ACCEPT 32

// The extension's interface version (torch.ops.hydra_kernels.abi_version()): raised whenever an op's schema or
// meaning changes, with hydra_kernels/ops/backend.py NATIVE_ABI. A build from older sources then reports a number the
// Python side does not expect, and is not used (a warning says to rebuild) instead of failing inside generate().
#define HK_ABI_VERSION 2
