// Weight storage formats: one traits struct per format, read by every product kernel (ggml's
// type_traits in miniature). A weight of any format is a row-major tensor [..., N, row] whose last
// dimension holds one output row of K inputs:
//   F32   float32  [..., N, K]
//   BF16  bfloat16 [..., N, K]                   bf16 -> float32 is exact (a shift)
//   Q8_0  uint8    [..., N, K / 32 * 34]         GGUF Q8_0 blocks: fp16 scale d, 32 int8 q; w = d q
//   Q4_0  uint8    [..., N, K / 32 * 18]         GGUF Q4_0 blocks: fp16 scale d, 16 bytes holding
//                                                q[j] (low nibble) and q[j + 16] (high); w = d (q - 8);
//                                                rows in groups of 8 (N % 8 == 0; see below)
//   BF16_G8 uint16 [..., N, K]                   bf16 bits, rows in groups of 8 as the block formats'
//                                                (K % 32 == 0, N % 8 == 0; see below): one stream
//                                                and one load of x for 8 rows in one-row products
// A weight reaches the kernels with its format's code (`Weight`: the tag its layer holds, lm/formats'
// Format.code); the storage is checked against the tag, never read for a format (rows of Q4_0 and of
// the K-quants can have the same size).
// Each traits struct turns one block of 32 weights into float32 vectors in registers (`load`):
// the products compute in float32 with the dequantized weights, which are exact (an fp16 scale times
// a small integer fits in float32), so a product equals dequantize-then-matmul up to summation order.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <tuple>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace qwen35 {

// Accumulator width of the format kernels: one register (16 floats with AVX-512, else 8), so that
// the chains of up to 8 rows stay in registers on AVX2's 16 ymm registers too.
#if defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float wvec __attribute__((vector_size(W * sizeof(float))));
typedef int8_t wvec_i8 __attribute__((vector_size(W)));
typedef uint8_t wvec_u8 __attribute__((vector_size(W)));
typedef uint16_t wvec_u16 __attribute__((vector_size(W * 2)));
typedef uint32_t wvec_u32 __attribute__((vector_size(W * 4)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));

constexpr int QK = 32;       // weights per block of the block formats
constexpr int NB = QK / W;   // vectors per block

// Software prefetch of a product's weight stream, `ahead` bytes ahead of p, in products of at least
// PREFETCH_ROWS rows of x (R, the rows of the kernel). The -D values in this file come from the CPU's
// tuning profile (lm/kernels/tuning.py), which always writes them; why each: docs/kernel-decisions.md.
#ifndef QWEN35_PREFETCH_ROWS
#error "QWEN35_PREFETCH_ROWS and the other QWEN35_ tuning values come from lm/kernels/tuning.py"
#endif
constexpr int PREFETCH_ROWS = QWEN35_PREFETCH_ROWS;
constexpr int64_t PREFETCH_BYTES = 4096;  // how far ahead the format kernels prefetch a weight row

template <int R>
inline void prefetch_ahead(const void* p, int64_t ahead) {
  if constexpr (R >= PREFETCH_ROWS) __builtin_prefetch(static_cast<const char*>(p) + ahead, 0, 3);
}

enum Fmt : int { F32 = 0, BF16 = 1, Q8_0 = 2, Q4_0 = 3, BF16_G8 = 4, Q4_K = 5, Q5_K = 6, Q6_K = 7 };

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

inline wvec wload(const float* p) {
  wvec v;
  std::memcpy(&v, p, sizeof(wvec));
  return v;
}

