// Decode attention that reads K and V where they lie in the paged cache.
//
// One new query token per sequence attends to its sequence's first `lens[i]` cached tokens (the
// last `window` of them where a sliding window is given), found through its block table. Nothing is gathered into a contiguous buffer and nothing is
// padded to a longer context: each K and V row is read once, straight from its block, and the
// query heads that share a KV head (GQA) are attended together so each row is loaded once for
// all of them.
//
// Built at run time by prism_serve/engine/cpu_kernels.py (plain C ABI, called through ctypes,
// OpenMP from the runtime torch has loaded). Scores and sums are fp32 whatever the cache dtype.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>

#include <vector>

#include "bf16.h"

namespace {

using prism::load;
using prism::store;

// Per-thread scratch lives on the stack (about 100 KB at the limits).
constexpr int kMaxHeads = 64;  // query heads
constexpr int kMaxHeadDim = 256;
constexpr int kMaxHidden = 8192;  // query heads x head_dim
constexpr int kMaxBlock = 64;  // tokens per block
// The running max before any score: finite, because -ffast-math lets the compiler assume that no
// value is infinite; exp(kNoScore - score) is 0 for any real score.
constexpr float kNoScore = -1e30f;

// Attends query token i to the tokens from `first` on of blocks [b0, b1) of its table, all heads,
// with a running softmax: leaves each query head's running max m, sum of weights l and weighted
// sum of values acc (not yet divided by l). softcap > 0: scores become softcap * tanh(s / softcap).
template <typename T>
void attend_blocks(const float* qf, const T* k_cache, const T* v_cache, int64_t block_stride,
                   int64_t token_stride, const int64_t* table, int64_t len, int64_t first,
                   int64_t b0, int64_t b1, int64_t num_heads, int64_t group, int64_t head_dim,
                   int64_t block_size, float softcap, float* m, float* l, float* acc) {
  float p[kMaxHeads * kMaxBlock];
  std::memset(acc, 0, sizeof(float) * num_heads * head_dim);
  for (int64_t g = 0; g < num_heads; ++g) m[g] = kNoScore, l[g] = 0.f;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t t0 = b * block_size;
    const int64_t cnt = t0 + block_size < len ? block_size : len - t0;
    const int64_t o0 = first > t0 ? first - t0 : 0;  // the window's first token in this block
    const T* kb = k_cache + table[b] * block_stride;
    const T* vb = v_cache + table[b] * block_stride;
    if (b + 1 < b1) {  // the next block lies elsewhere: start fetching it now
      const char* nk = reinterpret_cast<const char*>(k_cache + table[b + 1] * block_stride);
      for (int64_t x = 0; x < 4; ++x) __builtin_prefetch(nk + 64 * x);
    }
    for (int64_t o = o0; o < cnt; ++o) {  // scores of this block's tokens
      const T* kt = kb + o * token_stride;
      for (int64_t g = 0; g < num_heads; ++g) {
        const float* qg = qf + g * head_dim;
        const T* kh = kt + (g / group) * head_dim;
        float sc = 0.f;
#pragma omp simd reduction(+ : sc)
        for (int64_t d = 0; d < head_dim; ++d) sc += qg[d] * load(kh[d]);
        if (softcap > 0.f) sc = softcap * std::tanh(sc / softcap);
        p[g * kMaxBlock + o] = sc;
      }
    }
    for (int64_t g = 0; g < num_heads; ++g) {  // running softmax: rescale what came before
      float* pg = p + g * kMaxBlock;
      float bm = pg[o0];
      for (int64_t o = o0 + 1; o < cnt; ++o) bm = pg[o] > bm ? pg[o] : bm;
      const float nm = bm > m[g] ? bm : m[g];
      const float corr = std::exp(m[g] - nm);  // 0 on the first block (m = kNoScore)
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t o = o0; o < cnt; ++o) {
        pg[o] = std::exp(pg[o] - nm);
        sum += pg[o];
      }
      l[g] = l[g] * corr + sum;
      m[g] = nm;
      if (corr != 1.f) {
        float* ag = acc + g * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) ag[d] *= corr;
      }
    }
    for (int64_t o = o0; o < cnt; ++o) {  // values
      const T* vt = vb + o * token_stride;
      for (int64_t g = 0; g < num_heads; ++g) {
        const float pr = p[g * kMaxBlock + o];
        const T* vh = vt + (g / group) * head_dim;
        float* ag = acc + g * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) ag[d] += pr * load(vh[d]);
      }
    }
  }
}

