// float32 <-> bfloat16 over arrays, shared by the kernels. Both loops vectorise:
// widening is a shift, narrowing rounds to nearest even, as Eigen's conversion,
// and keeps NaN a (quiet) NaN. Compiled for AVX-512, AVX2 and baseline x86-64,
// the best picked when the library loads; static, so that each source that
// includes this header has its own copy and no symbol clashes at link time.

#ifndef DLRM_KERNELS_BFLOAT16_H_
#define DLRM_KERNELS_BFLOAT16_H_

#include <cstdint>
#include <cstring>

#include "tensorflow/core/framework/numeric_types.h"

namespace dlrm {

__attribute__((target_clones("avx512f", "avx2", "default"))) static void Widen(
    const Eigen::bfloat16* in, int64_t count, float* out) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(in);
  for (int64_t k = 0; k < count; ++k) {
    const uint32_t wide = static_cast<uint32_t>(bits[k]) << 16;
    std::memcpy(out + k, &wide, sizeof(wide));
  }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) static void Narrow(
    const float* in, int64_t count, Eigen::bfloat16* out) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(out);
  for (int64_t k = 0; k < count; ++k) {
    uint32_t x;
    std::memcpy(&x, in + k, sizeof(x));
    const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (x >> 16) | 0x40u;
    bits[k] = static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
  }
}

}  // namespace dlrm

#endif  // DLRM_KERNELS_BFLOAT16_H_
