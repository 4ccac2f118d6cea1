// Shared pieces of the CPU kernels: a vector type of one register (16 floats with AVX-512, 8 with
// AVX2 and NEON: formats.h's W) through the compiler's vector extensions with -march=native, the
// streaming dot products of a few x rows with one weight row, and argument checks.
//
// The vector is one register wide on purpose. A 16-float vector on AVX2 is lowered by GCC to pairs
// of ymm registers, and every product with a scalar (`x * k[i]`) goes through the stack: 16 scalar
// stores and 4 reloads per broadcast. Measured on AVX2: the DeltaNet token step of 12 layers x 16
// heads of 128 x 128 took 2.2 ms with 16-float vectors and 0.37 ms with 8-float ones.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <ostream>
#include <vector>

#include "formats.h"

namespace qwen35 {

constexpr int V = W;  // floats per vector: one register
typedef wvec vec;

inline float hsum(vec v) {  // tree reduction down to 4 lanes, then scalar
  typedef float quarter __attribute__((vector_size(4 * sizeof(float))));
#if defined(__AVX512F__)
  typedef float half __attribute__((vector_size(8 * sizeof(float))));
  const half h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const quarter q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
#else
  const quarter q = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
#endif
  return (q[0] + q[1]) + (q[2] + q[3]);
}

inline vec load(const float* p) {
  vec v;
  __builtin_memcpy(&v, p, sizeof(vec));
  return v;
}

inline void store(float* p, vec v) { __builtin_memcpy(p, &v, sizeof(vec)); }

constexpr int64_t PREFETCH_F32_BYTES = 8192;  // how far ahead the float32 kernels prefetch a weight row

// y[r * ldy] = x[r] . w for r < R (R <= 8): one weight row streamed once, with
// independent accumulator chains per x row.
template <int R>
inline void dot_row(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
  // accumulator chains per x row: at most 8 in flight (R = 3-4 with two chains each ran batch 4 at
  // ~3x batch 1 on AVX2 when a vec was two registers there)
  constexpr int C = R == 1 ? 4 : R <= 4 ? 2 : 1;
  vec a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = vec{};
  int64_t k = 0;
  for (; k + C * V <= K; k += C * V) {
    for (int c = 0; c < C; ++c) prefetch_ahead<R>(w + k + c * V, PREFETCH_F32_BYTES);
    for (int c = 0; c < C; ++c) {
      const vec wc = load(w + k + c * V);
      for (int r = 0; r < R; ++r) a[r][c] += load(x + r * ldx + k + c * V) * wc;
    }
  }
  for (int r = 0; r < R; ++r) {
    vec t = a[r][0];
    for (int c = 1; c < C; ++c) t += a[r][c];
    float s = hsum(t);
    for (int64_t j = k; j < K; ++j) s += x[r * ldx + j] * w[j];
    y[r * ldy] = s;
  }
}

// a . b through the one-row product kernel: a scalar loop is one chain of dependent adds, which GCC
// does not reorder
inline float dot(const float* a, const float* b, int64_t n) {
  float s;
  dot_row<1>(a, 0, b, n, &s, 1);
  return s;
}

// x <- x / sqrt(sum x^2 + eps) * scale (lm.delta_rule.l2norm, eps 1e-6)
inline void l2norm(float* x, int64_t n, float scale) {
  const float r = scale / std::sqrt(dot(x, x, n) + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] *= r;
}

// The same for 5-8 x rows over k in [k0, k1), with 8-float accumulators (R of them: 16-float ones
// would not all fit in registers), adding into y when `accumulate`.
typedef float vec8 __attribute__((vector_size(8 * sizeof(float))));

template <int R>
inline void dot_row_wide(const float* x, int64_t ldx, const float* w, int64_t k0, int64_t k1, float* y, int64_t ldy,
                         bool accumulate) {
  vec8 a[R];
  for (int r = 0; r < R; ++r) a[r] = vec8{};
  int64_t k = k0;
  for (; k + 8 <= k1; k += 8) {
    if ((k & 15) == 0) prefetch_ahead<R>(w + k, PREFETCH_F32_BYTES);  // every line
    vec8 wk;
    __builtin_memcpy(&wk, w + k, sizeof(vec8));
    for (int r = 0; r < R; ++r) {
      vec8 xk;
      __builtin_memcpy(&xk, x + r * ldx + k, sizeof(vec8));
      a[r] += xk * wk;
    }
  }
  for (int r = 0; r < R; ++r) {
    const vec8 v = a[r];
    float s = ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
    for (int64_t j = k; j < k1; ++j) s += x[r * ldx + j] * w[j];
    y[r * ldy] = accumulate ? y[r * ldy] + s : s;
  }
}

// Rows [0, M) of x (M <= 8) times weight rows [n0, n1) of W [N, K] -> y[:, n0:n1] (row stride ldy).
// Each weight row comes from memory once. With 3-8 rows, x is taken in chunks of K (x's chunk stays
// in L1 while the weight rows of the block stream past it): ~1.8x faster at K = 2048 with 8 rows;
// with 4 rows of K = 2048 (32 KiB, all of L1) the unchunked form ran ~3x slower on AVX2.
inline void block(const float* x, int64_t M, int64_t ldx, const float* W, int64_t K, int64_t n0, int64_t n1,
                  float* y, int64_t ldy) {
  if (M <= 2) {
    for (int64_t n = n0; n < n1; ++n) {
      const float* w = W + n * K;
      if (M == 1)
        dot_row<1>(x, ldx, w, K, y + n, ldy);
      else
        dot_row<2>(x, ldx, w, K, y + n, ldy);
    }
    return;
  }
  constexpr int64_t KC = 1024;
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = std::min(K, k0 + KC);
    for (int64_t n = n0; n < n1; ++n) {
      const float* w = W + n * K;
      switch (M) {
        case 3: dot_row_wide<3>(x, ldx, w, k0, k1, y + n, ldy, k0 > 0); break;
        case 4: dot_row_wide<4>(x, ldx, w, k0, k1, y + n, ldy, k0 > 0); break;
        case 5: dot_row_wide<5>(x, ldx, w, k0, k1, y + n, ldy, k0 > 0); break;
        case 6: dot_row_wide<6>(x, ldx, w, k0, k1, y + n, ldy, k0 > 0); break;
        case 7: dot_row_wide<7>(x, ldx, w, k0, k1, y + n, ldy, k0 > 0); break;
        default: dot_row_wide<8>(x, ldx, w, k0, k1, y + n, ldy, k0 > 0); break;
      }
    }
  }
}

