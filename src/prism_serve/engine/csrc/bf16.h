// bfloat16 as the kernels read and write it: the high half of an fp32, rounded to nearest even
// on the way back (NaN kept NaN), as torch rounds. Every kernel source includes it.
#pragma once

#include <cstdint>
#include <cstring>

namespace prism {

inline float load(float x) { return x; }

inline float load(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) { *p = to_bf16(x); }

}  // namespace prism
