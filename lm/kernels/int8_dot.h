// Decode products of Q8_0 / Q4_0 weights with the activations quantized to int8 per block of 32
// (GGUF Q8_0, as llama.cpp's vec_dot_q8_0_q8_0 / q4_0_q8_0 take them): the 32 products of a block
// come from one `vpmaddubsw` + `vpmaddwd` instead of four float conversions, scalings and FMAs, which
// made the float path compute-bound at ~20 G weights/s on 2 AVX2 cores. y = sum_b dw_b dx_b (wq . xq)
// in float32. The error this adds is that of rounding x to Q8_0 (at most dx/2 = max|x_block| / 254
// per element): tests/lm/test_formats.py checks the kernel against dequantize(W) @ dequantize(Q8_0(x))
// and states the bound against float32 x. Switch: kernels.set_int8_activations (on by default);
// off, or without AVX2, the products use the float32-activation path of vec.h.
#pragma once

#include <cmath>
#include <type_traits>
#include <vector>

#include "formats.h"

namespace qwen35 {

inline bool& int8_activations() {
  static bool on = true;
  return on;
}

// x rows [M, K] (K % 32 == 0) in Q8_0 blocks: int8 quants and one float scale per block, and per
// block 8 sum(q): Q4_0 weights are w = dw (u - 8) with u in [0, 15], so (u - 8) . q = u . q - 8 sum(q),
// and the unsigned u go into vpmaddubsw as they are (no sign tricks per block).
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sum8;
  int64_t K = 0;
};

#if defined(__AVX2__)
// One block of 32 floats -> its 32 quants, scale and quant sum, as the scalar loop below computes
// them (the same max, scale and products; vcvtps2dq rounds to nearest even, as nearbyint does).
inline int quantize_block(const float* xb, int8_t* q, float& d) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(xb + 8 * j);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  d = _mm_cvtss_f32(h) / 127.f;
  const __m256 id = _mm256_set1_ps(d == 0.f ? 0.f : 1.f / d);
  __m256i i[4];
  for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
  const __m256i t = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  // packing interleaves the 128-bit lanes: groups of 4 quants come out in the order 0 2 4 6 1 3 5 7
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return _mm_cvtsi128_si32(s);
}
#endif

// Rows [m0, m1) of x into out, which holds room for them (quantize_x sizes it); with `rows`, out's
// row m is x's row rows[m] (a gather: prefill experts' tokens).
inline void quantize_x_rows(const float* x, int64_t m0, int64_t m1, int64_t ldx, QuantizedX& out,
                            const int64_t* rows = nullptr) {
  const int64_t K = out.K;
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t b = 0; b < K / QK; ++b) {
      const float* xb = x + (rows ? rows[m] : m) * ldx + b * QK;
      int8_t* q = out.q.data() + m * K + b * QK;
      float d;
#if defined(__AVX2__)
      const int sum = quantize_block(xb, q, d);
#else
      float amax = 0.f;
      for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xb[j]));
      d = amax / 127.f;
      const float id = d == 0.f ? 0.f : 1.f / d;
      int sum = 0;
      for (int j = 0; j < QK; ++j) sum += q[j] = int8_t(std::nearbyint(xb[j] * id));
#endif
      out.d[m * (K / QK) + b] = d;
      out.sum8[m * (K / QK) + b] = 8 * sum;
    }
}

inline void size_quantized_x(int64_t M, int64_t K, QuantizedX& out) {
  out.K = K;
  out.q.resize(M * K);
  out.d.resize(M * K / QK);
  out.sum8.resize(M * K / QK);
}

inline void quantize_x(const float* x, int64_t M, int64_t ldx, int64_t K, QuantizedX& out,
                       const int64_t* rows = nullptr) {
  size_quantized_x(M, K, out);
  quantize_x_rows(x, 0, M, ldx, out, rows);
}

#if defined(__AVX2__)
constexpr bool INT8_DOT = true;