// The same products for a weight of any format (formats.h): blocks of 32 weights converted to
// float32 in registers, then multiplied with x in float32. Up to 8 accumulators in flight (one
// register each, also on AVX2), adding into y when `accumulate`; k0 is a multiple of 32. One row of x
// takes 4 chains, two blocks an iteration where a block is fewer vectors (AVX-512: 2); with 2 rows and
// more, the chains of one block (4 chains a row were faster at one row only).
template <int R, class T>
inline void dot_row_fmt(const float* x, int64_t ldx, const uint8_t* w, int64_t k0, int64_t k1, float* y, int64_t ldy,
                        bool accumulate) {
  constexpr int C = R == 1 ? std::min(4, 2 * NB) : std::max(1, std::min(NB, 8 / R));  // chains per row
  constexpr int U = C > NB ? 2 : 1;  // blocks per iteration
  wvec a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = wvec{};
  const int64_t b1 = k1 / QK;
  auto step = [&](int64_t b, int u) {  // block b into chains u NB, u NB + 1, ... (mod C)
    prefetch_block<T, R>(w + b * T::block_bytes);
    wvec wv[NB];
    T::load(w, b, wv);
    for (int j = 0; j < NB; ++j)
      for (int r = 0; r < R; ++r) a[r][(u * NB + j) % C] += wload(x + r * ldx + b * QK + j * W) * wv[j];
  };
  int64_t b = k0 / QK;
  for (; b + U <= b1; b += U)
    for (int u = 0; u < U; ++u) step(b + u, u);
  for (; b < b1; ++b) step(b, 0);
  for (int r = 0; r < R; ++r) {
    wvec t = a[r][0];
    for (int c = 1; c < C; ++c) t += a[r][c];
    float s = hsum(t);
    if constexpr (T::block_bytes == QK * 4 || T::block_bytes == QK * 2)  // float formats: K % 32 tail
      for (int64_t k = b1 * QK; k < k1; ++k) s += x[r * ldx + k] * T::at(w, k);
    y[r * ldy] = accumulate ? y[r * ldy] + s : s;
  }
}

// Products of 2-8 rows of x with float32 or bf16 weight rows on AVX2 builds (QWEN35_ROW_PAIRS): two
// weight rows at a time against up to 6 rows of x, so that each load of x feeds two FMAs (an FMA with
// a load from a working set over 4 KiB issues at half rate on Zen 3), the two rows half a task apart,
// so that each thread reads two streams. Up to 6 rows of x take one pass over a pair (12 accumulators
// in 16 registers); 7 and 8 rows two passes, the second reading the pair from cache while its pairs
// prefetch the thread's next task. AVX-512 builds keep dot_row_fmt and the panels.
#if defined(__AVX2__) && !defined(__AVX512F__)
#define QWEN35_ROW_PAIRS 1
#else
#define QWEN35_ROW_PAIRS 0
#endif

