// torch's own vectorised exp (SLEEF, exported by libtorch_cpu) and the width torch's CPU
// capability runs it at: a kernel that takes its exp from here computes what torch computes.
#pragma once

#include <ATen/Version.h>

#include <string>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define ADPFLEET_X86_VECTORS 1
// Weak, so that a torch without them loads the kernels all the same (null: the scalar loops run).
extern "C" __m512 Sleef_expf16_u10(__m512) __attribute__((weak));
extern "C" __m256 Sleef_expf8_u10(__m256) __attribute__((weak));
#endif

namespace adpfleet {

// 512, 256 or 0 (scalar std::exp): torch's CPU capability (ATEN_CPU_CAPABILITY can lower it),
// where torch exports the SLEEF exp of that width. Decided once.
inline int exp_vector_bits() {
#ifdef ADPFLEET_X86_VECTORS
  static const int bits = [] {
    const std::string capability = at::get_cpu_capability();
    if (capability == "AVX512" && Sleef_expf16_u10 != nullptr) return 512;
    if (capability == "AVX2" && Sleef_expf8_u10 != nullptr) return 256;
    return 0;
  }();
  return bits;
#else
  return 0;
#endif
}

}  // namespace adpfleet