// With VNNI (AVX512-VNNI on 256-bit registers, or AVX-VNNI), one vpdpbusd sums 4 products of an
// unsigned and a signed byte into each int32 lane, in place of AVX2's vpmaddubsw + vpmaddwd + add
// (and Q8_0's two vpsignb, which make vpmaddubsw's operand unsigned: with VNNI the weights are
// biased by 128 instead and 128 sum(x quants) taken off per block). The integer dots are exact
// either way, so both forms give the same y.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QWEN35_VNNI 1
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define QWEN35_VNNI 1
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
#define QWEN35_VNNI 0
#endif
constexpr bool VNNI = QWEN35_VNNI;

// Block b of a Q8_0 / Q4_0 group (format T) in a product of R rows: its address, the lines ahead of
// it prefetched (prefetch_block), and its 8 rows' fp16 scales as floats in *dw.
template <class T, int R>
inline const uint8_t* group_block(const uint8_t* group, int64_t b, __m256* dw) {
  constexpr int64_t GB = group_block_bytes<T>();
  const uint8_t* o = group + b * GB;
  for (int64_t line = 0; line < GB; line += 64) prefetch_block<T, R>(o + line);
  *dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o)));
  return o;
}

// y[r * ldy + j] = row j of a Q8_0 group . x[r0 + r] for r < R, j < 8. Per block: the 8 rows' scales
// in one conversion; for each chunk c, the quants of the 8 rows' bytes 4c..4c+3 (one 32-bit lane
// per row) against x's quants 4c..4c+3 broadcast, as |w| times x with w's sign (vpmaddubsw takes
// one unsigned operand), so that lane j sums row j with no sum across the register. Each chunk's
// int16 pair sums (at most 2 x 127 x 127) go to int32 before the next is added.
template <int R>
inline void dot_group_q8_0(const QuantizedX& x, int64_t r0, const uint8_t* group, float* y, int64_t ldy) {
  const int64_t K = x.K, nb = K / QK;
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256 dw;
    const uint8_t* o = group_block<TraitsQ8_0, R>(group, b, &dw);
    __m256i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
#pragma GCC unroll 2  // fully unrolled, GCC sums each row's 8 chunks as a tree: with 4 rows, 32 live
    for (int c = 0; c < 8; ++c) {  // registers and spills to the stack (1 row: the same speed either way)
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 16 + c * 32));
#if QWEN35_VNNI
      const __m256i biased = _mm256_xor_si256(q, _mm256_set1_epi8(char(0x80)));  // w + 128, unsigned
#else
      const __m256i magnitude = _mm256_sign_epi8(q, q);
#endif
      for (int r = 0; r < R; ++r) {
        int32_t a;
        std::memcpy(&a, x.q.data() + (r0 + r) * K + b * QK + 4 * c, 4);
        const __m256i xa = _mm256_set1_epi32(a);
#if QWEN35_VNNI
        s[r] = dpbusd(s[r], biased, xa);
#else
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xa, q));
        s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(pairs, ones));
#endif
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * nb + b;
#if QWEN35_VNNI
      s[r] = _mm256_sub_epi32(s[r], _mm256_set1_epi32(16 * x.sum8[i]));  // less 128 sum(q) of the bias
#endif
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), _mm256_mul_ps(dw, _mm256_set1_ps(x.d[i])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

// y[r * ldy + j] = row j of a Q4_0 group . x[r0 + r] for r < R, j < 8. Per block: the 8 rows' scales
// in one conversion; for each chunk c, the nibbles of the 8 rows' bytes 4c..4c+3 (one 32-bit lane
// per row) against x's quants 4c..4c+3 and 16+4c..16+4c+3 broadcast, so that lane j sums row j with
// no sum across the register. The int16 sums stay below 8 x 2 x 15 x 127 = 30480.
template <int R>
inline void dot_group_q4_0(const QuantizedX& x, int64_t r0, const uint8_t* group, float* y, int64_t ldy) {
  const int64_t K = x.K, nb = K / QK;
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  const __m256i m4 = _mm256_set1_epi8(15);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256 dw;
    const uint8_t* o = group_block<TraitsQ4_0, R>(group, b, &dw);
    __m256i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
#pragma GCC unroll 2  // as in dot_group_q8_0 (whole int4 steps 1.19x at batch 4, 1.07x at batch 8)
    for (int c = 0; c < 4; ++c) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 16 + c * 32));
      const __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x.q.data() + (r0 + r) * K + b * QK;
        int32_t a, h;
        std::memcpy(&a, xq + 4 * c, 4);
        std::memcpy(&h, xq + 16 + 4 * c, 4);