#if QWEN35_ROW_PAIRS
// y[r * ldy] (=, or += when `accumulate`) x[r] . wa and y[r * ldy + 1] x[r] . wb for r < XR, over
// blocks [b0, k1 / 32) and K's tail up to k1; the lines `ahead` bytes past each block prefetched.
template <class T, int XR>
inline void dot_row_pair(const float* x, int64_t ldx, const uint8_t* wa, const uint8_t* wb, int64_t ahead, int64_t b0,
                         int64_t k1, float* y, int64_t ldy, bool accumulate, int64_t dy) {
  wvec a[XR], c[XR];
  for (int r = 0; r < XR; ++r) a[r] = c[r] = wvec{};
  const int64_t b1 = k1 / QK;
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t line = 0; line < T::block_bytes; line += 64) {
      __builtin_prefetch(wa + ahead + b * T::block_bytes + line, 0, 3);
      __builtin_prefetch(wb + ahead + b * T::block_bytes + line, 0, 3);
    }
    wvec va[NB], vb[NB];
    T::load(wa, b, va);
    T::load(wb, b, vb);
    for (int j = 0; j < NB; ++j)
      for (int r = 0; r < XR; ++r) {
        wvec xv = wload(x + r * ldx + b * QK + j * W);
        asm("" : "+x"(xv));  // in a register, loaded once for both rows (GCC would fold it into each FMA)
        a[r] += xv * va[j];
        c[r] += xv * vb[j];
      }
  }
  for (int r = 0; r < XR; ++r) {
    float sa = hsum(a[r]), sc = hsum(c[r]);
    for (int64_t k = b1 * QK; k < k1; ++k) sa += x[r * ldx + k] * T::at(wa, k), sc += x[r * ldx + k] * T::at(wb, k);
    y[r * ldy] = accumulate ? y[r * ldy] + sa : sa;
    y[r * ldy + dy] = accumulate ? y[r * ldy + dy] + sc : sc;
  }
}

// Rows [0, XR) of x times weight rows [n0, n1) over x's range [k0, k1), in pairs of weight rows half
// the range apart (two streams, as block_pairs reads one-row products), an odd last row paired with
// itself.
template <class T, int XR>
inline void row_pairs_pass(const float* x, int64_t ldx, const Rows& W, int64_t n0, int64_t n1, int64_t k0, int64_t k1,
                           float* y, int64_t ldy, int64_t ahead) {
  const int64_t h = (n1 - n0) / 2;
  for (int64_t n = n0; n < n0 + h; ++n)
    dot_row_pair<T, XR>(x, ldx, W.row(n), W.row(n + h), ahead, k0 / QK, k1, y + n, ldy, k0 > 0, h);
  if (const int64_t n = n0 + 2 * h; n < n1) {
    float t[2 * XR];
    dot_row_pair<T, XR>(x, ldx, W.row(n), W.row(n), 0, k0 / QK, k1, t, 2, false, 1);
    for (int r = 0; r < XR; ++r) y[r * ldy + n] = k0 > 0 ? y[r * ldy + n] + t[2 * r] : t[2 * r];
  }
}

// Rows [0, M) of x (2 <= M <= 8) times weight rows [n0, n1) of format T (TraitsF32 or TraitsBF16)
// -> y[:, n0:n1], x in chunks of 1024 inputs (as block_fmt). The first pass over a pair prefetches
// the next pair; a second pass the pair as far ahead as [n0, n1) is long (the thread's next task).
template <class T>
inline void block_row_pairs(const float* x, int64_t M, int64_t ldx, const Rows& W, int64_t K, int64_t n0, int64_t n1,
                            float* y, int64_t ldy) {
  constexpr int64_t KC = 1024;
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = std::min(K, k0 + KC);
    for (int64_t g = 0; g < M;) {
      const int64_t rows = M <= 6 ? M : g == 0 ? 4 : M - 4;
      const int64_t ahead = (g == 0 ? 1 : n1 - n0) * W.stride;
      const float* xg = x + g * ldx;
      float* yg = y + g * ldy;
      switch (rows) {
        case 2: row_pairs_pass<T, 2>(xg, ldx, W, n0, n1, k0, k1, yg, ldy, ahead); break;
        case 3: row_pairs_pass<T, 3>(xg, ldx, W, n0, n1, k0, k1, yg, ldy, ahead); break;
        case 4: row_pairs_pass<T, 4>(xg, ldx, W, n0, n1, k0, k1, yg, ldy, ahead); break;
        case 5: row_pairs_pass<T, 5>(xg, ldx, W, n0, n1, k0, k1, yg, ldy, ahead); break;
        default: row_pairs_pass<T, 6>(xg, ldx, W, n0, n1, k0, k1, yg, ldy, ahead); break;
      }
      g += rows;
    }
  }
}

// Whether a product of M rows of x with W takes block_row_pairs.
inline bool row_pairs_path(const Rows& W, int64_t M) { return M >= 2 && (W.fmt == F32 || W.fmt == BF16); }
#endif

// One row of x times two weight rows of format T at once: *ya = x . wa, *yb = x . wb, two chains
// each. Rows in different pages make two streams, which the hardware prefetchers of Zen 3 follow at
// fp32's byte rate where one bf16 stream does not (block_pairs).
template <class T>
inline void dot_two_rows(const float* x, const uint8_t* wa, const uint8_t* wb, int64_t K, float* ya, float* yb) {
  wvec a[2] = {}, c[2] = {};
  const int64_t b1 = K / QK;
  for (int64_t b = 0; b < b1; ++b) {
    prefetch_block<T, 1>(wa + b * T::block_bytes);
    prefetch_block<T, 1>(wb + b * T::block_bytes);
    wvec va[NB], vb[NB];
    T::load(wa, b, va);
    T::load(wb, b, vb);
    for (int j = 0; j < NB; ++j) {
      const wvec xj = wload(x + b * QK + j * W);
      a[j % 2] += xj * va[j];
      c[j % 2] += xj * vb[j];
    }
  }
  float sa = hsum(a[0] + a[1]), sc = hsum(c[0] + c[1]);
  for (int64_t k = b1 * QK; k < K; ++k) sa += x[k] * T::at(wa, k), sc += x[k] * T::at(wb, k);
  *ya = sa, *yb = sc;
}