// W small integers / bf16 values -> W floats. GCC turns __builtin_convertvector from 8-bit
// lanes into scalar conversions, so x86 gets the widening instructions spelled out.
#if defined(__AVX512F__)
inline wvec from_m(__m512 v) { wvec r; std::memcpy(&r, &v, sizeof(r)); return r; }
inline wvec cvt_i8(__m128i q) { return from_m(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))); }  // 16 lanes
inline wvec cvt_i8(const uint8_t* p) { return cvt_i8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline wvec cvt_bf16(const uint8_t* p) {
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return from_m(_mm512_castsi512_ps(_mm512_slli_epi32(u, 16)));
}
#elif defined(__AVX2__)
inline wvec from_m(__m256 v) { wvec r; std::memcpy(&r, &v, sizeof(r)); return r; }
inline wvec cvt_i8(__m128i q) { return from_m(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))); }  // low 8 lanes
inline wvec cvt_i8(const uint8_t* p) { return cvt_i8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline wvec cvt_bf16(const uint8_t* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return from_m(_mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
}
#else
inline wvec cvt_i8(const uint8_t* p) {
  wvec_i8 q;
  std::memcpy(&q, p, sizeof(q));
  return __builtin_convertvector(q, wvec);
}
inline wvec cvt_bf16(const uint8_t* p) {
  wvec_u16 h;
  std::memcpy(&h, p, sizeof(h));
  const wvec_u32 u = __builtin_convertvector(h, wvec_u32) << 16;
  wvec r;
  std::memcpy(&r, &u, sizeof(r));
  return r;
}
#endif

struct TraitsF32 {
  static constexpr int64_t block_bytes = QK * 4;
  static inline void load(const uint8_t* row, int64_t b, wvec* w) {
    const float* p = reinterpret_cast<const float*>(row) + b * QK;
    for (int j = 0; j < NB; ++j) w[j] = wload(p + j * W);
  }
  static inline float at(const uint8_t* row, int64_t k) { return reinterpret_cast<const float*>(row)[k]; }
};

// How far ahead prefetch_block's L2 rule reaches in bf16 rows (bytes; 0: not prefetched at all).
struct TraitsBF16 {
  static constexpr int64_t block_bytes = QK * 2;
  static constexpr int streamed_rows = 1;  // products of up to this many rows are memory-bound (prefetch_block)
  // how far ahead prefetch_block's L2 rule reaches (bytes, 0: none): QWEN35_BF16_PREFETCH_L2 above
  static constexpr int64_t prefetch_l2_bytes = QWEN35_BF16_PREFETCH_L2;
  static inline void load(const uint8_t* row, int64_t b, wvec* w) {
    const uint8_t* p = row + b * block_bytes;
    for (int j = 0; j < NB; ++j) w[j] = cvt_bf16(p + j * W * 2);
  }
  static inline float at(const uint8_t* row, int64_t k) {
    uint16_t h;
    std::memcpy(&h, row + 2 * k, 2);
    const uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

// bf16 read as pairs (QWEN35_BF16_PAIRS): 2W weights per register, as W 32-bit lanes; the low halves
// shifted up are the even weights, the high halves masked the odd ones (one shift and one and per 2W
// weights instead of two widening loads and two shifts). The products take x in the matching order:
// per 2W inputs, the W even ones, then the W odd ones (pairs_order). Exact, as TraitsBF16.
struct TraitsBF16Pairs : TraitsBF16 {
  static inline void load(const uint8_t* row, int64_t b, wvec* w) {
    const uint8_t* p = row + b * block_bytes;
    for (int j = 0; j < NB; j += 2) {
      wvec_u32 u;
      std::memcpy(&u, p + j * W * 2, sizeof(u));
      const wvec_u32 even = u << 16, odd = u & 0xffff0000u;
      std::memcpy(&w[j], &even, sizeof(wvec));
      std::memcpy(&w[j + 1], &odd, sizeof(wvec));
    }
  }
};

// x [K] in TraitsBF16Pairs' order -> out [K]: per 2W inputs the even ones, then the odd ones; the
// K % 32 tail as it is.
inline void pairs_order(const float* x, int64_t K, float* out) {
  const int64_t K2 = K / QK * QK;
  for (int64_t k = 0; k < K2; k += 2 * W)
    for (int i = 0; i < W; ++i) out[k + i] = x[k + 2 * i], out[k + W + i] = x[k + 2 * i + 1];
  for (int64_t k = K2; k < K; ++k) out[k] = x[k];
}

struct TraitsQ8_0 {
  static constexpr int64_t block_bytes = 2 + QK;
  static constexpr int streamed_rows = 8;
  static constexpr int64_t prefetch_l2_bytes = 2048;  // 4 KiB and more: slower (one-row products, Intel)
  static inline void load(const uint8_t* row, int64_t b, wvec* w) {
    const uint8_t* p = row + b * block_bytes;
    const float d = half_to_float(p);
    for (int j = 0; j < NB; ++j) w[j] = cvt_i8(p + 2 + j * W) * d;
  }
};

struct TraitsQ4_0 {
  static constexpr int64_t block_bytes = 2 + QK / 2;
  static constexpr int streamed_rows = 2;
  static constexpr int64_t prefetch_l2_bytes = 2048;  // 4 KiB and more: slower (one-row products, Intel)
  static inline void load(const uint8_t* row, int64_t b, wvec* w) {
    const uint8_t* p = row + b * block_bytes;
    const float d = half_to_float(p);
#if defined(__AVX2__)
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2)), m = _mm_set1_epi8(15);
    const __m128i eight = _mm_set1_epi8(8);
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, m), eight);  // weights 0-15 of the block, q - 8
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m), eight);  // weights 16-31
#if defined(__AVX512F__)
    w[0] = cvt_i8(lo) * d;
    w[1] = cvt_i8(hi) * d;