#if QWEN35_VNNI
        s[r] = dpbusd(dpbusd(s[r], lo, _mm256_set1_epi32(a)), hi, _mm256_set1_epi32(h));
#else
        s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a)));
        s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(h)));
#endif
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * nb + b;
#if QWEN35_VNNI
      const __m256i dot = _mm256_sub_epi32(s[r], _mm256_set1_epi32(x.sum8[i]));  // int32 lanes already
#else
      const __m256i dot = _mm256_sub_epi32(_mm256_madd_epi16(s[r], ones), _mm256_set1_epi32(x.sum8[i]));
#endif
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, _mm256_set1_ps(x.d[i])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

// One row of x against a group in 512-bit registers (QWEN35_GROUP_ZMM, with AVX512-VNNI): two chunks
// a register, lanes 0-7 chunk c's 8 rows and lanes 8-15 chunk c + 1's, x's quants for the two put in
// the matching halves by one permute; each half sums its chunks, and the two halves' int32 sums are
// added before the scaling, so y equals the 256-bit kernels' bit for bit. Half
// the instructions of the 256-bit kernels and two short dependency chains per block.
#if QWEN35_VNNI && defined(__AVX512F__) && defined(__AVX512VNNI__) && QWEN35_GROUP_ZMM
#define QWEN35_ZMM_GROUPS 1
// x's 8 dwords of one block (32 quants) -> a register whose low half holds dword i, its high half dword i + 1.
inline __m512i x_pair(__m512i x8, int i) {
  return _mm512_permutexvar_epi32(
      _mm512_setr_epi32(i, i, i, i, i, i, i, i, i + 1, i + 1, i + 1, i + 1, i + 1, i + 1, i + 1, i + 1), x8);
}

// The int32 sums of a register's two halves (each lane j: row j's two chunks).
inline __m256i halves(__m512i s) { return _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti32x8_epi32(s, 1)); }

// The loop both formats share: per block, the format's int32 dots of the 8 rows (`dot`, from the
// block's quant bytes, x's 32 quants and x's sum8), scaled as in the 256-bit kernels.
template <class T, class Dot>
inline void dot_group_zmm(const QuantizedX& x, int64_t r0, const uint8_t* group, float* y, Dot dot) {
  const int64_t nb = x.K / QK;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256 dw;
    const uint8_t* o = group_block<T, 1>(group, b, &dw);
    const int64_t i = r0 * nb + b;
    const __m512i x8 = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + i * QK)));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot(o + 16, x8, x.sum8[i])), _mm256_mul_ps(dw, _mm256_set1_ps(x.d[i])), acc);
  }
  _mm256_storeu_ps(y, acc);
}

inline void dot_group_q4_0_zmm(const QuantizedX& x, int64_t r0, const uint8_t* group, float* y) {
  dot_group_zmm<TraitsQ4_0>(x, r0, group, y, [](const uint8_t* q, __m512i x8, int32_t sum8) {
    const __m512i m4 = _mm512_set1_epi8(15);
    const __m512i q0 = _mm512_loadu_si512(q), q1 = _mm512_loadu_si512(q + 64);  // chunks 0-1, 2-3
    __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(q0, m4), x_pair(x8, 0));
    __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(q1, m4), x_pair(x8, 2));
    s0 = _mm512_dpbusd_epi32(s0, _mm512_and_si512(_mm512_srli_epi16(q0, 4), m4), x_pair(x8, 4));  // high nibbles:
    s1 = _mm512_dpbusd_epi32(s1, _mm512_and_si512(_mm512_srli_epi16(q1, 4), m4), x_pair(x8, 6));  // quants 16-31
    return _mm256_sub_epi32(halves(_mm512_add_epi32(s0, s1)), _mm256_set1_epi32(sum8));
  });
}

