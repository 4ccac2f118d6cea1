// Prefill products of K-quant weights (Q4_K, Q5_K, Q6_K) with 8 or more rows of x: KQ_LANES weight
// rows (16 in 512-bit registers on AVX-512 VNNI builds, 8 in 256-bit ones on AVX2) by up to
// KQ_TILE_ROWS rows of x (8 / 4), as int8_dot.h's tiles do for Q8_0 / Q4_0. The rows stay in the
// file's layout; each task first unpacks its weight rows into a panel (L2-sized, reused by every row
// of x), block by block (decode batches keep kquant_dot.h: there a panel costs more than 8 rows of x
// gain from it, B8 0.6x):
//   q     8 chunks of 4 KQ_LANES bytes, chunk c holding weights 4c..4c+3 of each row (lane l: row l)
//   s0    KQ_LANES floats: the scale of the block's first 16 weights (d sc; Q4_K / Q5_K: of all 32)
//   s1    KQ_LANES floats: Q6_K: the scale of its last 16 weights; Q4_K / Q5_K: the min (dmin m)
//   w16   2 KQ_LANES int32: Q6_K only, -128 times the sum of each half's quants (q - 32)
// With x in Q8_0 blocks (dx, quants xq, their sum S):
//   Q4_K, Q5_K  y = sum_b dx_b (s0 (q . xq) - s1 S_b)            q in 0..31, xq signed: vpdpbusd
//   Q6_K        y = sum_b dx_b sum_h s_h ((q - 32) . xq)_h       xq + 128 unsigned, q - 32 signed:
//                                                                 vpdpbusd less 128 sum(q - 32)
// The same integer block dots as kquant_dot.h (decode) and the same float factors (s dx); the float
// sums run in another order, so rows agree with decode's to float32 rounding, not bit for bit.
#pragma once