#else
    w[0] = cvt_i8(lo) * d;
    w[1] = cvt_i8(_mm_srli_si128(lo, 8)) * d;
    w[2] = cvt_i8(hi) * d;
    w[3] = cvt_i8(_mm_srli_si128(hi, 8)) * d;
#endif
#else
    u8x16 q;
    std::memcpy(&q, p + 2, 16);
    uint8_t v[QK];
    for (int j = 0; j < 16; ++j) v[j] = uint8_t((q[j] & 15) - 8), v[j + 16] = uint8_t((q[j] >> 4) - 8);
    for (int j = 0; j < NB; ++j) w[j] = cvt_i8(v + j * W) * d;
#endif
  }
};

// bf16 rows in groups of 8 (BF16_G8), read one row of a group: `row` is the group's start plus
// 64 bytes per row before it, and the row's blocks of 32 weights lie RG * 64 bytes apart.
struct TraitsBF16G8 : TraitsBF16 {
  static constexpr int64_t block_bytes = 8 * QK * 2;  // the stride of a row's blocks (RG rows a block)
  static inline void load(const uint8_t* row, int64_t b, wvec* w) { TraitsBF16::load(row + b * block_bytes, 0, w); }
};

// GGUF's K-quants, rows as in the file (llama.cpp's block_q4_K / q5_K / q6_K; lm/formats/kquants.py
// states the layouts): super-blocks of 256 weights along K, read here one block of 32 at a time.
// Each weight is a product of small integers and fp16 numbers that fits float32's 24 bits exactly
// ((d sc) q: 11 + 6 + 5 bits at most; Q6_K's (d sc) (q - 32): 11 + 7 + 6), so these floats equal
// ggml's and the gguf package's dequantization bit for bit, fused multiply-subtract or not.
constexpr int64_t QK_K = 256;

#if defined(__AVX2__)
// 32 small integers (int8 lanes of v) -> w[0..NB): lanes 0-15 times d0, lanes 16-31 times d1, minus m.
inline void small_ints(__m256i v, float d0, float d1, float m, wvec* w) {
  const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
#if defined(__AVX512F__)
  w[0] = cvt_i8(lo) * d0 - m;
  w[1] = cvt_i8(hi) * d1 - m;
#else
  w[0] = cvt_i8(lo) * d0 - m;
  w[1] = cvt_i8(_mm_srli_si128(lo, 8)) * d0 - m;
  w[2] = cvt_i8(hi) * d1 - m;
  w[3] = cvt_i8(_mm_srli_si128(hi, 8)) * d1 - m;
#endif
}
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
#endif
inline void small_ints(const int8_t* v, float d0, float d1, float m, wvec* w) {  // the portable twin
  for (int j = 0; j < NB; ++j) w[j] = cvt_i8(reinterpret_cast<const uint8_t*>(v) + j * W) * (j * W < 16 ? d0 : d1) - m;
}

// Q4_K / Q5_K's 12 scale bytes -> 16 bytes: the 8 blocks' 6-bit scales, then their 8 mins. Blocks 0-3
// have both in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); blocks 4-7 their low 4 bits in
// bytes 8-11 (scales low nibble, mins high) and their top 2 bits in the top bits of bytes 0-3 / 4-7.
// Four blocks per 32-bit word.
inline void scales_mins_k4(const uint8_t* s, uint8_t* out) {
  uint32_t u[3], o[4];
  std::memcpy(u, s, 12);
  constexpr uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  o[0] = u[0] & low6;                                         // scales 0-3
  o[1] = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);         // scales 4-7
  o[2] = u[1] & low6;                                         // mins 0-3
  o[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4);  // mins 4-7
  std::memcpy(out, o, 16);
}