// One row of x (xp: in TraitsBF16Pairs' order) times the bf16 rows [n0, n1) of a BF16_G8 weight
// (whole groups of 8) -> y[n0:n1]. Per block of 32 inputs, x's vectors are loaded once for the
// group's 8 rows, each row read as pairs (one load, a shift and an and per 2W weights) into its own
// accumulator: one stream a thread and a third of the loads of one row at a time. (The AVX2 build
// takes x two vectors at a time: 8 accumulators, 2 of x and the pair in 16 registers.) Against one
// row at a time, in cache: 1.7-1.8x; whole batch-1 bf16 steps in the fast memory state ~1.11x
// (docs/kernel-decisions.md).
inline void block_bf16_groups(const float* xp, const Rows& Wg, int64_t K, int64_t n0, int64_t n1, float* y) {
  for (int64_t n = n0; n < n1; n += RG) {
    const uint8_t* g = Wg.row(n);
    wvec acc[RG];
    for (int r = 0; r < RG; ++r) acc[r] = wvec{};
    for (int64_t b = 0; b < K / QK; ++b) {
      const uint8_t* o = g + b * TraitsBF16G8::block_bytes;
      for (int j = 0; j < NB; j += 2) {  // 2W weights of each row: its even ones, then its odd ones
        const wvec x0 = wload(xp + b * QK + j * W), x1 = wload(xp + b * QK + (j + 1) * W);
        for (int r = 0; r < RG; ++r) {
          wvec_u32 u;
          std::memcpy(&u, o + r * QK * 2 + j * W * 2, sizeof(u));
          const wvec_u32 even = u << 16, odd = u & 0xffff0000u;
          wvec e, d;
          std::memcpy(&e, &even, sizeof(e));
          std::memcpy(&d, &odd, sizeof(d));
          acc[r] += e * x0;
          acc[r] += d * x1;
        }
      }
    }
    for (int r = 0; r < RG; ++r) y[n + r] = hsum(acc[r]);
  }
}

// One row of x (xp: in TraitsBF16Pairs' order, pairs_order) times bf16 weight rows [n0, n1) -> y[n0:n1],
// QWEN35_BF16_PAIR_ROWS rows at a time (the tuning profile): 2 streams row n with row n + h, h = half
// the range (two streams a core where one stream is capped by its misses in flight), 1 one row.
inline void block_pairs(const float* xp, const Rows& W, int64_t K, int64_t n0, int64_t n1, float* y) {
  if (W.fmt == BF16_G8) return block_bf16_groups(xp, W, K, n0, n1, y);
  const int64_t h = QWEN35_BF16_PAIR_ROWS == 2 ? (n1 - n0) / 2 : 0;
  for (int64_t n = n0; n < n0 + h; ++n) dot_two_rows<TraitsBF16Pairs>(xp, W.row(n), W.row(n + h), K, y + n, y + n + h);
  for (int64_t n = n0 + 2 * h; n < n1; ++n) dot_row_fmt<1, TraitsBF16Pairs>(xp, K, W.row(n), 0, K, y + n, 1, false);
}

// Whether one-row bf16 products in rows take block_pairs (QWEN35_BF16_PAIRS, the tuning profile);
// bf16 rows in groups of 8 take it with one row of x on every build (block_bf16_groups).
inline bool pairs_path(const Rows& W, int64_t M) {
  return M == 1 && ((QWEN35_BF16_PAIRS && W.fmt == BF16) || W.fmt == BF16_G8);
}

// Rows [0, M) of x (2 <= M <= 8) times the bf16 rows [n0, n1) of a BF16_G8 weight (whole groups)
// -> y[:, n0:n1]. A group is read in passes of RS adjacent rows (RS x 64 contiguous bytes of each
// 512-byte block), R x RS accumulators, x's R vectors loaded once per RS rows: as many rows a pass
// as the registers hold (AVX-512 32, AVX2 16). Each pass prefetches its lines of the next group
// into L2, so that memory streams while the later passes compute on a group already in cache: with
// the pass's own lines prefetched 4 KiB ahead instead, memory idled through those passes, and whole
// bench-checkpoint bf16 steps ran 0.85x (AVX2, batch 4) and 0.92x (batch 8) of the rows layout;
// with the next group's, 1.41x and 1.20x (AVX-512: 1.24x and ~1.0x, where batch 8 takes the panels;
// docs/kernel-decisions.md). Reading one row of a group per pass (its 64 bytes of
// every 512) ran batch-4 bf16 steps 0.78x of the rows layout.
template <int R>
constexpr int group_pass_rows() {
  if constexpr (W == 16) return R <= 2 ? 8 : R <= 4 ? 4 : 2;
  return R <= 2 ? 4 : R <= 4 ? 2 : 1;
}

