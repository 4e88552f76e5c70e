// CUDA kernels of hydra_kernels._C. No torch headers: launched by cuda_bindings.cpp through the C
// signatures in hydra_kernels.h.
#include <cuda_runtime.h>

#include "hydra_kernels.h"

namespace {

// commit_kv: one launch for every layer, K and V, and sequence. Thread x owns one 32-bit column of a
// row in one (plane, sequence): it loads that column of every source row into registers before it
// writes any destination row, so overlapping sources and destinations are safe for any indices and no
// synchronisation is needed (other threads touch other columns). Grid: (column blocks, B, planes).
__global__ void commit_kv_kernel(uint32_t* __restrict__ kv, int64_t B, int64_t S, int64_t row_words,
                                 const int64_t* __restrict__ seqlens, const int64_t* __restrict__ idx, int64_t k1,
                                 const int64_t* __restrict__ lens) {
  const int64_t col = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  const int64_t b = blockIdx.y, plane = blockIdx.z;
  if (col >= row_words) return;
  // n is bounded on the device too: lens[b] is data (the host checked only k1 <= HK_MAX_ACCEPT), and
  // reading idx or vals past k1 would touch other rows' memory.
  const int64_t n = min(lens[b], min(k1, (int64_t)HK_MAX_ACCEPT));
  if (n <= 0) return;
  uint32_t* rows = kv + (plane * B + b) * S * row_words + seqlens[b] * row_words + col;
  // Fully unrolled loops with constant indices keep vals in registers (a runtime trip count would put
  // the array in local memory).
  uint32_t vals[HK_MAX_ACCEPT];
#pragma unroll
  for (int i = 0; i < HK_MAX_ACCEPT; ++i)
    if (i < n) vals[i] = rows[idx[b * k1 + i] * row_words];
#pragma unroll
  for (int i = 0; i < HK_MAX_ACCEPT; ++i)
    if (i < n) rows[i * row_words] = vals[i];
}

// greedy_verify: one block per sequence. Thread p walks leaf path p while each token equals the
// target after its parent; the block keeps the longest (lowest p on ties) with one atomicMax on
// key = length * 65536 + (65535 - p), then thread 0 writes the outputs. Sequence b's leaf paths start at
// paths + b * paths_bstride (0: one tree for the batch).
__global__ void greedy_verify_kernel(const int64_t* __restrict__ target, const int64_t* __restrict__ tokens,
                                     int64_t T, const int64_t* __restrict__ all_paths, int64_t paths_bstride,
                                     int64_t P, int64_t D1, int64_t* accept_len, int64_t* accept_idx,
                                     int64_t* next_root, int64_t* last_node) {
  __shared__ unsigned long long best_key;
  const int64_t b = blockIdx.x;
  const int64_t* tgt = target + b * T;
  const int64_t* tok = tokens + b * T;
  const int64_t* paths = all_paths + b * paths_bstride;
  if (threadIdx.x == 0) best_key = 0;
  __syncthreads();
  for (int64_t p = threadIdx.x; p < P; p += blockDim.x) {
    const int64_t* path = paths + p * D1;
    int64_t k = 1;
    while (k < D1 && path[k] >= 0 && tok[path[k]] == tgt[path[k - 1]]) ++k;
    atomicMax(&best_key, (unsigned long long)k * 65536ull + (65535ull - (unsigned long long)p));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const int64_t len = (int64_t)(best_key / 65536ull);
    const int64_t p = 65535 - (int64_t)(best_key % 65536ull);
    const int64_t* path = paths + p * D1;
    for (int64_t i = 0; i < D1; ++i) accept_idx[b * D1 + i] = i < len ? path[i] : -1;
    const int64_t last = path[len - 1];
    accept_len[b] = len;
    last_node[b] = last;
    next_root[b] = tgt[last];
  }
}

__global__ void tree_inputs_kernel(const int64_t* __restrict__ root, const int64_t* __restrict__ cand, int64_t C,
                                   const int64_t* __restrict__ source, const int64_t* __restrict__ depths,
                                   int64_t depths_bstride, const int64_t* __restrict__ seqlens, int64_t B, int64_t T,
                                   int64_t* tokens, int64_t* positions) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= B * T) return;
  const int64_t b = i / T, t = i % T;
  tokens[i] = t == 0 ? root[b] : cand[b * C + source[t]];
  positions[i] = seqlens[b] + depths[b * depths_bstride + t];
}

}  // namespace

extern "C" void hk_commit_kv_cuda(uint32_t* kv, int64_t n_planes, int64_t B, int64_t S, int64_t row_words,
                                  const int64_t* seqlens, const int64_t* idx, int64_t k1, const int64_t* lens,
                                  void* stream) {
  const int threads = 128;
  dim3 grid((unsigned)((row_words + threads - 1) / threads), (unsigned)B, (unsigned)n_planes);
  commit_kv_kernel<<<grid, threads, 0, (cudaStream_t)stream>>>(kv, B, S, row_words, seqlens, idx, k1, lens);
}

extern "C" void hk_greedy_verify_cuda(const int64_t* target, const int64_t* tokens, int64_t B, int64_t T,
                                      const int64_t* paths, int64_t paths_bstride, int64_t P, int64_t D1,
                                      int64_t* accept_len, int64_t* accept_idx, int64_t* next_root, int64_t* last_node,
                                      void* stream) {
  const int threads = P >= 128 ? 128 : 32;
  greedy_verify_kernel<<<(unsigned)B, threads, 0, (cudaStream_t)stream>>>(target, tokens, T, paths, paths_bstride, P,
                                                                         D1, accept_len, accept_idx, next_root,
                                                                         last_node);
}

extern "C" void hk_tree_inputs_cuda(const int64_t* root, const int64_t* candidates, int64_t C, const int64_t* source,
                                    const int64_t* depths, int64_t depths_bstride, const int64_t* seqlens, int64_t B,
                                    int64_t T, int64_t* tokens, int64_t* positions, void* stream) {
  const int threads = 256;
  const int64_t n = B * T;
  tree_inputs_kernel<<<(unsigned)((n + threads - 1) / threads), threads, 0, (cudaStream_t)stream>>>(
      root, candidates, C, source, depths, depths_bstride, seqlens, B, T, tokens, positions);
}
