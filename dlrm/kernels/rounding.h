// 16-bit tables: widening to float32, and stochastic rounding back, shared by
// the kernels (and mirrored with TensorFlow's integer ops in
// dlrm/optim/rounding.py, bit for bit).
//
// Stochastic rounding stores one of the two 16-bit neighbours of a float32
// value x, the upper with probability (x - lower) / (upper - lower), so that the
// expected stored value is x: small updates, which rounding to nearest would
// lose every time, survive on average.
//
// The random bits are a counter-based hash of (seed, step, table, row, column)
// with the table's global row and column: the same on every run, whichever
// thread updates the row, and whichever rank holds it (a replicated table's
// copies stay equal). The hash is splitmix64's finaliser, chained:
//   k = Mix(Mix(Mix(seed) ^ step) ^ table)   (once per op and table)
//   r = Mix(k ^ row)                         (once per row)
//   h = Mix(r ^ column)                      (per value)
// as dlrm/embedding/initializer.py's Mix (which adds the golden ratio first).

#ifndef DLRM_KERNELS_ROUNDING_H_
#define DLRM_KERNELS_ROUNDING_H_

#include <cstdint>
#include <cstring>

namespace dlrm {

static inline uint64_t Mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The key of one table's updates at one step.
static inline uint64_t TableRoundingKey(int64_t seed, int64_t step, int64_t table) {
  return Mix(Mix(Mix(static_cast<uint64_t>(seed)) ^ static_cast<uint64_t>(step)) ^
             static_cast<uint64_t>(table));
}

static inline float WidenBfloat16Bits(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

static inline float WidenHalfBits(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  float out;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    out = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -out : out;
  }
  uint32_t wide;
  if (exponent == 0x1f) {  // infinity or NaN (the payload kept, quiet)
    wide = sign | 0x7f800000u | (mantissa << 13) | (mantissa ? 0x400000u : 0u);
  } else {
    wide = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  }
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

// bfloat16: a random 16-bit integer added to the low half of x's bits, then
// truncated. A carry (probability: the low half / 2^16) moves to the next
// value away from zero; NaN stays a quiet NaN, infinity stays infinite.
static inline uint16_t RoundBfloat16(float x, uint64_t hash) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  if ((bits & 0x7fffffffu) == 0x7f800000u) return static_cast<uint16_t>(bits >> 16);
  return static_cast<uint16_t>((bits + static_cast<uint32_t>(hash >> 48)) >> 16);
}

// float16: |x| truncated to float16 (toward zero) and the residual's share of
// the gap to the next float16 up; rounded up with that probability. Normal
// values compare 13 random bits with the 13 bits cut off (exact); subnormals
// (|x| < 2^-14) compare 32 random bits with the fraction of 2^-24 units.
// Beyond the largest float16 (65504) the gap is to 65536 (infinity).
static inline uint16_t RoundHalf(float x, uint64_t hash) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) {  // NaN: quiet, its top payload bits kept
    return static_cast<uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
  }
  if (magnitude >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65536
  uint32_t down;
  bool up;
  if (magnitude >= 0x38800000u) {  // a normal float16: >= 2^-14
    down = ((((magnitude >> 23) - 112u) << 10) | ((magnitude >> 13) & 0x3ffu));
    up = static_cast<uint32_t>(hash >> 51) < (magnitude & 0x1fffu);
  } else {
    float units;
    std::memcpy(&units, &magnitude, sizeof(units));
    units *= 16777216.0f;  // 2^24, exact
    down = static_cast<uint32_t>(units);
    const float fraction = units - static_cast<float>(down);  // exact
    up = static_cast<double>(hash >> 32) < static_cast<double>(fraction) * 4294967296.0;
  }
  return static_cast<uint16_t>(sign | (down + (up ? 1u : 0u)));
}

}  // namespace dlrm

#endif  // DLRM_KERNELS_ROUNDING_H_