template <int R>
inline void block_bf16_groups_rows(const float* x, int64_t ldx, const Rows& Wg, int64_t K, int64_t n0, int64_t n1,
                                   float* y, int64_t ldy) {
  constexpr int RS = group_pass_rows<R>();
  for (int64_t n = n0; n < n1; n += RG) {
    const uint8_t* g = Wg.row(n);
    for (int h = 0; h < RG; h += RS) {
      wvec acc[R][RS];
      for (int r = 0; r < R; ++r)
        for (int s = 0; s < RS; ++s) acc[r][s] = wvec{};
      for (int64_t b = 0; b < K / QK; ++b) {
        const uint8_t* o = g + b * TraitsBF16G8::block_bytes + h * QK * 2;
        for (int s = 0; s < RS; ++s) __builtin_prefetch(o + RG * Wg.stride + s * QK * 2, 0, 2);  // the next group's
        for (int j = 0; j < NB; ++j) {
          wvec xv[R];
          for (int r = 0; r < R; ++r) xv[r] = wload(x + r * ldx + b * QK + j * W);
          for (int s = 0; s < RS; ++s) {
            const wvec w = cvt_bf16(o + s * QK * 2 + j * W * 2);
            for (int r = 0; r < R; ++r) acc[r][s] += w * xv[r];
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int s = 0; s < RS; ++s) y[r * ldy + n + h + s] = hsum(acc[r][s]);
    }
  }
}

inline void block_bf16_groups_rows(const float* x, int64_t M, int64_t ldx, const Rows& Wg, int64_t K, int64_t n0,
                                   int64_t n1, float* y, int64_t ldy) {
  switch (M) {
    case 2: block_bf16_groups_rows<2>(x, ldx, Wg, K, n0, n1, y, ldy); break;
    case 3: block_bf16_groups_rows<3>(x, ldx, Wg, K, n0, n1, y, ldy); break;
    case 4: block_bf16_groups_rows<4>(x, ldx, Wg, K, n0, n1, y, ldy); break;
    case 5: block_bf16_groups_rows<5>(x, ldx, Wg, K, n0, n1, y, ldy); break;
    case 6: block_bf16_groups_rows<6>(x, ldx, Wg, K, n0, n1, y, ldy); break;
    case 7: block_bf16_groups_rows<7>(x, ldx, Wg, K, n0, n1, y, ldy); break;
    default: block_bf16_groups_rows<8>(x, ldx, Wg, K, n0, n1, y, ldy); break;
  }
}

// Rows [0, M) of x (M <= 8) times weight rows [n0, n1) of W (format T) -> y[:, n0:n1]; with 5-8
// rows x is taken in chunks of K that stay in L1, as in `block`.
template <class T>
inline void block_fmt(const float* x, int64_t M, int64_t ldx, const Rows& W, int64_t K, int64_t n0, int64_t n1,
                      float* y, int64_t ldy) {
  const int64_t KC = M <= 2 ? K : 1024;
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = std::min(K, k0 + KC);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* w = W.row(n);
      float* yn = y + n;
      const bool acc = k0 > 0;
      switch (M) {
        case 1: dot_row_fmt<1, T>(x, ldx, w, k0, k1, yn, ldy, acc); break;
        case 2: dot_row_fmt<2, T>(x, ldx, w, k0, k1, yn, ldy, acc); break;
        case 3: dot_row_fmt<3, T>(x, ldx, w, k0, k1, yn, ldy, acc); break;
        case 4: dot_row_fmt<4, T>(x, ldx, w, k0, k1, yn, ldy, acc); break;
        case 5: dot_row_fmt<5, T>(x, ldx, w, k0, k1, yn, ldy, acc); break;
        case 6: dot_row_fmt<6, T>(x, ldx, w, k0, k1, yn, ldy, acc); break;
        case 7: dot_row_fmt<7, T>(x, ldx, w, k0, k1, yn, ldy, acc); break;
        default: dot_row_fmt<8, T>(x, ldx, w, k0, k1, yn, ldy, acc); break;
      }
    }
  }
}

}  // namespace qwen35

#include "int8_dot.h"

