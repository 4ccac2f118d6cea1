// Prefill products of K-quant weights (Q4_K, Q5_K, Q6_K) with 8 or more rows of x on AVX-512 VNNI
// builds: 16 weight rows by up to 8 rows of x in 512-bit registers, as int8_dot.h's tiles do for
// Q8_0 / Q4_0. The rows stay in the file's layout; each task first unpacks its 16 rows into a panel
// (L2-sized, reused by every row of x), block by block (decode batches keep kquant_dot.h: there a
// panel costs more than 8 rows of x gain from it, B8 0.6x):
//   q     8 chunks of 64 bytes, chunk c holding weights 4c..4c+3 of each of the 16 rows (lane l: row l)
//   s0    16 floats: the scale of the block's first 16 weights (d sc; Q4_K / Q5_K: of all 32)
//   s1    16 floats: Q6_K: the scale of its last 16 weights; Q4_K / Q5_K: the min (dmin m)
//   w16   32 int32: Q6_K only, -128 times the sum of each half's quants (q - 32)
// With x in Q8_0 blocks (dx, quants xq, their sum S):
//   Q4_K, Q5_K  y = sum_b dx_b (s0 (q . xq) - s1 S_b)            q in 0..31, xq signed: vpdpbusd
//   Q6_K        y = sum_b dx_b sum_h s_h ((q - 32) . xq)_h       xq + 128 unsigned, q - 32 signed:
//                                                                 vpdpbusd less 128 sum(q - 32)
// The same integer block dots as kquant_dot.h (decode) and the same float factors (s dx); the float
// sums run in another order, so rows agree with decode's to float32 rounding, not bit for bit.
#pragma once

namespace qwen35 {

#if QWEN35_VNNI && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QWEN35_KQUANT_TILES 1
constexpr int64_t KQ_LANES = 16;
constexpr int KQ_TILE_ROWS = 8;  // rows of x a tile holds in registers
constexpr int64_t KQ_BLOCK = 8 * 64 + 64 + 64 + 128;  // a panel block: q, s0, s1, w16
constexpr int64_t KQ_MIN_ROWS = 8;  // fewer rows of x take kquant_dot.h (the unpacking would not pay)

inline __m512i kq_x_quad(const int8_t* p) {  // 4 quants of x in every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Rows [n, n + 16) of W (K inputs) -> panel (K / 32 blocks of KQ_BLOCK bytes).
template <class T>
inline void kquant_panel(const Rows& W, int64_t n, int64_t K, uint8_t* panel) {
  constexpr bool six = !T::has_min;
  const int64_t nb = K / QK;
  for (int64_t l = 0; l < KQ_LANES; ++l) {
    const uint8_t* row = W.row(n + l);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = row + b / 8 * T::super_bytes;
      const int j = int(b % 8);
      alignas(32) int8_t q[QK];
      _mm256_store_si256(reinterpret_cast<__m256i*>(q), T::quants(p, j));  // Q6_K: q - 32
      uint8_t* blk = panel + b * KQ_BLOCK;
      for (int c = 0; c < 8; ++c) std::memcpy(blk + c * 64 + l * 4, q + 4 * c, 4);
      float d0, d1, m;
      T::block_scales(p, j, d0, d1, m);
      float* s = reinterpret_cast<float*>(blk + 512);
      s[l] = d0;
      s[16 + l] = six ? d1 : m;
      if constexpr (six) {
        int32_t* w16 = reinterpret_cast<int32_t*>(blk + 640);
        int32_t lo = 0, hi = 0;
        for (int i = 0; i < 16; ++i) lo += q[i], hi += q[16 + i];
        w16[l] = -128 * lo, w16[16 + l] = -128 * hi;
      }
    }
  }
}

// y[r * ldy + l] = weight row l of the panel . x[r0 + r], r < R.
template <class T, int R>
inline void kquant_tile(const QuantizedX& x, int64_t r0, const uint8_t* panel, float* y, int64_t ldy) {
  constexpr bool six = !T::has_min;
  const int64_t K = x.K, nb = K / QK;
  const int8_t* xq = x.q.data() + r0 * K;
  const float* xd = x.d.data() + r0 * nb;
  const int32_t* xs = x.sum8.data() + r0 * nb;
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  __m512 acc[R], low[R];
  for (int r = 0; r < R; ++r) acc[r] = low[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = panel + b * KQ_BLOCK;
    const float* s = reinterpret_cast<const float*>(blk + 512);
    const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
    const int8_t* xb = xq + b * QK;
    for (int h = 0; h < (six ? 2 : 1); ++h) {  // Q6_K: each half with its scale
      __m512i dot[R];
      const __m512i init = six ? _mm512_loadu_si512(blk + 640 + 64 * h) : _mm512_setzero_si512();
      for (int r = 0; r < R; ++r) dot[r] = init;
      constexpr int chunks = six ? 4 : 8;
#pragma GCC unroll 8
      for (int c = h * chunks; c < (h + 1) * chunks; ++c) {
        const __m512i w = _mm512_loadu_si512(blk + 64 * c);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512i xv = kq_x_quad(xb + r * K + 4 * c);
          dot[r] = six ? _mm512_dpbusd_epi32(dot[r], _mm512_xor_si512(xv, flip), w) : _mm512_dpbusd_epi32(dot[r], w, xv);
        }
      }
      const __m512 scale = six && h == 1 ? s1 : s0;
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(scale, _mm512_set1_ps(xd[r * nb + b])), acc[r]);
    }
    if constexpr (!six)  // the mins: dmin m times sum(xq) dx (sum8 holds 8 sum(xq))
      for (int r = 0; r < R; ++r)
        low[r] = _mm512_fmadd_ps(s1, _mm512_set1_ps(xd[r * nb + b] * float(xs[r * nb + b])), low[r]);
  }
  for (int r = 0; r < R; ++r)
    _mm512_storeu_ps(y + r * ldy, six ? acc[r] : _mm512_fnmadd_ps(low[r], _mm512_set1_ps(0.125f), acc[r]));
}