inline void dot_group_q8_0_zmm(const QuantizedX& x, int64_t r0, const uint8_t* group, float* y) {
  dot_group_zmm<TraitsQ8_0>(x, r0, group, y, [](const uint8_t* q, __m512i x8, int32_t sum8) {
    const __m512i bias = _mm512_set1_epi8(char(0x80));
    __m512i s[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int c = 0; c < 8; c += 2)  // w + 128, unsigned, against x; 128 sum(q) taken off below
      s[c / 2 % 2] = _mm512_dpbusd_epi32(s[c / 2 % 2], _mm512_xor_si512(_mm512_loadu_si512(q + c * 32), bias), x_pair(x8, c));
    return _mm256_sub_epi32(halves(_mm512_add_epi32(s[0], s[1])), _mm256_set1_epi32(16 * sum8));
  });
}
#else
#define QWEN35_ZMM_GROUPS 0
#endif

// Rows [0, M) of quantized x times weight rows [n0, n1) of a Q8_0 / Q4_0 weight -> y[:, n0:n1]
// (n0 and n1 multiples of 8, whole groups; x in steps of up to 4 rows, each step reading the group's
// block from L1 again).
template <int R>
inline void dot_group(Fmt f, const QuantizedX& x, int64_t r0, const uint8_t* group, float* y, int64_t ldy) {
#if QWEN35_ZMM_GROUPS
  if constexpr (R == 1) {
    if (f == Q4_0)
      dot_group_q4_0_zmm(x, r0, group, y);
    else
      dot_group_q8_0_zmm(x, r0, group, y);
    return;
  }
#endif
  if (f == Q4_0)
    dot_group_q4_0<R>(x, r0, group, y, ldy);
  else
    dot_group_q8_0<R>(x, r0, group, y, ldy);
}

}  // namespace qwen35

#include "kquant_dot.h"

