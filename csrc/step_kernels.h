// The CPU kernels a decoding step's layer stack (decode_stack_cpu.cpp) calls directly: the ops' own code on raw
// buffers, without the ops' tensors and the dispatcher. A step's 30 layers made ~1,600 ATen calls (views, empty
// outputs, dtype copies of the lengths, the dispatcher's lookups), ~0.5-0.7 ms of one thread's host work beside
// ~6 ms of kernels, while the other thread waited (2026-11-28, EPYC VM, perf of a plain SmolLM2 step). The ops
// (packed_linear, quantized_linear, tree_attention) call the same functions, so both give the same values.
#pragma once
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace hydra_kernels {

// y [M, N] = x [M, K] W^T (+ bias [N]; nullptr: none), x and y contiguous: the packed_linear op's kernel on its
// panels (fp32 / bf16 [P, K, 64] from pack_linear_weight).
void packed_linear_into(const float* x, int64_t M, const at::Tensor& packed, int64_t N, const float* bias, float* y);

// The same on the quantized_linear op's panels (pack_quantized_weight: bits 4 / 8, with or without offsets, fp32 or
// fp16 scales), with the fastest ISA this machine runs.
void quantized_linear_into(const float* x, int64_t M, const at::Tensor& packed, int64_t N, int64_t bits, bool offset,
                           bool half_scales, const float* bias, float* y);

// The same weights with the activations quantized to int8 and summed in integers (int8_dot_linear_cpu.cpp: its
// panels from pack_int8_dot_weight, a different model from the exact kernel's: see there).
void int8_dot_linear_into(const float* x, int64_t M, const at::Tensor& packed, int64_t N, int64_t bits, bool offset,
                          bool half_scales, const float* bias, float* y);
void check_int8_dot_panels(const at::Tensor& packed, int64_t N, int64_t K, int64_t bits, bool offset, bool half_scales);

// The pack ops' arguments (pack_quantized_weight, pack_int8_dot_weight; `op` names the caller): q int8 [N, K] (4 bits:
// values 0..15), scales fp32 [N, K / G] with G dividing K (and G % g_multiple == 0), offsets fp32 shaped like them or
// none; with half_scales every scale and offset an fp16 value. Refuses anything else (TORCH_CHECK); returns G.
int64_t check_pack_arguments(const char* op, const at::Tensor& q, const at::Tensor& s, const std::optional<at::Tensor>& o,
                             int64_t bits, bool half_scales, int64_t g_multiple);

// Refuses (TORCH_CHECK) panels that are not the quantized_linear op's layout for an [N, K] weight.
void check_quantized_panels(const at::Tensor& packed, int64_t N, int64_t K, int64_t bits, bool offset, bool half_scales);

// The weight rows ids[0 .. n) of the quantized_linear op's panels, dequantized to their exact fp32 values: out [n, K]
// (the embedding lookup of a quantized table; the quantized_rows op). Ids are the caller's to check.
void quantized_rows_into(const at::Tensor& packed, int64_t N, int64_t bits, bool offset, bool half_scales,
                         const int64_t* ids, int64_t n, float* out);

// A stack weight's kind: 0 the packed_linear panels; else 1000 * int8 activations + 100 * fp16 scales + 10 * bits +
// offset: the quantized_linear op's panels (40, 41, 80, 81, + 100), or the int8_dot_linear op's (+ 1000).
struct QuantizedKind {
  bool int8_dot, half;
  int64_t bits;
  bool offset;
  explicit QuantizedKind(int64_t kind)
      : int8_dot(kind >= 1000), half(kind % 1000 >= 100), bits(kind % 100 / 10), offset(kind % 2 == 1) {}
};

// Refuses (TORCH_CHECK) weights that are not the layout `kind` names for an [N, K] weight (kind != 0).
void check_quantized_kind(const at::Tensor& w, int64_t kind, int64_t N, int64_t K);

// Refuses (TORCH_CHECK, naming op and the weight) a weight that is not the layout `kind` names for an [N, K] weight,
// kind 0 (packed fp32 / bf16 panels [ceil(N / 64), K, 64]) included.
void check_step_weight(const char* op, const char* name, const at::Tensor& w, int64_t kind, int64_t N, int64_t K);

// y [M, N] = x [M, K] W^T (+ bias): the kernel of the weight's kind (above), called directly (decode_stack_cpu.cpp).
void step_linear(const float* x, int64_t M, const at::Tensor& w, int64_t kind, int64_t N, const float* bias, float* y);

// torch.argmax of a row of n values: the first maximum; a NaN is larger than every number (the first NaN wins).
int64_t first_argmax(const float* v, int64_t n);

// A native step's token embedding (an fp32 table [V, H] with embed_kind -1, or quantized panels of embed_rows rows with
// embed_kind their quantized kind): refused (TORCH_CHECK, naming op) unless it is one for width H; returns its rows.
int64_t check_embedding(const char* op, const at::Tensor& embed, int64_t embed_kind, int64_t embed_rows, int64_t H);
// The embeddings of ids[0 .. n) (checked by the caller against the rows) into out [n, H]: the module path's values.
void embed_rows_into(const at::Tensor& embed, int64_t embed_kind, int64_t embed_rows, const int64_t* ids, int64_t n,
                     int64_t H, float* out);

// The CPU RMSNorm of model/layers.py (the rms_norm_rows op) over M rows of H: y = (x * r) * w in a fixed order.
void rms_norm_rows_into(const float* x, const float* w, float eps, int64_t M, int64_t H, float* y);

// The decode_stack op (decode_stack_cpu.cpp): x [B, T, H] fp32 -> (the last layer's output [B, T, H], the inputs of
// the layers in `capture` concatenated [B, T, len(capture) * H], or an empty tensor). Per layer l: weights[4l .. 4l
// + 3] = wqkv, wo, w13, w2 with kinds and biases alike; norms[2l], norms[2l + 1] = attention_norm, ffn_norm (one
// eps). kv the whole cache [L, 2, B, S, Hkv, D], written at rows [B, T]; attention over rows [0, kv_len)
// (tree_attention, which checks seqlens and the mask). cos/sin [B, T, D]. attend: int64 [B] or none; a sequence with
// attend 0 is one whose rows nobody reads (a finished sequence of a batch): its attention reads no prefix (only its
// first T cache rows, as if its prefix were empty), so its outputs are unspecified (finite where the cache is); every
// other sequence's are the same, bit for bit, as without attend (a row's attention depends only on its own keys).
std::tuple<at::Tensor, at::Tensor> decode_stack_cpu(
    const at::Tensor& x_in, at::TensorList weights, at::IntArrayRef kinds, const c10::List<std::optional<at::Tensor>>& biases,
    at::TensorList norms, double eps, int64_t n_heads, int64_t n_kv_heads, int64_t intermediate, const at::Tensor& cos_in,
    const at::Tensor& sin_in, const at::Tensor& kv, const at::Tensor& rows_in, const at::Tensor& seqlens,
    const at::Tensor& tree_mask, int64_t kv_len, at::IntArrayRef capture, const std::optional<at::Tensor>& attend);

// The model a native greedy step runs (plain_step_cpu.cpp, tree_step_cpu.cpp): the token embedding (fp32 [V, H] with
// embed_kind -1, or quantized panels of embed_rows rows), the stack's arguments as decode_stack's, the final norm fp32
// [H], the LM head's panels of `vocab` rows (head_kind as a stack weight's kind; no bias), the RoPE tables fp32 [n, D].
struct GreedyModel {
  const at::Tensor& embed;
  int64_t embed_kind, embed_rows;
  at::TensorList weights;
  at::IntArrayRef kinds;
  const c10::List<std::optional<at::Tensor>>& biases;
  at::TensorList norms;
  double eps;
  int64_t n_heads, n_kv_heads, intermediate;
  const at::Tensor& final_norm;
  double final_eps;
  const at::Tensor& head;
  int64_t head_kind, vocab;
  const at::Tensor& cos_table;
  const at::Tensor& sin_table;
};

// tokens int64 [B, T] at RoPE positions[b * T + i], node i of sequence b written at cache row seqlens[b] + i and
// attending per tree_mask (bool [T, T] or [B, T, T]) over rows [0, kv_len) -> (each node's argmax token int64 [B, T]:
// torch.argmax's first maximum, a NaN the maximum; the final-normed hidden states fp32 [B, T, H]). `op` names the
// caller in error messages; everything is checked before a cache row is written. attend: decode_stack's (a sequence
// with attend 0: its outputs unspecified, its attention skipped).
std::tuple<at::Tensor, at::Tensor> greedy_forward_cpu(const char* op, const at::Tensor& tokens, const int64_t* positions,
                                                      const at::Tensor& tree_mask, const GreedyModel& m,
                                                      const at::Tensor& kv, const at::Tensor& seqlens, int64_t kv_len,
                                                      const std::optional<at::Tensor>& attend);

// The greedy_verify and commit_kv ops' input checks and CPU kernels (ops.cpp).
void check_greedy_verify(const at::Tensor& target, const at::Tensor& tokens, const at::Tensor& paths);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> greedy_verify_cpu(const at::Tensor& target,
                                                                             const at::Tensor& tokens,
                                                                             const at::Tensor& paths);
void commit_kv_cpu(at::Tensor kv, const at::Tensor& seqlens, const at::Tensor& idx, const at::Tensor& lens);

// What the tree_attention op's fp32 kernel needs beyond q, K and V, which every layer of a step shares: the committed
// lengths, each (sequence, node)'s tree keys, the scratch. Built once a step (tree_attention_step), used by each
// layer (tree_attention_into).
struct TreeAttentionStep {
  int64_t B = 0, T = 0, Hq = 0, Hkv = 0, D = 0;
  float scale = 0.0f;
  std::vector<int64_t> lens;   // [B] committed lengths
  at::Tensor mask;             // bool [T, T] or [B, T, T], inner dims contiguous (kept alive for mp)
  const bool* mp = nullptr;
  int64_t mb = 0;              // the mask's batch stride (0: one tree)
  int64_t max_len = 0, total_len = 0;
  std::vector<int32_t> nodes;  // [B, T, T]: node i's ancestors-or-self in node order, nt[b * T + i] of them
  std::vector<int32_t> nt;     // [B, T]
  // the AVX-512 passes (tree_attention_cpu.cpp): whether they run, their thread split and scratch (scores, maxima,
  // accumulators of `group` (b, KV head) pairs at a time)
  bool avx512 = false, parallel = false;
  int64_t threads = 1, sstride = 0, max_ranges = 1, per_pair = 0, group = 1;
  at::Tensor scratch;
};

// seqlens int32 / int64 [B]; tree_mask bool [T, T] or [B, T, T]; cache_rows: the K / V buffers' rows (each
// seqlens[b] + T must fit, checked); scale: the softmax scale.
TreeAttentionStep tree_attention_step(const at::Tensor& seqlens, const at::Tensor& tree_mask, int64_t B, int64_t T,
                                      int64_t Hq, int64_t Hkv, int64_t D, int64_t cache_rows, double scale);

// out [B, T, Hq, D] (contiguous) = the attention of q [B, T, Hq, D] (contiguous) over K / V rows at k + b * sb +
// row * ss + head * sh (unit stride in D; V the same strides).
void tree_attention_into(TreeAttentionStep& step, const float* q, const float* k, const float* v, int64_t sb,
                         int64_t ss, int64_t sh, float* out);

}  // namespace hydra_kernels