namespace qwen35 {

// `block` for a weight of any format: the one entry point of the product kernels. Q8_0 / Q4_0
// weights take the int8-activation dot products (int8_dot.h) when they are on.
inline void block(const float* x, int64_t M, int64_t ldx, const Rows& W, int64_t K, int64_t n0, int64_t n1, float* y,
                  int64_t ldy) {
  if (int8_path(W)) {
    thread_local QuantizedX xq;
    quantize_x(x, M, ldx, K, xq);
    block_i8(xq, M, W, n0, n1, y, ldy);
    return;
  }
  if (pairs_path(W, M)) {
    thread_local std::vector<float> xp;
    xp.resize(K);
    pairs_order(x, K, xp.data());
    block_pairs(xp.data(), W, K, n0, n1, y);
    return;
  }
#if QWEN35_ROW_PAIRS
  if (row_pairs_path(W, M)) {
    if (W.fmt == F32)
      block_row_pairs<TraitsF32>(x, M, ldx, W, K, n0, n1, y, ldy);
    else
      block_row_pairs<TraitsBF16>(x, M, ldx, W, K, n0, n1, y, ldy);
    return;
  }
#endif
  switch (W.fmt) {
    case F32: block(x, M, ldx, W.f32(), K, n0, n1, y, ldy); break;
    case BF16: block_fmt<TraitsBF16>(x, M, ldx, W, K, n0, n1, y, ldy); break;
    case BF16_G8: block_bf16_groups_rows(x, M, ldx, W, K, n0, n1, y, ldy); break;  // M >= 2 (pairs_path: 1)
    case Q4_K: block_fmt<TraitsQ4_K>(x, M, ldx, W, K, n0, n1, y, ldy); break;  // K-quants: float32 activations
    case Q5_K: block_fmt<TraitsQ5_K>(x, M, ldx, W, K, n0, n1, y, ldy); break;
    case Q6_K: block_fmt<TraitsQ6_K>(x, M, ldx, W, K, n0, n1, y, ldy); break;
    default: {  // Q8_0 / Q4_0 with float32 activations (off by default): each group of 8 rows in float32 first
      thread_local std::vector<float> rows;
      rows.resize(RG * K);
      for (int64_t n = n0; n < n1; n += RG) {
        to_float(W.from(n), RG, K, rows.data());
        block(x, M, ldx, rows.data(), K, 0, RG, y + n, ldy);
      }
    }
  }
}

// Panel copies for 5-8 rows (kernels.panels in Python): W [N, K] as consecutive panels of PANEL
// output rows (the last one 16 or 32 when N % 48 != 0), each stored k-major: panel p holds
// W[p*48 + j, k] at p*48*K + k*width + j. With 5-8 rows of x the row-major products above are
// compute-bound (each weight vector costs 8 loads of x); here every weight float is loaded once
// into a vector and multiplied by broadcast x values, R x NV accumulators in registers, one
// sequential stream per panel.
constexpr int64_t PANEL = 48;

// The panel copy of a bf16 weight is in bf16 too (half the bytes; converted in registers, exact).
inline vec panel_load(const float* w) { return load(w); }
inline vec panel_load(const uint16_t* w) { return cvt_bf16(reinterpret_cast<const uint8_t*>(w)); }

// y[r * ldy + j] = sum_k xt[k * 8 + r] w[k * V NV + j] for r < R, j < V NV: one panel (E: float or
// uint16_t, bf16 bits).
template <int R, int NV, class E>
inline void panel_rows(const float* xt, const E* w, int64_t K, float* y, int64_t ldy) {
  vec a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) a[r][v] = vec{};
  for (int64_t k = 0; k < K; ++k, w += NV * V) {
    vec wv[NV];
    for (int v = 0; v < NV; ++v) {
      prefetch_ahead<R>(w + v * V, PREFETCH_F32_BYTES);  // every line (bf16: every half line)
      wv[v] = panel_load(w + v * V);
    }
    for (int r = 0; r < R; ++r) {
      const float xs = xt[k * 8 + r];
      for (int v = 0; v < NV; ++v) a[r][v] += xs * wv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) store(y + r * ldy + v * V, a[r][v]);
}

template <int R, class E>
inline void panel_rows(const float* xt, const E* w, int64_t K, int64_t width, float* y, int64_t ldy) {
  switch (width) {  // 16, 32 or PANEL = 48 columns
    case 16: panel_rows<R, 16 / V>(xt, w, K, y, ldy); break;
    case 32: panel_rows<R, 32 / V>(xt, w, K, y, ldy); break;
    default: panel_rows<R, 48 / V>(xt, w, K, y, ldy); break;
  }
}

// Rows [0, M) (5 <= M <= 8) of x, given transposed as xt [K, 8], times panels [p0, p1) of a panel
// copy of W [N, K] (float32, or bf16 bits) -> y[:, p0*48 : p1*48] (row stride ldy).
template <class E>
inline void panel_block(const float* xt, int64_t M, const E* panels, int64_t K, int64_t N, int64_t p0,
                        int64_t p1, float* y, int64_t ldy) {
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n = p * PANEL, width = std::min(PANEL, N - n);
    const E* w = panels + n * K;
    switch (M) {
      case 5: panel_rows<5>(xt, w, K, width, y + n, ldy); break;
      case 6: panel_rows<6>(xt, w, K, width, y + n, ldy); break;
      case 7: panel_rows<7>(xt, w, K, width, y + n, ldy); break;
      default: panel_rows<8>(xt, w, K, width, y + n, ldy); break;
    }
  }
}