// The K-quants' `at` (a tail of K % 32 never occurs: K % 256 == 0): weight k of a row, through load.
template <class T>
inline float kquant_at(const uint8_t* row, int64_t k) {
  wvec w[NB];
  T::load(row, k / QK, w);
  float f[QK];
  std::memcpy(f, w, sizeof(f));
  return f[k % QK];
}

// The K-quants' `load`: block b of a row -> w[0..NB), from the format's quants of block j of a
// super-block (`quants`: 32 small integers) and its scales (`block_scales`: lanes 0-15 times d0,
// 16-31 times d1, minus m). The integer kernels (kquant_dot.h) read the same quants.
template <class T>
inline void kquant_load(const uint8_t* row, int64_t b, wvec* w) {
  const uint8_t* p = row + b / 8 * T::super_bytes;
  const int j = int(b % 8);
  float d0, d1, m;
  T::block_scales(p, j, d0, d1, m);
#if defined(__AVX2__)
  small_ints(T::quants(p, j), d0, d1, m, w);
#else
  int8_t v[QK];
  T::quants(p, j, v);
  small_ints(v, d0, d1, m, w);
#endif
}

#if defined(__AVX2__)
inline __m256i nibbles(__m256i bytes, bool high) {  // the low or the high nibble of each of 32 bytes
  return _mm256_and_si256(high ? _mm256_srli_epi16(bytes, 4) : bytes, _mm256_set1_epi8(15));
}
#endif

// Q4_K, 144 bytes: d, dmin (fp16), 12 scale bytes, 128 bytes of nibbles (bytes 32c..32c+31: block 2c
// in the low nibbles, 2c + 1 in the high). w = (d sc) q - (dmin m).
struct TraitsQ4_K {
  static constexpr int64_t super_bytes = 144;
  static constexpr int64_t block_bytes = super_bytes * QK / QK_K;  // a block's share (prefetch distances)
  static constexpr int streamed_rows = 2;
  static constexpr int64_t prefetch_l2_bytes = 2048;
  static constexpr bool has_min = true;
  static inline void block_scales(const uint8_t* p, int j, float& d0, float& d1, float& m) {
    uint8_t sm[16];
    scales_mins_k4(p + 4, sm);
    d0 = d1 = half_to_float(p) * float(sm[j]), m = half_to_float(p + 2) * float(sm[8 + j]);
  }
#if defined(__AVX2__)
  static inline __m256i quants(const uint8_t* p, int j) { return nibbles(load32(p + 16 + j / 2 * 32), j % 2); }
#else
  static inline void quants(const uint8_t* p, int j, int8_t* v) {
    for (int l = 0; l < QK; ++l) v[l] = int8_t((p[16 + j / 2 * 32 + l] >> (4 * (j % 2))) & 15);
  }
#endif
  static inline void load(const uint8_t* row, int64_t b, wvec* w) { kquant_load<TraitsQ4_K>(row, b, w); }
  static inline float at(const uint8_t* row, int64_t k) { return kquant_at<TraitsQ4_K>(row, k); }
};

// Q5_K, 176 bytes: d, dmin, 12 scale bytes, 32 bytes of fifth bits (bit j of byte l: block j's
// weight l), 128 bytes of nibbles as Q4_K's. w = (d sc) q - (dmin m), q = nibble + 16 fifth bit.
struct TraitsQ5_K : TraitsQ4_K {
  static constexpr int64_t super_bytes = 176;
  static constexpr int64_t block_bytes = super_bytes * QK / QK_K;
#if defined(__AVX2__)
  static inline __m256i quants(const uint8_t* p, int j) {
    const __m256i bit = _mm256_set1_epi8(char(1 << j));
    const __m256i fifth = _mm256_cmpeq_epi8(_mm256_and_si256(load32(p + 16), bit), bit);
    return _mm256_or_si256(nibbles(load32(p + 48 + j / 2 * 32), j % 2), _mm256_and_si256(fifth, _mm256_set1_epi8(16)));
  }
#else
  static inline void quants(const uint8_t* p, int j, int8_t* v) {
    const uint8_t *qh = p + 16, *q = p + 48 + j / 2 * 32;
    for (int l = 0; l < QK; ++l) v[l] = int8_t(((q[l] >> (4 * (j % 2))) & 15) | (((qh[l] >> j) & 1) << 4));
  }
#endif
  static inline void load(const uint8_t* row, int64_t b, wvec* w) { kquant_load<TraitsQ5_K>(row, b, w); }
  static inline float at(const uint8_t* row, int64_t k) { return kquant_at<TraitsQ5_K>(row, k); }
};

