// The loop both CPU small-M linear kernels share (packed_linear_cpu.cpp, quantized_linear_cpu.cpp): output
// columns in 64-wide panels split across threads, each panel's rows of x in tiles of at most `tile` rows.
// A panel's bias comes as a full 64-wide row (zero past N), so a kernel can load it whole.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace hydra_kernels {

constexpr int64_t kPanelColumns = 64;

// fn(p, m0, rows, n0, ncols, panel_bias): rows [m0, m0 + rows) of panel p (columns [n0, n0 + ncols)).
template <typename Fn>
void for_each_panel_tile(int64_t M, int64_t N, const float* bias, int64_t tile, Fn&& fn) {
  const int64_t P = (N + kPanelColumns - 1) / kPanelColumns;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    float tail_bias[kPanelColumns];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanelColumns;
      const int ncols = static_cast<int>(std::min(kPanelColumns, N - n0));
      const float* pb = nullptr;
      if (bias != nullptr) {
        std::fill(tail_bias, tail_bias + kPanelColumns, 0.0f);
        std::copy(bias + n0, bias + n0 + ncols, tail_bias);
        pb = tail_bias;
      }
      for (int64_t m0 = 0; m0 < M; m0 += tile)
        fn(p, m0, static_cast<int>(std::min<int64_t>(tile, M - m0)), n0, ncols, pb);
    }
  });
}

}  // namespace hydra_kernels