// That `panels` can be the panel copy of `weight` (format fmt, N rows): float32 for a float32
// weight, bf16 for a bf16 one of either layout (kernels.panels in Python makes them).
inline void check_panels(Fmt fmt, const at::Tensor& weight, const at::Tensor& panels, int64_t N) {
  TORCH_CHECK(fmt == F32 || fmt == BF16 || fmt == BF16_G8, "panel copies are of float32 and bf16 weights only");
  TORCH_CHECK(panels.device().is_cpu() && panels.is_contiguous() &&
                  panels.scalar_type() == (fmt == F32 ? at::kFloat : at::kBFloat16),
              "panels must be a contiguous CPU tensor: float32 for a float32 weight, bf16 for a bf16 one");
  TORCH_CHECK(panels.numel() == weight.numel() && N % V == 0, "panels must be a panel copy of the weight");
}

// The same for a panel copy in the format of its weight (F32, or BF16 for bf16 weights of either layout).
inline void panel_block(const float* xt, int64_t M, Fmt fmt, const void* panels, int64_t K, int64_t N, int64_t p0,
                        int64_t p1, float* y, int64_t ldy) {
  if (fmt == BF16 || fmt == BF16_G8)
    panel_block(xt, M, static_cast<const uint16_t*>(panels), K, N, p0, p1, y, ldy);
  else
    panel_block(xt, M, static_cast<const float*>(panels), K, N, p0, p1, y, ldy);
}

// Weight floats per parallel task (~64 KiB; 32 and 64 Ki floats measured the same).
constexpr int64_t TASK_FLOATS = 16384;
inline int64_t rows_per_task(int64_t K) { return std::max<int64_t>(4, TASK_FLOATS / std::max<int64_t>(K, 1)); }

// One weight matrix of a product list: x [M, K] (row stride ldx) times W [N, K] (any format) -> y
// [M, N]; with `panels` (a panel copy of a float32 or bf16 W, in W's format, or null) and 5-8 rows,
// through the panels.
struct Product {
  const float* x;
  int64_t M, ldx;
  Rows W;
  int64_t N, K;
  float* y;
  const void* panels = nullptr;
  bool by_panels() const { return panels && M >= 5; }
};

// Weight rows per task: blocks of rows, or of whole panels.
inline int64_t task_rows(const Product& p) {
  if (p.by_panels()) return std::max<int64_t>(1, rows_per_task(p.K) / PANEL) * PANEL;
  // Q8_0 / Q4_0: whole groups, at least 4 a task (with 2 at K = 1024 a [248320 x 1024] Q4_0 product
  // ran 44 G weights/s, with 4 60-65: the probe's rate)
  if (grouped(p.W.fmt)) return std::max<int64_t>(4 * RG, (rows_per_task(p.K) + RG - 1) / RG * RG);
  return rows_per_task(p.K);
}

// fn(t) for t in [0, n) on all threads: each thread takes the tasks of its own contiguous share in
// order (one stream per thread, as a static split), then helps with what is left of the others'
// shares (one atomic increment per task). A static split waits at its end for the slowest thread,
// and on a small VM one thread often runs late (a descheduled vCPU, the other core's extra work).
// Which thread computes a task changes nothing in the result.
template <class F>
inline void parallel_tasks(int64_t n, const F& fn) {
  if (n <= 0) return;
  struct alignas(64) Share {
    std::atomic<int64_t> next;
    int64_t end;
  };
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  Share local[8];  // on the stack: a malloc right after a weight stream runs cache-cold (see run_products)
  std::unique_ptr<Share[]> more(T > 8 ? new Share[T] : nullptr);
  Share* shares = T > 8 ? more.get() : local;
  for (int64_t t = 0; t < T; ++t) shares[t].next.store(n * t / T), shares[t].end = n * (t + 1) / T;
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t) {  // one index per thread (all of them when serial)
    for (int64_t h = 0; h < T; ++h) {
      Share& share = shares[(t0 + h) % T];
      for (int64_t t = share.next++; t < share.end; t = share.next++) fn(t);
    }
  });
}