// Q6_K, 210 bytes: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16
// weights), d (fp16). In half h (128 weights), block i (0-3) has its low nibbles in bytes
// 64h + 32 (i % 2) + l (the high nibble for i >= 2) and its top bits at bit 2i of byte 128 + 32h + l.
// w = (d sc) (q - 32); `quants` gives q - 32.
struct TraitsQ6_K {
  static constexpr int64_t super_bytes = 210;
  static constexpr int64_t block_bytes = super_bytes * QK / QK_K;
  static constexpr int streamed_rows = 2;
  static constexpr int64_t prefetch_l2_bytes = 2048;
  static constexpr bool has_min = false;
  static inline void block_scales(const uint8_t* p, int j, float& d0, float& d1, float& m) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192) + 2 * j;  // 8 (j / 4) + 2 (j % 4)
    const float d = half_to_float(p + 208);
    d0 = d * float(sc[0]), d1 = d * float(sc[1]), m = 0.f;
  }
#if defined(__AVX2__)
  static inline __m256i quants(const uint8_t* p, int j) {
    const int h = j / 4, i = j % 4;
    const __m256i nib = nibbles(load32(p + 64 * h + 32 * (i % 2)), i >= 2);
    const __m256i top = _mm256_and_si256(_mm256_srl_epi16(load32(p + 128 + 32 * h), _mm_cvtsi32_si128(2 * i)),
                                         _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(nib, _mm256_slli_epi16(top, 4)), _mm256_set1_epi8(32));
  }
#else
  static inline void quants(const uint8_t* p, int j, int8_t* v) {
    const int h = j / 4, i = j % 4;
    const uint8_t *ql = p + 64 * h + 32 * (i % 2), *qh = p + 128 + 32 * h;
    for (int l = 0; l < QK; ++l) v[l] = int8_t((((ql[l] >> (4 * (i / 2))) & 15) | (((qh[l] >> (2 * i)) & 3) << 4)) - 32);
  }
#endif
  static inline void load(const uint8_t* row, int64_t b, wvec* w) { kquant_load<TraitsQ6_K>(row, b, w); }
  static inline float at(const uint8_t* row, int64_t k) { return kquant_at<TraitsQ6_K>(row, k); }
};

inline bool kquant(Fmt f) { return f == Q4_K || f == Q5_K || f == Q6_K; }

// Prefetch for the compact formats' blocks (bf16, Q8_0, Q4_0) in products of R rows. Products that
// are memory-bound (R <= T::streamed_rows) and have at most PREFETCH_L2_ROWS rows prefetch only
// T::prefetch_l2_bytes ahead and into L2, with the hint QWEN35_PREFETCH_L2_HINT (2: prefetcht1, 0:
// prefetchnta, which keeps a stream read once out of L2 and L3); the others as prefetch_ahead. The
// float32 kernels keep their own distance (PREFETCH_F32_BYTES, vec.h).
constexpr int PREFETCH_L2_ROWS = QWEN35_PREFETCH_L2;  // the rule's products have at most this many rows

template <class T, int R>
inline void prefetch_block(const void* p) {
  if constexpr (R <= PREFETCH_L2_ROWS && R <= T::streamed_rows) {
    if constexpr (T::prefetch_l2_bytes > 0) __builtin_prefetch(static_cast<const char*>(p) + T::prefetch_l2_bytes, 0, QWEN35_PREFETCH_L2_HINT);
  } else
    prefetch_ahead<R>(p, PREFETCH_BYTES);
}