namespace qwen35 {

// (x's rows [x0, x0 + M): a slice of a QuantizedX holding more rows, e.g. all experts' rows.) K-quant
// weights take kquant_dot.h's kernels, a row at a time.
inline void block_i8(const QuantizedX& x, int64_t M, const Rows& W, int64_t n0, int64_t n1, float* y, int64_t ldy,
                     int64_t x0 = 0) {
  if (kquant(W.fmt)) return block_kquant_i8(x, M, W, n0, n1, y, ldy, x0);
  for (int64_t n = n0; n < n1; n += RG)
    for (int64_t r0 = 0; r0 < M; r0 += 4) {
      const uint8_t* group = W.row(n);
      float* yn = y + r0 * ldy + n;
      switch (std::min<int64_t>(4, M - r0)) {
        case 1: dot_group<1>(W.fmt, x, x0 + r0, group, yn, ldy); break;
        case 2: dot_group<2>(W.fmt, x, x0 + r0, group, yn, ldy); break;
        case 3: dot_group<3>(W.fmt, x, x0 + r0, group, yn, ldy); break;
        default: dot_group<4>(W.fmt, x, x0 + r0, group, yn, ldy); break;
      }
    }
}
#else
constexpr bool INT8_DOT = false;
constexpr bool VNNI = false;
inline void block_i8(const QuantizedX&, int64_t, const Rows&, int64_t, int64_t, float*, int64_t, int64_t = 0) {}
#endif

// Prefill tiles (AVX-512 VNNI builds): 16 weight rows by up to TILE_ROWS rows of x in 512-bit
// registers. Lanes 0-7 hold a chunk of one group's 8 rows and lanes 8-15 the same chunk of the next
// group's, so x's 4 quants of a chunk are one 32-bit broadcast for all 16 weight rows and each
// weight chunk, loaded and unpacked once, serves all the tile's rows of x; the decode kernels above
// reload and unpack it every 4 rows and take half the lanes per instruction. Every (row of x,
// weight row) gets the same exact integer block dots and the same float32 sums, in the same block
// order, as the decode kernels: the same bits.
#if QWEN35_VNNI && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QWEN35_I8_TILES 1
constexpr int TILE_ROWS = 8;

inline __m512i two_groups(const uint8_t* a, const uint8_t* b) {  // 32 bytes of each group, side by side
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

inline __m512i x_quad(const int8_t* p) {  // 4 quants of x in every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// y[r * ldy + j] = weight row j of groups g0 (j < 8) and g1 (j >= 8) . x[r0 + r], r < R.
template <class T, int R>
inline void tile_i8(const QuantizedX& x, int64_t r0, const uint8_t* g0, const uint8_t* g1, float* y, int64_t ldy) {
  constexpr bool q4 = std::is_same_v<T, TraitsQ4_0>;
  constexpr int64_t GB = group_block_bytes<T>();
  const int64_t K = x.K, nb = K / QK;
  const int8_t* xq = x.q.data() + r0 * K;
  const float* xd = x.d.data() + r0 * nb;
  const int32_t* xs = x.sum8.data() + r0 * nb;
  const __m512i m4 = _mm512_set1_epi8(15), bias = _mm512_set1_epi8(char(0x80));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *o0 = g0 + b * GB, *o1 = g1 + b * GB;
    const __m512 dw = _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o0))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(o1)), 1));
    __m512i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
    const int8_t* xb = xq + b * QK;
    if constexpr (q4) {
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512i q = two_groups(o0 + 16 + 32 * c, o1 + 16 + 32 * c);
        const __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          s[r] = _mm512_dpbusd_epi32(s[r], lo, x_quad(xb + r * K + 4 * c));
          s[r] = _mm512_dpbusd_epi32(s[r], hi, x_quad(xb + r * K + 16 + 4 * c));
        }
      }
    } else {
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const __m512i q = _mm512_xor_si512(two_groups(o0 + 16 + 32 * c, o1 + 16 + 32 * c), bias);  // w + 128
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) s[r] = _mm512_dpbusd_epi32(s[r], q, x_quad(xb + r * K + 4 * c));
      }
    }
    for (int r = 0; r < R; ++r) {  // less the bias terms, as in the decode kernels
      const __m512i dot = _mm512_sub_epi32(s[r], _mm512_set1_epi32((q4 ? 1 : 16) * xs[r * nb + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, _mm512_set1_ps(xd[r * nb + b])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

template <class T>
inline void tiles_i8(const QuantizedX& x, int64_t M, const Rows& W, int64_t n, float* y, int64_t ldy, int64_t x0) {
  const uint8_t *g0 = W.row(n), *g1 = W.row(n + RG);
  for (int64_t r0 = 0; r0 < M; r0 += TILE_ROWS) {
    float* yr = y + r0 * ldy + n;
    switch (std::min<int64_t>(TILE_ROWS, M - r0)) {
      case 1: tile_i8<T, 1>(x, x0 + r0, g0, g1, yr, ldy); break;
      case 2: tile_i8<T, 2>(x, x0 + r0, g0, g1, yr, ldy); break;
      case 3: tile_i8<T, 3>(x, x0 + r0, g0, g1, yr, ldy); break;
      case 4: tile_i8<T, 4>(x, x0 + r0, g0, g1, yr, ldy); break;
      case 5: tile_i8<T, 5>(x, x0 + r0, g0, g1, yr, ldy); break;
      case 6: tile_i8<T, 6>(x, x0 + r0, g0, g1, yr, ldy); break;
      case 7: tile_i8<T, 7>(x, x0 + r0, g0, g1, yr, ldy); break;
      default: tile_i8<T, 8>(x, x0 + r0, g0, g1, yr, ldy); break;
    }
  }
}
#else
#define QWEN35_I8_TILES 0
#endif

// Prefill tiles of AVX2 builds without VNNI: 16 weight rows (two groups, a register each) by R rows
// of x (Q8_0: 2, Q4_0: 4), so that each broadcast of x's 4 quants serves both groups and x's rows
// are read from cache half as often as in the decode kernels' 8-row steps. `bench.ab --products` on
// a Zen 3, in turns against those kernels: Q4_0 1.04-1.15x from 16 to 512 rows of x; Q8_0 1.04-1.09x
// at 512 rows but 0.91-0.99x at 16-128 (where x's rows stay in L1 beside one group, and two groups
// crowd them out), so Q8_0 takes the tiles from AVX2_Q8_TILES_FROM rows on. Q8_0 with 4 rows of x
// and Q4_0 with 2 or 3 ran slower in a harness. The integer block dots, their scaling and the float32
// sums come in the decode kernels' order, so every row of y has the same bits.
#if defined(__AVX2__) && !QWEN35_VNNI
#define QWEN35_AVX2_TILES 1
template <class T>
constexpr int avx2_tile_rows() { return std::is_same_v<T, TraitsQ4_0> ? 4 : 2; }
constexpr int64_t AVX2_Q8_TILES_FROM = 256;  // rows of x

// y[r * ldy + j] = weight row j of groups g0 (j < 8) and g1 (8 + j) . x[r0 + r], r < R.
template <class T, int R>
inline void tile_i8_avx2(const QuantizedX& x, int64_t r0, const uint8_t* g0, const uint8_t* g1, float* y, int64_t ldy) {
  constexpr bool q4 = std::is_same_v<T, TraitsQ4_0>;
  constexpr int64_t GB = group_block_bytes<T>();
  const int64_t K = x.K, nb = K / QK;
  const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(15);
  __m256 acc[2 * R];
  for (int i = 0; i < 2 * R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* o[2] = {g0 + b * GB, g1 + b * GB};
    const int8_t* xb = x.q.data() + r0 * K + b * QK;
    __m256i s[2 * R];  // s[2 r + g]: row r of x against group g (Q8_0 int32 lanes, Q4_0 int16 pairs)
    for (int i = 0; i < 2 * R; ++i) s[i] = _mm256_setzero_si256();
    if constexpr (q4) {
#pragma GCC unroll 1
      for (int c = 0; c < 4; ++c) {
        const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o[0] + 16 + 32 * c));
        const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o[1] + 16 + 32 * c));
        const __m256i lo0 = _mm256_and_si256(q0, m4), hi0 = _mm256_and_si256(_mm256_srli_epi16(q0, 4), m4);
        const __m256i lo1 = _mm256_and_si256(q1, m4), hi1 = _mm256_and_si256(_mm256_srli_epi16(q1, 4), m4);
        for (int r = 0; r < R; ++r) {  // at most 8 x 2 x 15 x 127 in an int16 sum, as in dot_group_q4_0
          int32_t a, h;
          std::memcpy(&a, xb + r * K + 4 * c, 4);
          std::memcpy(&h, xb + r * K + 16 + 4 * c, 4);
          const __m256i xa = _mm256_set1_epi32(a), xh = _mm256_set1_epi32(h);
          s[2 * r] = _mm256_add_epi16(s[2 * r], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xa), _mm256_maddubs_epi16(hi0, xh)));
          s[2 * r + 1] = _mm256_add_epi16(s[2 * r + 1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xa), _mm256_maddubs_epi16(hi1, xh)));
        }
      }
    } else {
#pragma GCC unroll 2
      for (int c = 0; c < 8; ++c) {
        __m256i q[2], magnitude[2];
        for (int g = 0; g < 2; ++g) {
          q[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o[g] + 16 + 32 * c));
          magnitude[g] = _mm256_sign_epi8(q[g], q[g]);
        }
        for (int r = 0; r < R; ++r) {
          int32_t a;
          std::memcpy(&a, xb + r * K + 4 * c, 4);
          const __m256i xa = _mm256_set1_epi32(a);
          for (int g = 0; g < 2; ++g)
            s[2 * r + g] = _mm256_add_epi32(
                s[2 * r + g], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[g], _mm256_sign_epi8(xa, q[g])), ones));
        }
      }
    }
    const __m256 dw[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o[0]))),
                          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o[1])))};
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      const __m256 d = _mm256_set1_ps(x.d[i]);
      for (int g = 0; g < 2; ++g) {
        const __m256i dot = q4 ? _mm256_sub_epi32(_mm256_madd_epi16(s[2 * r + g], ones), _mm256_set1_epi32(x.sum8[i]))
                               : s[2 * r + g];
        acc[2 * r + g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw[g], d), acc[2 * r + g]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * ldy, acc[2 * r]);
    _mm256_storeu_ps(y + r * ldy + 8, acc[2 * r + 1]);
  }
}