// All products in one parallel region: each is cut into blocks of weight rows, and the blocks of
// all products are shared among the threads (one fork/join instead of one per product). The x
// copies it makes (transposed, quantized, in pairs order) live in the calling thread's buffers,
// kept from call to call: a decode step makes ~100 of these calls, each right after a weight stream
// has flushed the caches, where every malloc and free touches cold memory.
inline void run_products(const Product* products, size_t count) {
  struct Buffers {
    std::vector<int64_t> first;  // first task of each product
    std::vector<std::vector<float>> xt;  // x transposed [K, 8] for the panel products
    std::vector<QuantizedX> xq;  // x in Q8_0 blocks for the int8-activation products
    std::vector<std::vector<float>> xp;  // x in pairs order for the bf16 pairs products
  };
  thread_local Buffers buffers;
  Buffers& b = buffers;  // the calling thread's (the tasks below run on other threads too)
  b.first.assign(1, 0);
  if (b.xq.size() < count) b.xt.resize(count), b.xq.resize(count), b.xp.resize(count);
  for (size_t i = 0; i < count; ++i) {
    const Product& p = products[i];
    b.first.push_back(b.first.back() + (p.N + task_rows(p) - 1) / task_rows(p));
    if (int8_path(p.W)) quantize_x(p.x, p.M, p.ldx, p.K, b.xq[i]);
    if (pairs_path(p.W, p.M)) b.xp[i].resize(p.K), pairs_order(p.x, p.K, b.xp[i].data());
    if (!p.by_panels()) continue;
    b.xt[i].assign(p.K * 8, 0.f);
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t k = 0; k < p.K; ++k) b.xt[i][k * 8 + m] = p.x[m * p.ldx + k];
  }
  const int64_t* first = b.first.data();
  parallel_tasks(b.first[count], [&](int64_t t) {
    const int64_t i = std::upper_bound(first, first + count + 1, t) - first - 1;
    const Product& p = products[i];
    const int64_t step = task_rows(p), n0 = (t - first[i]) * step, n1 = std::min(p.N, n0 + step);
    if (p.by_panels())
      panel_block(b.xt[i].data(), p.M, p.W.fmt, p.panels, p.K, p.N, n0 / PANEL, (n1 + PANEL - 1) / PANEL, p.y, p.N);
    else if (int8_path(p.W))
      block_i8(b.xq[i], p.M, p.W, n0, n1, p.y, p.N);
    else if (pairs_path(p.W, p.M))
      block_pairs(b.xp[i].data(), p.W, p.K, n0, n1, p.y);
    else
      block(p.x, p.M, p.ldx, p.W, p.K, n0, n1, p.y, p.N);
  });
}

inline void run_products(const std::vector<Product>& products) { run_products(products.data(), products.size()); }

inline void check(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// A decode step's cache positions pos [B] (int64) and key mask keep [B, keys] (bool, or empty: no mask).
inline void check_positions(const at::Tensor& pos, const at::Tensor& keep, int64_t B, const char* who) {
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.dim() == 1 && pos.size(0) == B && pos.is_contiguous(), who,
              ": pos must be int64 [B]");
  TORCH_CHECK(!keep.numel() || (keep.scalar_type() == at::kBool && keep.is_contiguous() && keep.dim() == 2 &&
                                keep.size(0) == B),
              who, ": keep must be a contiguous bool [B, keys] tensor or empty");
}

// Which cache a position check is about, for its errors: `who`, and the layer when there is one
// (written only when a check fails: the decode step makes no string per step).
struct CacheName {
  const char* who;
  int64_t layer = -1;
};
inline std::ostream& operator<<(std::ostream& os, const CacheName& c) {
  os << c.who;
  if (c.layer >= 0) os << ": layer " << c.layer;
  return os;
}

// The last of B positions, each checked to lie in a cache of L keys, with the key mask (when given:
// keep_keys keys a row) checked to cover keys [0, last]. The decode step checks every layer's cache
// before any layer steps; attention_token_into checks its own.
inline int64_t last_position(const int64_t* pos, int64_t B, int64_t L, const bool* keep, int64_t keep_keys,
                             const CacheName& name) {
  int64_t last = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(pos[b] >= 0 && pos[b] < L, name, ": position ", pos[b], " outside the cache of ", L);
    last = std::max(last, pos[b]);
  }
  TORCH_CHECK(!keep || keep_keys == last + 1, name, ": the key mask must cover ", last + 1, " keys, not ", keep_keys);
  return last;
}

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// One row of an RMS norm: y = x / rms(x) * (offset + w) over D floats.
inline void rms_norm_row(const float* x, const float* w, float eps, float offset, int64_t D, float* y) {
  float ss = 0.f;
  for (int64_t i = 0; i < D; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / float(D) + eps);
  for (int64_t i = 0; i < D; ++i) y[i] = x[i] * inv * (offset + w[i]);
}
inline float silu(float x) { return x / (1.f + std::exp(-x)); }

// exp of W floats at once (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r,
// times 2^n through the exponent bits; ~1 ulp), the arguments clamped to [-87.3, 88], where float32
// stays finite and normal. std::exp one value at a time costs more than the arithmetic around it
// (SiLU in the decode kernels; the softmax of decode attention, through exp_nonpositive).
typedef int32_t wvec_i32 __attribute__((vector_size(W * sizeof(int32_t))));
inline vec vexp(vec x) {
  x = x > 88.f ? vec{} + 88.f : x;
  x = x < -87.3f ? vec{} - 87.3f : x;
  const vec magic = vec{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const vec t = x * 1.44269504088896341f + magic;
  const vec n = t - magic;
  vec r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vec p = vec{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  return p * (vec)(((wvec_i32)t - (wvec_i32)magic + 127) << 23);  // 2^n (vector casts keep the bits)
}

// out[i] = silu(g[i]) * (u ? u[i] : 1) for i < n (out may be g): SwiGLU's product, or SiLU alone.
inline void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + V <= n; i += V) {
    const vec x = load(g + i);
    vec y = x / (vexp(-x) + 1.f);
    if (u) y *= load(u + i);
    store(out + i, y);
  }
  for (; i < n; ++i) out[i] = silu(g[i]) * (u ? u[i] : 1.f);
}

}  // namespace qwen35
