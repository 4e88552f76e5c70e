// CPU feature detection shared by the CPU kernels: HK_X86 marks x86-64 builds (where the AVX-512 and
// AVX2 paths are compiled, per function, with target attributes), cpu_has_avx512() / cpu_has_avx2_fma()
// say whether this machine can run them; elsewhere the kernels take their portable loops.
//
// The environment variable HK_CPU_ISA=avx2 (or =portable), read once per process, makes every kernel run
// as on a CPU without AVX-512 (or without AVX2 too): the only way to test those paths whole on an AVX-512
// machine (tests/test_cpu_isa_limit.py runs the embedded model so). =avx512 is the default; the package refuses
// any other value when it is imported (hydra_kernels/__init__.py), so the kernels never throw for it here.
#pragma once

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define HK_X86 1
#endif

namespace hydra_kernels {

// 3: no limit, 2: at most AVX2, 1: portable loops only (HK_CPU_ISA)
inline int cpu_isa_limit() {
  static const int limit = [] {
    const char* v = std::getenv("HK_CPU_ISA");
    if (v != nullptr && std::strcmp(v, "avx2") == 0) return 2;
    if (v != nullptr && std::strcmp(v, "portable") == 0) return 1;
    return 3;
  }();
  return limit;
}

inline bool cpu_has_avx512() {
#ifdef HK_X86
  static const bool yes = __builtin_cpu_supports("avx512f") && cpu_isa_limit() >= 3;
  return yes;
#else
  return false;
#endif
}

// AVX-512 VNNI (vpdpbusd): the int8 dot kernel (int8_dot_linear_cpu.cpp); HK_CPU_ISA=avx2 or =portable turns it off
inline bool cpu_has_avx512_vnni() {
#ifdef HK_X86
  static const bool yes = cpu_has_avx512() && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  return yes;
#else
  return false;
#endif
}

inline bool cpu_has_avx2_fma() {
#ifdef HK_X86
  // (and F16C, which every AVX2 CPU has: the quantized kernel's fp16 scales)
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c") && cpu_isa_limit() >= 2;
  return yes;
#else
  return false;
#endif
}

}  // namespace hydra_kernels