// Q8_0 and Q4_0 rows are stored in groups of RG = 8 (lm/formats/blocks.py): block b of a group is
// the 8 rows' fp16 scales, then chunks of 32 bytes (Q8_0: 8, Q4_0: 4), chunk c holding quant bytes
// 4c..4c+3 of row 0, 1, ..., 7: 272 / 144 bytes. A group starts at Rows::row(n) for n % 8 == 0. The
// decode products read it as it is (int8_dot.h); block_of rebuilds one row's GGUF block for the
// other paths. BF16_G8 groups 8 bf16 rows the same way: block b of a group is row 0's weights
// 32b..32b+31, then row 1's, ..., 512 bytes (lm/formats/__init__.py, group_rows).
constexpr int RG = 8;
inline bool grouped(Fmt f) { return f == Q8_0 || f == Q4_0 || f == BF16_G8; }

template <class T>
constexpr int64_t group_block_bytes() { return RG * T::block_bytes; }  // one block of a group

// Row r's GGUF block b of the group at `group` (format T: Q8_0 or Q4_0) -> out [T::block_bytes].
template <class T>
inline void block_of(const uint8_t* group, int64_t b, int r, uint8_t* out) {
  constexpr int chunks = (T::block_bytes - 2) / 4;
  const uint8_t* o = group + b * group_block_bytes<T>();
  std::memcpy(out, o + 2 * r, 2);
  for (int c = 0; c < chunks; ++c) std::memcpy(out + 2 + 4 * c, o + 16 + c * 32 + r * 4, 4);
}

// Bytes of one row of K weights in format f.
inline int64_t row_bytes(Fmt f, int64_t K) {
  switch (f) {
    case F32: return K * 4;
    case BF16:
    case BF16_G8: return K * 2;
    case Q8_0: return K / QK * TraitsQ8_0::block_bytes;
    case Q4_K: return K / QK_K * TraitsQ4_K::super_bytes;
    case Q5_K: return K / QK_K * TraitsQ5_K::super_bytes;
    case Q6_K: return K / QK_K * TraitsQ6_K::super_bytes;
    default: return K / QK * TraitsQ4_0::block_bytes;
  }
}

// A weight's rows in its format: row n starts at data + n * stride bytes.
struct Rows {
  Fmt fmt = F32;
  const uint8_t* data = nullptr;
  int64_t stride = 0;
  const uint8_t* row(int64_t n) const { return data + n * stride; }
  Rows from(int64_t n) const { return {fmt, row(n), stride}; }
  const float* f32() const { return reinterpret_cast<const float*>(data); }
};

// A weight as the Python layers pass it: (storage, format code), the code being the tag the layer
// holds (lm/formats: Format.code, matching Fmt).
using Weight = std::tuple<at::Tensor, int64_t>;
inline const at::Tensor& tensor_of(const Weight& w) { return std::get<0>(w); }

inline const char* format_name(Fmt f) {
  static const char* names[] = {"float32", "bf16", "Q8_0", "Q4_0", "bf16 (rows in groups of 8)", "Q4_K", "Q5_K",
                                "Q6_K"};
  return names[f];
}

// Format `code` for a weight tensor [..., N, row] whose rows hold K inputs, checked against the
// storage that format has (dtype, row size, rows in groups); a clear error naming the weight otherwise.
inline Fmt checked_format(const at::Tensor& w, int64_t code, int64_t K, const char* name) {
  TORCH_CHECK(w.device().is_cpu() && w.is_contiguous() && w.dim() >= 2, name, " must be a contiguous CPU tensor");
  TORCH_CHECK(code >= F32 && code <= Q6_K, name, ": unknown weight format code ", code);
  const Fmt f = static_cast<Fmt>(code);
  static const at::ScalarType dtypes[] = {at::kFloat, at::kBFloat16, at::kByte, at::kByte, at::kUInt16,
                                          at::kByte,  at::kByte,     at::kByte};
  TORCH_CHECK(w.scalar_type() == dtypes[f], name, ": ", format_name(f), " weights are stored as ", dtypes[f],
              ", got ", w.scalar_type());
  TORCH_CHECK(!grouped(f) || K % QK == 0, name, ": ", format_name(f), " needs K % 32 == 0, got K = ", K);
  TORCH_CHECK(!kquant(f) || K % QK_K == 0, name, ": ", format_name(f), " needs K % 256 == 0, got K = ", K);
  const int64_t row = row_bytes(f, K) / static_cast<int64_t>(w.element_size());
  TORCH_CHECK(w.size(-1) == row, name, ": a ", format_name(f), " row of K = ", K, " inputs holds ", row,
              " elements, got ", w.size(-1));
  TORCH_CHECK(!grouped(f) || w.size(-2) % RG == 0, name, ": ", format_name(f), " rows come in groups of ", RG,
              ", got ", w.size(-2));
  return f;
}

