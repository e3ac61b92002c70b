// The element-wise work between a decoder layer's matmuls, one pass each instead of a chain of
// torch ops (each its own pass over memory and its own dispatch):
//   add_rms_norm: x += y (the residual add), then out = RMSNorm(x) * w;
//   rope: the half-split rotary embedding of Q and K heads, in place, cos/sin looked up by position.
//
// Rounding follows the torch ops they replace, so that results match them (engine/models/llama.py):
// this file is compiled without -ffast-math and with -ffp-contract=off, so every product and sum
// is rounded as torch's element-wise kernels round it. In bf16 every op rounds its result to bf16
// (as torch's bf16 ops do), and the norm is computed in fp32, rounded, then scaled by w in bf16
// (as HF does). Only the sum of squares is summed in another order than torch's reduction.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16.h"

namespace {

using prism::load;
using prism::store;
using prism::to_bf16;

// The value an op of dtype T returns for the exact fp32 result x.
inline float round_to(float x, float*) { return x; }
inline float round_to(float x, uint16_t*) { return load(to_bf16(x)); }

template <typename T>
void add_rms_norm(T* x, const T* y, const T* w, T* out, int64_t rows, int64_t hidden, float eps) {
  T* tag = nullptr;
#pragma omp parallel for schedule(static) if (rows * hidden > 32768)
  for (int64_t r = 0; r < rows; ++r) {
    T* xr = x + r * hidden;
    T* orow = out + r * hidden;
    float ss = 0.f;
    if (y != nullptr) {
      const T* yr = y + r * hidden;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < hidden; ++j) {
        const float v = round_to(load(xr[j]) + load(yr[j]), tag);
        store(xr + j, v);
        ss += v * v;
      }
    } else {
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < hidden; ++j) {
        const float v = load(xr[j]);
        ss += v * v;
      }
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
#pragma omp simd
    for (int64_t j = 0; j < hidden; ++j) {
      const float normed = round_to(load(xr[j]) * inv, tag);
      store(orow + j, normed * load(w[j]));
    }
  }
}

template <typename T>
void rope(T* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t row_stride,
          const T* cos, const T* sin, const int64_t* positions) {
  const int64_t half = head_dim / 2;
  T* tag = nullptr;
#pragma omp parallel for schedule(static) if (tokens * heads * head_dim > 65536)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cos + positions[t] * half;
    const T* s = sin + positions[t] * half;
    for (int64_t h = 0; h < heads; ++h) {
      T* p = x + t * row_stride + h * head_dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = load(p[i]), x2 = load(p[i + half]);
        const float ci = load(c[i]), si = load(s[i]);
        const float a = round_to(x1 * ci, tag), b = round_to(x2 * si, tag);
        const float e = round_to(x2 * ci, tag), f = round_to(x1 * si, tag);
        store(p + i, a - b);
        store(p + i + half, e + f);
      }
    }
  }
}

}  // namespace

extern "C" {

// y may be null (the norm alone, x unchanged). x, y, out: [rows, hidden] contiguous; w: [hidden].
void prism_add_rms_norm_f32(float* x, const float* y, const float* w, float* out, int64_t rows,
                            int64_t hidden, float eps) {
  add_rms_norm(x, y, w, out, rows, hidden, eps);
}

void prism_add_rms_norm_bf16(uint16_t* x, const uint16_t* y, const uint16_t* w, uint16_t* out,
                             int64_t rows, int64_t hidden, float eps) {
  add_rms_norm(x, y, w, out, rows, hidden, eps);
}

// x: [tokens, heads, head_dim] with rows `row_stride` elements apart (heads contiguous);
// cos, sin: [positions, head_dim / 2]; positions: [tokens], each a row of cos and sin.
void prism_rope_f32(float* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t row_stride,
                    const float* cos, const float* sin, const int64_t* positions) {
  rope(x, tokens, heads, head_dim, row_stride, cos, sin, positions);
}

void prism_rope_bf16(uint16_t* x, int64_t tokens, int64_t heads, int64_t head_dim,
                     int64_t row_stride, const uint16_t* cos, const uint16_t* sin,
                     const int64_t* positions) {
  rope(x, tokens, heads, head_dim, row_stride, cos, sin, positions);
}

}  // extern "C"
