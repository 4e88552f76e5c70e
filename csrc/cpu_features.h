// CPU feature detection shared by the CPU kernels: HK_X86 marks x86-64 builds (where the AVX-512 and
// AVX2 paths are compiled, per function, with target attributes), cpu_has_avx512() / cpu_has_avx2_fma()
// say whether this machine can run them; elsewhere the kernels take their portable loops.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define HK_X86 1
#endif

namespace hydra_kernels {

inline bool cpu_has_avx512() {
#ifdef HK_X86
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
#else
  return false;
#endif
}

inline bool cpu_has_avx2_fma() {
#ifdef HK_X86
  // (and F16C, which every AVX2 CPU has: the quantized kernel's fp16 scales)
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return yes;
#else
  return false;
#endif
}

}  // namespace hydra_kernels