inline Rows rows_of(const Weight& weight, int64_t K, const char* name = "weight") {
  const at::Tensor& w = tensor_of(weight);
  const Fmt f = checked_format(w, std::get<1>(weight), K, name);
  return {f, static_cast<const uint8_t*>(w.data_ptr()), row_bytes(f, K)};
}

// Rows [0, N) of a weight as float32 into out [N, K] (the traits' to_float).
template <class T>
inline void rows_to_float(const Rows& w, int64_t N, int64_t K, float* out) {
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* r = w.row(n);
    float* o = out + n * K;
    wvec v[NB];
    int64_t b = 0;
    for (; (b + 1) * QK <= K; ++b) {
      T::load(r, b, v);
      std::memcpy(o + b * QK, v, sizeof(v));
    }
    if constexpr (T::block_bytes == QK * 4 || T::block_bytes == QK * 2)  // float formats: a tail
      for (int64_t k = b * QK; k < K; ++k) o[k] = T::at(r, k);
  }
}

// Groups of 8 rows of format T (Q8_0 / Q4_0) from w.row(0) (N % 8 == 0) as float32 into out [N, K].
template <class T>
inline void group_rows_to_float(const Rows& w, int64_t N, int64_t K, float* out) {
  uint8_t block[T::block_bytes];
  wvec v[NB];
  for (int64_t g = 0; g < N / RG; ++g)
    for (int r = 0; r < RG; ++r) {
      float* o = out + (g * RG + r) * K;
      for (int64_t b = 0; b < K / QK; ++b) {
        block_of<T>(w.row(g * RG), b, r, block);
        T::load(block, 0, v);
        std::memcpy(o + b * QK, v, sizeof(v));
      }
    }
}

// Groups of 8 bf16 rows (BF16_G8) from w.row(0) (N % 8 == 0) as float32 into out [N, K].
inline void bf16_group_rows_to_float(const Rows& w, int64_t N, int64_t K, float* out) {
  wvec v[NB];
  for (int64_t g = 0; g < N / RG; ++g)
    for (int64_t b = 0; b < K / QK; ++b)  // the group read in order, written to its 8 rows
      for (int r = 0; r < RG; ++r) {
        TraitsBF16G8::load(w.row(g * RG) + r * QK * 2, b, v);
        std::memcpy(out + (g * RG + r) * K + b * QK, v, sizeof(v));
      }
}

// Rows [0, N) of w as float32 (the traits' to_float); Q8_0 / Q4_0 / BF16_G8: from a group start,
// N % 8 == 0.
inline void to_float(const Rows& w, int64_t N, int64_t K, float* out) {
  switch (w.fmt) {
    case F32: rows_to_float<TraitsF32>(w, N, K, out); break;
    case BF16: rows_to_float<TraitsBF16>(w, N, K, out); break;
    case BF16_G8: bf16_group_rows_to_float(w, N, K, out); break;
    case Q8_0: group_rows_to_float<TraitsQ8_0>(w, N, K, out); break;
    case Q4_K: rows_to_float<TraitsQ4_K>(w, N, K, out); break;
    case Q5_K: rows_to_float<TraitsQ5_K>(w, N, K, out); break;
    case Q6_K: rows_to_float<TraitsQ6_K>(w, N, K, out); break;
    default: group_rows_to_float<TraitsQ4_0>(w, N, K, out); break;
  }
}

// Row n of a float32 or bf16 weight (rows, or BF16_G8's groups of 8 rows) as float32 into out [K]:
// a gathered row (the embedding table; DecodePlan::set_ends admits no other format). A grouped row's
// K / 32 blocks are one cache line each, as many lines as a row of BF16 rows.
inline void row_to_float(const Rows& w, int64_t n, int64_t K, float* out) {
  if (w.fmt != BF16_G8) return to_float(w.from(n), 1, K, out);
  const uint8_t* row = w.row(n - n % RG) + n % RG * QK * 2;  // its group, then its first block's 64 bytes
  rows_to_float<TraitsBF16G8>({BF16_G8, row, 0}, 1, K, out);
}

}  // namespace qwen35