template <typename T>
int paged_decode(const T* q, const T* k_cache, const T* v_cache, int64_t block_stride,
                 int64_t token_stride, const int64_t* tables, const int64_t* lens, int64_t n,
                 int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                 int64_t block_size, float scale, int64_t window, float softcap, T* out) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return 1;
  if (window < 0) return 4;
  const int64_t group = num_heads / num_kv_heads;
  if (num_heads > kMaxHeads || head_dim > kMaxHeadDim || num_heads * head_dim > kMaxHidden ||
      block_size <= 0 || block_size > kMaxBlock)
    return 2;
  // the first token each sequence attends to, and the first block that holds it
  auto first_of = [&](int64_t i) { return window > 0 && lens[i] > window ? lens[i] - window : 0; };
  int64_t most_blocks = 1;
  for (int64_t i = 0; i < n; ++i) {
    if (lens[i] <= 0 || lens[i] > max_blocks * block_size) return 3;
    const int64_t nb = (lens[i] + block_size - 1) / block_size - first_of(i) / block_size;
    most_blocks = nb > most_blocks ? nb : most_blocks;
  }
  const int64_t hd = num_heads * head_dim;

  // A work item reads a run of a sequence's blocks front to back, K then V of each block (they
  // are neighbours in the cache). With fewer sequences than two per thread, each sequence's
  // blocks are split into `parts` runs so that every thread has work, and the runs' partial
  // softmax states are merged after (a split by heads would read every row strided, slower).
  const int64_t threads = omp_get_max_threads();
  int64_t parts = n >= 2 * threads ? 1 : (2 * threads + n - 1) / n;
  if (parts > most_blocks) parts = most_blocks;
  if (parts == 1) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      float qf[kMaxHidden], acc[kMaxHidden], m[kMaxHeads], l[kMaxHeads];
      for (int64_t x = 0; x < hd; ++x) qf[x] = load(q[i * hd + x]) * scale;
      const int64_t nb = (lens[i] + block_size - 1) / block_size;
      const int64_t first = first_of(i);
      attend_blocks(qf, k_cache, v_cache, block_stride, token_stride, tables + i * max_blocks,
                    lens[i], first, first / block_size, nb, num_heads, group, head_dim, block_size,
                    softcap, m, l, acc);
      for (int64_t g = 0; g < num_heads; ++g) {
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < head_dim; ++d)
          store(out + i * hd + g * head_dim + d, acc[g * head_dim + d] * inv);
      }
    }
    return 0;
  }
  // per (sequence, part): m and l of each head, then acc
  std::vector<float> state(static_cast<size_t>(n * parts * num_heads * (head_dim + 2)));
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < n * parts; ++item) {
    const int64_t i = item / parts, part = item % parts;
    const int64_t first = first_of(i), fb = first / block_size;
    const int64_t nb = (lens[i] + block_size - 1) / block_size - fb;  // blocks in the window
    const int64_t b0 = fb + nb * part / parts, b1 = fb + nb * (part + 1) / parts;
    float* st = state.data() + item * num_heads * (head_dim + 2);
    float qf[kMaxHidden];
    for (int64_t x = 0; x < hd; ++x) qf[x] = load(q[i * hd + x]) * scale;
    if (b0 == b1) {  // a short sequence: nothing in this run
      for (int64_t g = 0; g < num_heads; ++g) st[g] = kNoScore, st[num_heads + g] = 0.f;
      continue;
    }
    attend_blocks(qf, k_cache, v_cache, block_stride, token_stride, tables + i * max_blocks,
                  lens[i], first, b0, b1, num_heads, group, head_dim, block_size, softcap, st,
                  st + num_heads, st + 2 * num_heads);
  }
  for (int64_t i = 0; i < n; ++i) {  // merge the runs of each sequence
    for (int64_t g = 0; g < num_heads; ++g) {
      float mx = kNoScore;
      for (int64_t part = 0; part < parts; ++part) {
        const float mp = state[(i * parts + part) * num_heads * (head_dim + 2) + g];
        mx = mp > mx ? mp : mx;
      }
      float acc[kMaxHeadDim] = {0.f};
      float l = 0.f;
      for (int64_t part = 0; part < parts; ++part) {
        const float* st = state.data() + (i * parts + part) * num_heads * (head_dim + 2);
        if (st[num_heads + g] == 0.f) continue;  // an empty run
        const float w = std::exp(st[g] - mx);
        l += st[num_heads + g] * w;
        const float* ap = st + 2 * num_heads + g * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) acc[d] += ap[d] * w;
      }
      for (int64_t d = 0; d < head_dim; ++d) store(out + i * hd + g * head_dim + d, acc[d] / l);
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// Returns 0, or a nonzero code for arguments the kernel cannot take (checked before any work).
int prism_paged_decode_f32(const float* q, const float* k_cache, const float* v_cache,
                           int64_t block_stride, int64_t token_stride, const int64_t* tables,
                           const int64_t* lens, int64_t n, int64_t max_blocks, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                           int64_t window, float softcap, float* out) {
  return paged_decode(q, k_cache, v_cache, block_stride, token_stride, tables, lens, n, max_blocks,
                      num_heads, num_kv_heads, head_dim, block_size, scale, window, softcap, out);
}

int prism_paged_decode_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                            int64_t block_stride, int64_t token_stride, const int64_t* tables,
                            const int64_t* lens, int64_t n, int64_t max_blocks, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                            int64_t window, float softcap, uint16_t* out) {
  return paged_decode(q, k_cache, v_cache, block_stride, token_stride, tables, lens, n, max_blocks,
                      num_heads, num_kv_heads, head_dim, block_size, scale, window, softcap, out);
}

}  // extern "C"