namespace qwen35 {

#if defined(__AVX2__)
#define QWEN35_KQUANT_TILES 1
#if QWEN35_VNNI && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KQ_WIDE 1
constexpr int64_t KQ_LANES = 16;  // weight rows of a panel: the lanes of a 512-bit register
constexpr int KQ_TILE_ROWS = 8;  // rows of x a tile holds in registers
#else
#define KQ_WIDE 0
constexpr int64_t KQ_LANES = 8;  // 256-bit registers (AVX2, AVX-VNNI)
constexpr int KQ_TILE_ROWS = 4;
#endif
constexpr int64_t KQ_Q = 32 * KQ_LANES;  // a panel block: 8 chunks of quants, then s0, s1, w16
constexpr int64_t KQ_BLOCK = KQ_Q + 16 * KQ_LANES;
constexpr int64_t KQ_MIN_ROWS = 8;  // fewer rows of x take kquant_dot.h (the unpacking would not pay)

inline int32_t kq_x_quad(const int8_t* p) {  // 4 quants of x as one 32-bit word
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Rows [n, n + KQ_LANES) of W (K inputs) -> panel (K / 32 blocks of KQ_BLOCK bytes).
template <class T>
inline void kquant_panel(const Rows& W, int64_t n, int64_t K, uint8_t* panel) {
  constexpr bool six = !T::has_min;
  constexpr int64_t L = KQ_LANES;
  const int64_t nb = K / QK;
  for (int64_t l = 0; l < L; ++l) {
    const uint8_t* row = W.row(n + l);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = row + b / 8 * T::super_bytes;
      const int j = int(b % 8);
      alignas(32) int8_t q[QK];
      _mm256_store_si256(reinterpret_cast<__m256i*>(q), T::quants(p, j));  // Q6_K: q - 32
      uint8_t* blk = panel + b * KQ_BLOCK;
      for (int c = 0; c < 8; ++c) std::memcpy(blk + c * 4 * L + l * 4, q + 4 * c, 4);
      float d0, d1, m;
      T::block_scales(p, j, d0, d1, m);
      float* s = reinterpret_cast<float*>(blk + KQ_Q);
      s[l] = d0;
      s[L + l] = six ? d1 : m;
      if constexpr (six) {
        int32_t* w16 = reinterpret_cast<int32_t*>(blk + KQ_Q + 8 * L);
        int32_t lo = 0, hi = 0;
        for (int i = 0; i < 16; ++i) lo += q[i], hi += q[16 + i];
        w16[l] = -128 * lo, w16[L + l] = -128 * hi;
      }
    }
  }
}

// Rows r0, r0 + 1, ... of quantized x as the tiles read them, and a panel block's parts.
struct TileX {
  const int8_t* q;
  const float* d;
  const int32_t* sum8;
  int64_t K, nb;
  TileX(const QuantizedX& x, int64_t r0)
      : q(x.q.data() + r0 * x.K), d(x.d.data() + r0 * (x.K / QK)), sum8(x.sum8.data() + r0 * (x.K / QK)), K(x.K),
        nb(x.K / QK) {}
  int32_t quad(int r, int64_t b, int c) const { return kq_x_quad(q + r * K + b * QK + 4 * c); }  // 4 quants
  float dx(int r, int64_t b) const { return d[r * nb + b]; }
  float dx_sum8(int r, int64_t b) const { return d[r * nb + b] * float(sum8[r * nb + b]); }  // dx 8 sum(xq)
};
inline const uint8_t* panel_quants(const uint8_t* panel, int64_t b, int c) {  // chunk c
  return panel + b * KQ_BLOCK + c * 4 * KQ_LANES;
}
inline const float* panel_scales(const uint8_t* panel, int64_t b) {  // s0, then s1
  return reinterpret_cast<const float*>(panel + b * KQ_BLOCK + KQ_Q);
}
inline const uint8_t* panel_w16(const uint8_t* panel, int64_t b, int h) {  // half h's
  return panel + b * KQ_BLOCK + KQ_Q + 8 * KQ_LANES + 4 * KQ_LANES * h;
}

// The register width's operations (one set compiled per build): KQ_LANES float / int32 lanes, and
// `dots`, which adds to dot[r] the integer dots of chunks [c0, c1) of panel block b with row r of x
// (Q6_K, `six`: x + 128 as the unsigned operand against q - 32).
#if KQ_WIDE
struct KV {
  using F = __m512;
  using I = __m512i;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static I load_i(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I zero_i() { return _mm512_setzero_si512(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  template <class T, int R, bool six>
  static void dots(const uint8_t* panel, int64_t b, int c0, int c1, const TileX& xt, I* dot) {
    const __m512i flip = _mm512_set1_epi8(char(0x80));
#pragma GCC unroll 8
    for (int c = c0; c < c1; ++c) {
      const __m512i w = load_i(panel_quants(panel, b, c));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_set1_epi32(xt.quad(r, b, c));
        dot[r] = six ? _mm512_dpbusd_epi32(dot[r], _mm512_xor_si512(xv, flip), w)
                     : _mm512_dpbusd_epi32(dot[r], w, xv);
      }
    }
  }
};
#else
// Without VNNI, vpmaddubsw's int16 pair sums add up over G chunks before vpmaddwd widens them
// (|sum| <= 2 G max|q| 255 < 2^15: Q4_K G = 4, Q5_K 2, Q6_K 2 with x + 128 up to 255 and
// |q - 32| <= 32); the same integer dots either way.
struct KV {
  using F = __m256;
  using I = __m256i;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static I load_i(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I zero_i() { return _mm256_setzero_si256(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  template <class T, int R, bool six>
  static void dots(const uint8_t* panel, int64_t b, int c0, int c1, const TileX& xt, I* dot) {
    const __m256i flip = _mm256_set1_epi8(char(0x80));
#if QWEN35_VNNI
#pragma GCC unroll 8
    for (int c = c0; c < c1; ++c) {
      const __m256i w = load_i(panel_quants(panel, b, c));
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_set1_epi32(xt.quad(r, b, c));
        dot[r] = six ? dpbusd(dot[r], _mm256_xor_si256(xv, flip), w) : dpbusd(dot[r], w, xv);
      }
    }
#else
    constexpr int G = std::is_same_v<T, TraitsQ4_K> ? 4 : 2;  // chunks summed in int16
    const __m256i ones = _mm256_set1_epi16(1);
    for (int g = c0; g < c1; g += G) {
      __m256i p16[R];
      for (int r = 0; r < R; ++r) p16[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int c = g; c < g + G; ++c) {
        const __m256i w = load_i(panel_quants(panel, b, c));
        for (int r = 0; r < R; ++r) {
          const __m256i xv = _mm256_set1_epi32(xt.quad(r, b, c));
          p16[r] = _mm256_add_epi16(p16[r], six ? _mm256_maddubs_epi16(_mm256_xor_si256(xv, flip), w)
                                                : _mm256_maddubs_epi16(w, xv));
        }
      }
      for (int r = 0; r < R; ++r) dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(p16[r], ones));
    }
#endif
  }
};
#endif

// y[r * ldy + l] = weight row l of the panel . x[r0 + r], r < R.
template <class T, int R>
inline void kquant_tile(const QuantizedX& x, int64_t r0, const uint8_t* panel, float* y, int64_t ldy) {
  constexpr bool six = !T::has_min;
  const TileX xt(x, r0);
  typename KV::F acc[R], low[R];
  for (int r = 0; r < R; ++r) acc[r] = low[r] = KV::zero();
  for (int64_t b = 0; b < xt.nb; ++b) {
    const typename KV::F s0 = KV::load(panel_scales(panel, b)), s1 = KV::load(panel_scales(panel, b) + KQ_LANES);
    for (int h = 0; h < (six ? 2 : 1); ++h) {  // Q6_K: each half with its scale
      typename KV::I dot[R];
      const typename KV::I init = six ? KV::load_i(panel_w16(panel, b, h)) : KV::zero_i();
      for (int r = 0; r < R; ++r) dot[r] = init;
      constexpr int chunks = six ? 4 : 8;
      KV::template dots<T, R, six>(panel, b, h * chunks, (h + 1) * chunks, xt, dot);
      const typename KV::F scale = six && h == 1 ? s1 : s0;
      for (int r = 0; r < R; ++r) acc[r] = KV::fmadd(KV::cvt(dot[r]), KV::mul(scale, KV::set1(xt.dx(r, b))), acc[r]);
    }
    if constexpr (!six)  // the mins: dmin m times sum(xq) dx (sum8 holds 8 sum(xq))
      for (int r = 0; r < R; ++r) low[r] = KV::fmadd(s1, KV::set1(xt.dx_sum8(r, b)), low[r]);
  }
  for (int r = 0; r < R; ++r) KV::store(y + r * ldy, six ? acc[r] : KV::fnmadd(low[r], KV::set1(0.125f), acc[r]));
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
#if KQ_WIDE
        case 4: kquant_tile<T, 4>(x, x0 + r0, panel.data(), yr, ldy); break;
        case 5: kquant_tile<T, 5>(x, x0 + r0, panel.data(), yr, ldy); break;
        case 6: kquant_tile<T, 6>(x, x0 + r0, panel.data(), yr, ldy); break;
        case 7: kquant_tile<T, 7>(x, x0 + r0, panel.data(), yr, ldy); break;
        default: kquant_tile<T, 8>(x, x0 + r0, panel.data(), yr, ldy); break;
#else
        default: kquant_tile<T, 4>(x, x0 + r0, panel.data(), yr, ldy); break;
#endif
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
