// Decode products of GGUF K-quant rows (Q4_K, Q5_K, Q6_K, rows as in the file; formats.h) with the
// activations in Q8_0 blocks (QuantizedX), as int8_dot.h's for Q8_0 / Q4_0: per block of 32 weights
// the exact integer dots of the quants with x's (vpmaddubsw + vpmaddwd, or vpdpbusd), scaled in
// float32 by the block's scales and x's:
//   Q4_K, Q5_K  y = sum_b dx_b ((d sc_b) (q . xq) - (dmin m_b) sum(xq))
//   Q6_K        y = sum_b dx_b sum_h (d sc_bh) ((q - 32) . xq over half h of the block)
// The error is that of rounding x to Q8_0, as for Q8_0 / Q4_0. Included by int8_dot.h (AVX2 builds).
#pragma once

namespace qwen35 {

// int32 lane i: the sum of products 4i..4i+3 of the unsigned bytes u and the signed bytes s (u <= 64:
// vpmaddubsw's int16 pair sums cannot saturate).
inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#if QWEN35_VNNI
  return dpbusd(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float hsum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

inline __m256 bytes_to_floats(const uint8_t* p) {  // 8 unsigned bytes
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// The integer dots of a block's quants q (formats.h: T::quants) with 32 of x's quants: 8 int32 lanes
// of 4 weights each. Q6_K's q - 32 are signed: |q| times xq with q's sign (vpmaddubsw's unsigned operand).
template <class T>
inline __m256i block_dot(__m256i q, __m256i xq) {
  if constexpr (T::has_min) return dot_u8_s8(q, xq);
  return dot_u8_s8(_mm256_abs_epi8(q), _mm256_sign_epi8(xq, q));
}

// Q4_K / Q5_K: a super-block's 8 scales d sc and 8 mins dmin m.
inline void k4_scales(const uint8_t* p, __m256& sc, __m256& mins) {
  alignas(16) uint8_t sm[16];
  scales_mins_k4(p + 4, sm);  // formats.h
  sc = _mm256_mul_ps(bytes_to_floats(sm), _mm256_set1_ps(half_to_float(p)));
  mins = _mm256_mul_ps(bytes_to_floats(sm + 8), _mm256_set1_ps(half_to_float(p + 2)));
}

// Q6_K: a super-block's 16 scales d sc, blocks 0-3's in sc16[0], 4-7's in sc16[1] (two a block).
inline void q6_scales(const uint8_t* p, __m256* sc16) {
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192));
  const __m256 d = _mm256_set1_ps(half_to_float(p + 208));
  sc16[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d);
  sc16[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d);
}

// Q6_K block j's lane scales: lanes 0-3 (its first 16 weights) scale 2j, lanes 4-7 scale 2j + 1.
inline __m256 q6_lanes(const __m256* sc16, int j) {
  const int a = 2 * (j % 4);
  return _mm256_permutevar8x32_ps(sc16[j / 4], _mm256_setr_epi32(a, a, a, a, a + 1, a + 1, a + 1, a + 1));
}

// y[r * ldy] = weight row w . x[r0 + r] for r < R (x's rows in Q8_0 blocks). Per super-block and row
// of x, the 8 blocks' float factors (weight scale times x's) and the mins' share in one vector each;
// per block, one integer dot and one FMA a row.
template <class T, int R>
inline void kquant_dot(const QuantizedX& x, int64_t r0, const uint8_t* w, float* y, int64_t ldy) {
  const int64_t K = x.K, nb = K / QK;
  __m256 acc[R], low[R];
  for (int r = 0; r < R; ++r) acc[r] = low[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < K / QK_K; ++s) {
    const uint8_t* p = w + s * T::super_bytes;
    alignas(32) float f[R][8];  // row r, block j: the factor of its integer dot
    __m256 sc16[2];  // Q6_K's scales
    if constexpr (T::has_min) {
      __m256 sc, mins;
      k4_scales(p, sc, mins);
      for (int r = 0; r < R; ++r) {
        const int64_t xb = (r0 + r) * nb + s * 8;
        const __m256 dx = _mm256_loadu_ps(x.d.data() + xb);
        const __m256i sum8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sum8.data() + xb));
        _mm256_store_ps(f[r], _mm256_mul_ps(sc, dx));
        low[r] = _mm256_fmadd_ps(mins, _mm256_mul_ps(dx, _mm256_cvtepi32_ps(sum8)), low[r]);  // 8 sum(xq)
      }
    } else {
      q6_scales(p, sc16);
      for (int r = 0; r < R; ++r) _mm256_store_ps(f[r], _mm256_loadu_ps(x.d.data() + (r0 + r) * nb + s * 8));
    }
    for (int j = 0; j < 8; ++j) {
      const __m256i q = T::quants(p, j);
      __m256 lanes = _mm256_setzero_ps();
      if constexpr (!T::has_min) lanes = q6_lanes(sc16, j);
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x.q.data() + ((r0 + r) * nb + s * 8 + j) * QK;
        __m256 factor = _mm256_broadcast_ss(&f[r][j]);
        if constexpr (!T::has_min) factor = _mm256_mul_ps(lanes, factor);
        const __m256i dots = block_dot<T>(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), factor, acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = hsum8(acc[r]) - hsum8(low[r]) * 0.125f;  // low holds 8 sum(xq)
}

template <class T>
inline void kquant_rows(const QuantizedX& x, int64_t M, const Rows& W, int64_t n0, int64_t n1, float* y, int64_t ldy,
                        int64_t x0) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r0 = 0; r0 < M; r0 += 4) {
      float* yn = y + r0 * ldy + n;
      switch (std::min<int64_t>(4, M - r0)) {
        case 1: kquant_dot<T, 1>(x, x0 + r0, W.row(n), yn, ldy); break;
        case 2: kquant_dot<T, 2>(x, x0 + r0, W.row(n), yn, ldy); break;
        case 3: kquant_dot<T, 3>(x, x0 + r0, W.row(n), yn, ldy); break;
        default: kquant_dot<T, 4>(x, x0 + r0, W.row(n), yn, ldy); break;
      }
    }
}

}  // namespace qwen35

#include "kquant_tiles.h"

namespace qwen35 {

// Rows [0, M) of quantized x (its rows [x0, x0 + M)) times weight rows [n0, n1) of a K-quant weight, a
// row at a time (decode; prefill takes the panels of kquant_tiles.h first: int8_dot.h, block_i8_rows).
inline void block_kquant_i8(const QuantizedX& x, int64_t M, const Rows& W, int64_t n0, int64_t n1, float* y,
                            int64_t ldy, int64_t x0) {
  switch (W.fmt) {
    case Q4_K: kquant_rows<TraitsQ4_K>(x, M, W, n0, n1, y, ldy, x0); break;
    case Q5_K: kquant_rows<TraitsQ5_K>(x, M, W, n0, n1, y, ldy, x0); break;
    default: kquant_rows<TraitsQ6_K>(x, M, W, n0, n1, y, ldy, x0); break;
  }
}

}  // namespace qwen35