// Weight rows [n, n + 16) against rows [x0, x0 + M) of x: whole tiles, then the rows left a row at a time.
template <class T>
inline void tiles_i8_avx2(const QuantizedX& x, int64_t M, const Rows& W, int64_t n, float* y, int64_t ldy, int64_t x0) {
  constexpr int R = avx2_tile_rows<T>();
  const uint8_t *g0 = W.row(n), *g1 = W.row(n + RG);
  int64_t r0 = 0;
  for (; r0 + R <= M; r0 += R) tile_i8_avx2<T, R>(x, x0 + r0, g0, g1, y + r0 * ldy + n, ldy);
  for (; r0 < M; ++r0) tile_i8_avx2<T, 1>(x, x0 + r0, g0, g1, y + r0 * ldy + n, ldy);
}
#else
#define QWEN35_AVX2_TILES 0
#endif

// block_i8 for many rows of x (prefill): x's rows in tiles of at most 64 KiB of quants, so that a
// tile stays in L2 while the weight groups of [n0, n1) are read against it (each group from L1 for
// all of the tile's rows); in the 512-bit tiles above where the build has them, else in AVX2's (Q8_0
// from AVX2_Q8_TILES_FROM rows). Each row's y is the same bit for bit as in a product of that row
// alone (K-quant rows in panels, kquant_tiles.h: to float32 rounding).
inline void block_i8_rows(const QuantizedX& x, int64_t M, const Rows& W, int64_t n0, int64_t n1, float* y,
                          int64_t ldy) {
#if QWEN35_KQUANT_TILES
  if (kquant(W.fmt)) n0 = kquant_panels(x, M, W, n0, n1, y, ldy);  // all rows of x at once (kquant_tiles.h)
#endif
  const int64_t tile = std::max<int64_t>(4, (int64_t(64) << 10) / std::max<int64_t>(x.K, 1) / 4 * 4);
  for (int64_t m0 = 0; m0 < M; m0 += tile) {
    const int64_t rows = std::min(tile, M - m0);
    int64_t n = n0;
#if QWEN35_I8_TILES
    for (; !kquant(W.fmt) && n + 2 * RG <= n1; n += 2 * RG) {
      if (W.fmt == Q4_0)
        tiles_i8<TraitsQ4_0>(x, rows, W, n, y + m0 * ldy, ldy, m0);
      else
        tiles_i8<TraitsQ8_0>(x, rows, W, n, y + m0 * ldy, ldy, m0);
    }
#endif
#if QWEN35_AVX2_TILES
    for (; (W.fmt == Q4_0 || (W.fmt == Q8_0 && M >= AVX2_Q8_TILES_FROM)) && n + 2 * RG <= n1; n += 2 * RG) {
      if (W.fmt == Q4_0)
        tiles_i8_avx2<TraitsQ4_0>(x, rows, W, n, y + m0 * ldy, ldy, m0);
      else
        tiles_i8_avx2<TraitsQ8_0>(x, rows, W, n, y + m0 * ldy, ldy, m0);
    }
#endif
    block_i8(x, rows, W, n, n1, y + m0 * ldy, ldy, m0);  // the groups left (all without the tiles)
  }
}

// Whether products with W take the int8-activation path.
inline bool int8_path(const Rows& W) {
  return INT8_DOT && int8_activations() && (W.fmt == Q8_0 || W.fmt == Q4_0 || kquant(W.fmt));
}

}  // namespace qwen35
