// LoRA updates of a batch whose rows belong to different adapters, in one call per module:
//   y[t, :] += (x[t, :] . A[s]^T) . B[s]    for each row t with slot s = slots[t] >= 0,
// over the first ranks[s] rows of A[s] and B[s] (the slot's own rank: 0 skips the row).
// Each row reads its adapter's weights in place, so the work is the rows' own ranks and nothing
// grows with the number of adapters resident or in the batch. Sums are taken in fp32; in bf16
// the update is added to y and the sum rounded once, as torch's y + update would round it.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"

namespace {

using prism::load;
using prism::store;

template <typename T>
void lora_apply(const T* x, int64_t x_stride, T* y, int64_t y_stride, const T* a, const T* b,
                const int64_t* slots, const int64_t* ranks, int64_t rows, int64_t in, int64_t out,
                int64_t max_rank) {
  int64_t work = 0;
  for (int64_t t = 0; t < rows; ++t)
    if (slots[t] >= 0) work += ranks[slots[t]];
  if (work == 0) return;
#pragma omp parallel if (work * (in + out) > 65536)
  {
    std::vector<float> u(static_cast<size_t>(max_rank));
    std::vector<float> acc(static_cast<size_t>(out));
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t s = slots[t];
      if (s < 0) continue;
      const int64_t r_n = ranks[s];
      if (r_n == 0) continue;
      const T* xr = x + t * x_stride;
      const T* as = a + s * max_rank * in;
      const T* bs = b + s * max_rank * out;
      for (int64_t r = 0; r < r_n; ++r) {  // shrink: u = x . A^T
        const T* ar = as + r * in;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < in; ++i) sum += load(xr[i]) * load(ar[i]);
        u[r] = sum;
      }
      float* ac = acc.data();
      std::fill(ac, ac + out, 0.f);
      for (int64_t r = 0; r < r_n; ++r) {  // expand: acc = u . B
        const T* br = bs + r * out;
        const float ur = u[r];
#pragma omp simd
        for (int64_t o = 0; o < out; ++o) ac[o] += ur * load(br[o]);
      }
      T* yr = y + t * y_stride;
      for (int64_t o = 0; o < out; ++o) store(yr + o, load(yr[o]) + ac[o]);
    }
  }
}

}  // namespace

extern "C" {

// x: [rows, in] rows x_stride apart; y: [rows, out] rows y_stride apart (a column range of a
// fused output); a: [slots, max_rank, in], b: [slots, max_rank, out] contiguous; slots: [rows]
// (-1: no adapter); ranks: [slots].
void prism_lora_apply_f32(const float* x, int64_t x_stride, float* y, int64_t y_stride,
                          const float* a, const float* b, const int64_t* slots,
                          const int64_t* ranks, int64_t rows, int64_t in, int64_t out,
                          int64_t max_rank) {
  lora_apply(x, x_stride, y, y_stride, a, b, slots, ranks, rows, in, out, max_rank);
}

void prism_lora_apply_bf16(const uint16_t* x, int64_t x_stride, uint16_t* y, int64_t y_stride,
                           const uint16_t* a, const uint16_t* b, const int64_t* slots,
                           const int64_t* ranks, int64_t rows, int64_t in, int64_t out,
                           int64_t max_rank) {
  lora_apply(x, x_stride, y, y_stride, a, b, slots, ranks, rows, in, out, max_rank);
}

}  // extern "C"
