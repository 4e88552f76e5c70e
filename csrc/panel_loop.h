// The loop both CPU small-M linear kernels share (packed_linear_cpu.cpp, quantized_linear_cpu.cpp): output
// columns in 64-wide panels split across threads, each panel's rows of x in tiles of at most `tile` rows.
// A panel's bias comes as a full 64-wide row (zero past N), so a kernel can load it whole.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace hydra_kernels {

constexpr int64_t kPanelColumns = 64;

// fn(p, m0, rows, n0, ncols, panel_bias, half): rows [m0, m0 + rows) of panel p (columns [n0, n0 + ncols)); half -1:
// all of them, 0 / 1: only the panel's columns [0, 32) / [32, 64).
//
// halves: the threads split half panels rather than panels (a thread's run of halves is called panel by panel, only a
// lone half at its ends by halves). So a layer whose panel count does not divide by the thread count still splits
// evenly: SmolLM2's wo and w2 have 9 panels, and with 2 threads one thread computed 5 of them while the other waited
// (2026-11-28, EPYC VM, perf of a plain step). Only for a kernel that computes a half panel's columns exactly as the
// whole panel's (each column's sum is its own).
template <typename Fn>
void for_each_panel_tile(int64_t M, int64_t N, const float* bias, int64_t tile, Fn&& fn, bool halves = false) {
  const int64_t P = (N + kPanelColumns - 1) / kPanelColumns, U = halves ? 2 * P : P;
  at::parallel_for(0, U, 1, [&](int64_t u0, int64_t u1) {
    float tail_bias[kPanelColumns];
    for (int64_t u = u0; u < u1;) {
      int64_t p = u;
      int half = -1;
      if (halves) {
        p = u / 2;
        const bool whole = u % 2 == 0 && u + 1 < u1;
        half = whole ? -1 : static_cast<int>(u % 2);
        u += whole ? 2 : 1;
      } else {
        ++u;
      }
      const int64_t n0 = p * kPanelColumns;
      const int ncols = static_cast<int>(std::min(kPanelColumns, N - n0));
      if (half == 1 && ncols <= kPanelColumns / 2) continue;  // the second half of a last panel that has none
      const float* pb = nullptr;
      if (bias != nullptr) {
        std::fill(tail_bias, tail_bias + kPanelColumns, 0.0f);
        std::copy(bias + n0, bias + n0 + ncols, tail_bias);
        pb = tail_bias;
      }
      for (int64_t m0 = 0; m0 < M; m0 += tile)
        fn(p, m0, static_cast<int>(std::min<int64_t>(tile, M - m0)), n0, ncols, pb, half);
    }
  });
}

}  // namespace hydra_kernels