template <class T>
inline void kquant_tiles(const QuantizedX& x, int64_t M, const Rows& W, int64_t n0, int64_t n1, float* y,
                         int64_t ldy, int64_t x0) {
  thread_local std::vector<uint8_t> panel;
  panel.resize(x.K / QK * KQ_BLOCK);
  for (int64_t n = n0; n < n1; n += KQ_LANES) {
    kquant_panel<T>(W, n, x.K, panel.data());
    for (int64_t r0 = 0; r0 < M; r0 += KQ_TILE_ROWS) {
      float* yr = y + r0 * ldy + n;
      switch (std::min<int64_t>(KQ_TILE_ROWS, M - r0)) {
        case 1: kquant_tile<T, 1>(x, x0 + r0, panel.data(), yr, ldy); break;
        case 2: kquant_tile<T, 2>(x, x0 + r0, panel.data(), yr, ldy); break;
        case 3: kquant_tile<T, 3>(x, x0 + r0, panel.data(), yr, ldy); break;
        case 4: kquant_tile<T, 4>(x, x0 + r0, panel.data(), yr, ldy); break;
        case 5: kquant_tile<T, 5>(x, x0 + r0, panel.data(), yr, ldy); break;
        case 6: kquant_tile<T, 6>(x, x0 + r0, panel.data(), yr, ldy); break;
        case 7: kquant_tile<T, 7>(x, x0 + r0, panel.data(), yr, ldy); break;
        default: kquant_tile<T, 8>(x, x0 + r0, panel.data(), yr, ldy); break;
      }
    }
  }
}

// Rows [0, M) of x (its rows [x0, x0 + M)) times weight rows [n0, n1) of a K-quant W, in whole panels
// of 16 rows when there are at least KQ_MIN_ROWS rows of x; returns the first weight row left for
// kquant_dot.h (n1 when none).
inline int64_t kquant_panels(const QuantizedX& x, int64_t M, const Rows& W, int64_t n0, int64_t n1, float* y,
                             int64_t ldy, int64_t x0 = 0) {
  const int64_t end = n0 + (n1 - n0) / KQ_LANES * KQ_LANES;
  if (M < KQ_MIN_ROWS || end == n0) return n0;
  switch (W.fmt) {
    case Q4_K: kquant_tiles<TraitsQ4_K>(x, M, W, n0, end, y, ldy, x0); break;
    case Q5_K: kquant_tiles<TraitsQ5_K>(x, M, W, n0, end, y, ldy, x0); break;
    default: kquant_tiles<TraitsQ6_K>(x, M, W, n0, end, y, ldy, x0); break;
  }
  return end;
}
#endif

}  // namespace qwen35
