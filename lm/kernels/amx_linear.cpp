// Prefill products in bf16 on AMX tiles (Intel Sapphire Rapids and later): y = x W^T for many rows
// of x, W in any format of formats.h, float32 in and out, float32 accumulation in the tiles.
//
// The weights are never copied whole: each thread takes 128 rows of W at a time, decodes them with
// the format's traits (formats.h) into a bf16 panel in its own scratch (L2-sized) and multiplies every
// row of x with it. x is rounded to bf16 once per call and laid out as the tiles' B operand (pairs
// of k per token: [K/2][M][2]); the panel rows are the A operand as they are (row-major bf16). So a
// tile product C[16 weight rows][16 tokens] += A[16][32 k] B[16 k pairs][16 tokens][2], four of them
// (32 weight rows x 32 tokens) per step of 32 k, C transposed into y at the end.
// Error: x and W rounded to bf16 (relative 2^-9 each), products and sums in float32;
// tests/lm/test_compute.py states the bound against the float32 product on the same weights.
//
// Q8_0 / Q4_0 weights also multiply in int8 on AMX tiles (amx_int8_linear), with no conversion at
// all: a group block of 8 rows (formats.h) holds its quants as 8 chunks of the 8 rows' 4 bytes,
// which is the tiles' B operand for 8 columns as it lies (Q4_0: its nibbles unpacked to bytes, the
// 8 of u - 8 taken off through the x quants' sums, as int8_dot.h does). x is rounded to Q8_0 blocks
// as in the int8 dot products (the same error); each block's int32 tile is scaled by dx dw into
// float32 sums.
// Built where the compiler targets AMX-BF16 and AVX512-BF16 (-march=native on such a CPU); the
// process asks Linux for the tile state once (arch_prctl) and `amx_ready` says whether it may use it.

#include "int8_dot.h"
#include "vec.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

using namespace qwen35;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512BF16__)
#define QWEN35_AMX 1
#else
#define QWEN35_AMX 0
#endif
// the weights' conversion to bf16 rows (also used without AMX: bf16_rows_mm)
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define QWEN35_BF16_ROWS 1
#else
#define QWEN35_BF16_ROWS 0
#endif

namespace {

constexpr int64_t TILE = 16;            // rows of a tile (weight rows of C, tokens of B)
constexpr int64_t KT = 32;              // k per tile product (16 pairs of bf16)
constexpr int64_t PANEL_ROWS = 128;     // weight rows a thread converts at a time
constexpr int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

#if QWEN35_AMX
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (2 x 2 of 16 weight rows x 16 tokens, float32); 4, 5: A (weights); 6, 7: B (x).
inline void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = TILE;
  _tile_loadconfig(&c);
}
#endif

#if QWEN35_BF16_ROWS
// fp32 rows [rows][K] -> bf16 rows [rows][Kp], each ld apart (round to nearest even, zero tail).
inline void to_bf16_rows(const float* in, int64_t rows, int64_t K, int64_t Kp, uint16_t* out, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = in + r * K;
    uint16_t* dst = out + r * ld;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + k + 16), _mm512_loadu_ps(src + k));
      _mm512_storeu_si512(dst + k, (__m512i)v);
    }
    for (; k < K; ++k) {
      const __m128bh v = _mm_cvtneps_pbh(_mm_set_ss(src[k]));
      dst[k] = static_cast<uint16_t>(_mm_cvtsi128_si32((__m128i)v));
    }
    std::memset(dst + K, 0, (Kp - K) * sizeof(uint16_t));
  }
}

// 32 weights decoded by a format's traits (two vectors of 16 floats) -> 32 bf16 at out.
inline void store_bf16(const wvec* v, uint16_t* out) {
  static_assert(NB == 2, "the AMX products are built with 16-float vectors");
  _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh((__m512)v[1], (__m512)v[0]));
}

// Rows [0, N) of w (format T, rows one after another) as bf16 rows, ld apart, zero past K to Kp.
template <class T>
void rows_to_bf16(const Rows& w, int64_t N, int64_t K, int64_t Kp, uint16_t* out, int64_t ld) {
  wvec v[NB];
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* r = w.row(n);
    uint16_t* o = out + n * ld;
    int64_t b = 0;
    for (; (b + 1) * QK <= K; ++b) {
      T::load(r, b, v);
      store_bf16(v, o + b * QK);
    }
    for (int64_t k = b * QK; k < K; ++k) {  // float formats: a tail
      const __m128bh h = _mm_cvtneps_pbh(_mm_set_ss(T::at(r, k)));
      o[k] = static_cast<uint16_t>(_mm_cvtsi128_si32((__m128i)h));
    }
    std::memset(o + K, 0, (Kp - K) * sizeof(uint16_t));
  }
}

// One block of a Q4_0 group (8 rows x 32 weights, formats.h) as 8 rows of 32 bf16, ld apart: the
// 8 rows' quant bytes transposed into 2 vectors of 4 rows x 16 bytes, and each row's 32 weights
// looked up (vpermw) in a table of its 16 values bf16(d (u - 8)): the same float product and the same
// rounding as decoding each weight to float32 first, in a third of the instructions.
inline void q4_group_block_to_bf16(const uint8_t* blk, uint16_t* out, int64_t ld) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
  alignas(32) float ds[RG];
  _mm256_store_ps(ds, d);
  const __m512i a = _mm512_loadu_si512(blk + 16), b = _mm512_loadu_si512(blk + 80);  // chunks 0-1, 2-3
  // dword c * 8 + r holds row r's packed bytes 4c..4c+3: rows 0-3 and 4-7, 16 bytes a row
  const __m512i rows03 = _mm512_permutex2var_epi32(
      a, _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27), b);
  const __m512i rows47 = _mm512_permutex2var_epi32(
      a, _mm512_setr_epi32(4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31), b);
  const __m512 u8 = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m128i low = _mm_set1_epi8(0x0f);
  auto row = [&](__m128i q, int r) {  // packed byte j: weight j (low nibble), weight j + 16 (high)
    const __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_and_si128(q, low));
    const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(u8, _mm512_set1_ps(ds[r]))));
    _mm512_storeu_si512(out + r * ld, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(u), table));
  };
  row(_mm512_extracti32x4_epi32(rows03, 0), 0);
  row(_mm512_extracti32x4_epi32(rows03, 1), 1);
  row(_mm512_extracti32x4_epi32(rows03, 2), 2);
  row(_mm512_extracti32x4_epi32(rows03, 3), 3);
  row(_mm512_extracti32x4_epi32(rows47, 0), 4);
  row(_mm512_extracti32x4_epi32(rows47, 1), 5);
  row(_mm512_extracti32x4_epi32(rows47, 2), 6);
  row(_mm512_extracti32x4_epi32(rows47, 3), 7);
}

// Groups of 8 rows of a block format T (Q8_0 / Q4_0) or BF16_G8 from w.row(0) as bf16 rows, ld apart.
template <class T>
void group_rows_to_bf16(const Rows& w, int64_t N, int64_t K, uint16_t* out, int64_t ld) {
  uint8_t block[T::block_bytes];
  wvec v[NB];
  for (int64_t g = 0; g < N / RG; ++g)
    for (int64_t b = 0; b < K / QK; ++b) {  // the group read in order, written to its 8 rows
      if constexpr (std::is_same_v<T, TraitsQ4_0>) {
        q4_group_block_to_bf16(w.row(g * RG) + b * group_block_bytes<T>(), out + g * RG * ld + b * QK, ld);
        continue;
      }
      for (int r = 0; r < RG; ++r) {
        if constexpr (std::is_same_v<T, TraitsBF16G8>) {
          T::load(w.row(g * RG) + r * QK * 2, b, v);
        } else {
          block_of<T>(w.row(g * RG), b, r, block);
          T::load(block, 0, v);
        }
        store_bf16(v, out + (g * RG + r) * ld + b * QK);
      }
    }
}

// Rows [0, N) of a weight in any format as bf16 rows [N][ld] (K % 32 == 0 for the grouped formats).
void weight_to_bf16(const Rows& w, int64_t N, int64_t K, int64_t Kp, uint16_t* out, int64_t ld) {
  switch (w.fmt) {
    case F32: rows_to_bf16<TraitsF32>(w, N, K, Kp, out, ld); break;
    case BF16: rows_to_bf16<TraitsBF16>(w, N, K, Kp, out, ld); break;
    case BF16_G8: group_rows_to_bf16<TraitsBF16G8>(w, N, K, out, ld); break;
    case Q8_0: group_rows_to_bf16<TraitsQ8_0>(w, N, K, out, ld); break;
    case Q4_K: rows_to_bf16<TraitsQ4_K>(w, N, K, Kp, out, ld); break;
    case Q5_K: rows_to_bf16<TraitsQ5_K>(w, N, K, Kp, out, ld); break;
    case Q6_K: rows_to_bf16<TraitsQ6_K>(w, N, K, Kp, out, ld); break;
    default: group_rows_to_bf16<TraitsQ4_0>(w, N, K, out, ld); break;
  }
  for (int64_t n = 0; n < N && Kp > K && grouped(w.fmt); ++n) std::memset(out + n * ld + K, 0, (Kp - K) * 2);
}
#endif

#if QWEN35_AMX

// A 16 x 16 block of 4-byte values in[j * ld + i] as its 16 columns: r[i] holds in[0..15][i].
inline void transpose16(const float* in, int64_t ld, __m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(in + ld * i);
  for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// x [M][K] float32 -> bf16 pairs of k per token: out[k / 2][ldx][2] (tokens past M and k past K zero),
// 16 tokens at a time so that each write is one line of 16 tokens' pairs.
void x_as_pairs(const float* x, int64_t M, int64_t K, int64_t Mp, int64_t Kp, uint16_t* out, int64_t ldx) {
  at::parallel_for(0, Mp / TILE, 1, [&](int64_t g0, int64_t g1) {
    thread_local std::vector<uint16_t> rows;
    if (rows.size() < size_t(TILE * Kp)) rows.resize(TILE * Kp);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t m0 = g * TILE, live = std::max<int64_t>(0, std::min(TILE, M - m0));
      to_bf16_rows(x + m0 * K, live, K, Kp, rows.data(), Kp);
      std::fill(rows.begin() + live * Kp, rows.begin() + TILE * Kp, 0);
      const float* pairs = reinterpret_cast<const float*>(rows.data());  // a pair of bf16 as 4 bytes
      float* dst = reinterpret_cast<float*>(out) + m0;
      __m512 col[TILE];
      for (int64_t p0 = 0; p0 < Kp / 2; p0 += TILE) {  // Kp / 2 is a multiple of 16
        transpose16(pairs + p0, Kp / 2, col);
        for (int64_t p = 0; p < TILE; ++p) _mm512_storeu_ps(dst + (p0 + p) * ldx, col[p]);
      }
    }
  });
}

// C tiles of one 32 x 32 step, transposed into y[m][n] (only rows < M, columns < N).
inline void store_block(float* y, int64_t ldy, int64_t m0, int64_t n0, int64_t M, int64_t N) {
  alignas(64) float c[4][TILE][TILE];
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
  _tile_stored(3, c[3], 64);
  for (int t = 0; t < 4; ++t) {  // tile t: weight rows n0 + 16 (t % 2), tokens m0 + 16 (t / 2)
    const int64_t nb = n0 + TILE * (t % 2), mb = m0 + TILE * (t / 2);
    if (nb >= N || mb >= M) continue;
    __m512 col[TILE];
    transpose16(c[t][0], TILE, col);
    const __mmask16 live = N - nb >= TILE ? 0xffff : static_cast<__mmask16>((1u << (N - nb)) - 1);
    for (int64_t i = 0; i < TILE && mb + i < M; ++i) _mm512_mask_storeu_ps(y + (mb + i) * ldy + nb, live, col[i]);
  }
}

// C 0-3 += the 2 x 2 products of A tiles at a0, a1 (weight rows, lda bytes apart) and B tiles at
// x, x + 16 tokens (x's pairs, ldx tokens apart): one step of 32 k.
inline void step_bf16(const void* a0, const void* a1, int64_t lda, const uint16_t* x, int64_t ldx) {
  _tile_loadd(4, a0, lda);
  _tile_loadd(5, a1, lda);
  _tile_loadd(6, x, ldx * 4);
  _tile_loadd(7, x + TILE * 2, ldx * 4);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 5, 6);
  _tile_dpbf16ps(2, 4, 7);
  _tile_dpbf16ps(3, 5, 7);
}

inline void zero_c() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// y[:, n0:n0+rows] = x W[n0:n0+rows]^T from a bf16 panel [rows (a multiple of 32)][ldp] and x's pairs
// [Kp / 2][ldx][2]. The row strides are padded by a cache line (ldp = Kp + 32, ldx = Mp + 16): at
// strides of 4 KiB the 16 rows of a tile load would share one L1 set.
void panel_product(const uint16_t* panel, int64_t rows, int64_t ldp, const uint16_t* xp, int64_t ldx, int64_t M,
                   int64_t Mp, int64_t Kp, int64_t n0, int64_t N, float* y, int64_t ldy) {
  for (int64_t m0 = 0; m0 < Mp; m0 += 2 * TILE)
    for (int64_t r = 0; r < rows; r += 2 * TILE) {
      zero_c();
      const uint16_t* a = panel + r * ldp;
      for (int64_t k = 0; k < Kp; k += KT)
        step_bf16(a + k, a + TILE * ldp + k, ldp * 2, xp + (k / 2) * ldx * 2 + m0 * 2, ldx);
      store_block(y, ldy, m0, n0 + r, M, N);
    }
}
// Tiles of the products of bf16 rows in groups of 8 (BF16_G8): C 0-3 (2 x 2 of 8 weight rows x 16
// tokens), A 4, 5 (block b of a group: its 8 rows' 32 bf16, 64 bytes apart, as they lie in memory),
// B 6, 7 (16 tokens' pairs, as in panel_product).
inline void configure_group_tiles() {
  TileConfig c;
  for (int t = 0; t < 6; ++t) c.colsb[t] = 64, c.rows[t] = RG;
  for (int t = 6; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = TILE;
  _tile_loadconfig(&c);
}

// y[:, g0*8 : g1*8] for groups [g0, g1) of a BF16_G8 weight, read where it lies (no conversion):
// 32 tokens at a time over the task's groups, two groups a step, so that the task's weights stay
// in L2 across the tokens and a block of x's pairs across the groups.
void group_product(const Rows& w, int64_t g0, int64_t g1, const uint16_t* xp, int64_t ldx, int64_t M, int64_t Mp,
                   int64_t K, float* y, int64_t ldy) {
  alignas(64) float c[4][RG][TILE];
  for (int64_t m0 = 0; m0 < Mp; m0 += 2 * TILE)
    for (int64_t g = g0; g < g1; g += 2) {
      const int64_t pair = std::min<int64_t>(2, g1 - g);
      const uint8_t* a0 = w.row(g * RG);
      const uint8_t* a1 = w.row((g + pair - 1) * RG);
      zero_c();
      for (int64_t b = 0; b < K / QK; ++b)
        step_bf16(a0 + b * RG * QK * 2, a1 + b * RG * QK * 2, QK * 2, xp + (b * QK / 2) * ldx * 2 + m0 * 2, ldx);
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
      for (int t = 0; t < 4; ++t) {  // tile t: group g + t % 2, tokens m0 + 16 (t / 2)
        if (t % 2 >= pair) continue;
        const int64_t nb = (g + t % 2) * RG, mb = m0 + TILE * (t / 2);
        for (int64_t i = 0; i < TILE && mb + i < M; ++i)
          for (int64_t j = 0; j < RG; ++j) y[(mb + i) * ldy + nb + j] = c[t][j][i];
      }
    }
}

// Tiles of the int8 products: C 0-3 (2 x 2 of 16 tokens x 8 weight rows, int32), A 4, 5 (16 tokens
// x 32 quants of x), B 6, 7 (one block of a group: 8 chunks x 8 rows x 4 bytes).
inline void configure_int8_tiles() {
  TileConfig c;
  for (int t = 0; t < 4; ++t) c.colsb[t] = 32, c.rows[t] = TILE;
  for (int t = 4; t < 6; ++t) c.colsb[t] = 32, c.rows[t] = TILE;
  for (int t = 6; t < 8; ++t) c.colsb[t] = 32, c.rows[t] = RG;
  _tile_loadconfig(&c);
}

// acc[i] (tokens 2i, 2i + 1 of the tile x 8 weight rows, float32) += dx dw (C - sum8 for Q4_0) of a
// C tile stored in c [16][8]; dx, sum8: the tile's first token's entries for this block, nb apart.
template <bool Q4>
inline void scale_into(const int32_t* c, const float* dx, const int32_t* sum8, int64_t nb, __m512 dw2,
                       __m512* acc) {
  for (int i = 0; i < TILE / 2; ++i) {
    __m512i v = _mm512_loadu_si512(c + 16 * i);
    if constexpr (Q4) {
      const __m512i s = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(sum8[2 * i * nb])),
                                           _mm256_set1_epi32(sum8[(2 * i + 1) * nb]), 1);
      v = _mm512_sub_epi32(v, s);
    }
    const __m512 d = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(dx[2 * i * nb])),
                                        _mm256_set1_ps(dx[(2 * i + 1) * nb]), 1);
    acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(v), d), dw2, acc[i]);
  }
}

// Block b of a Q4_0 group as the B operand: its 4 chunks of packed bytes -> 8 chunks of u in [0, 15].
inline void unpack_q4(const uint8_t* chunks, uint8_t* out) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int h = 0; h < 2; ++h) {  // 64 of the 128 packed bytes at a time
    const __m512i packed = _mm512_loadu_si512(chunks + 64 * h);
    _mm512_storeu_si512(out + 64 * h, _mm512_and_si512(packed, low));
    _mm512_storeu_si512(out + 128 + 64 * h, _mm512_and_si512(_mm512_srli_epi16(packed, 4), low));
  }
}

// y[:, g0*8 : g1*8] for groups [g0, g1) of a Q8_0 / Q4_0 weight against x's quants (Mp rows, a
// multiple of 32): two groups and 32 tokens a step, over all blocks.
template <bool Q4>
void int8_groups(const QuantizedX& xq, int64_t M, int64_t Mp, const Rows& w, int64_t g0, int64_t g1, float* y,
                 int64_t ldy) {
  constexpr int64_t block_bytes = Q4 ? 2 + QK / 2 : 2 + QK, GB = RG * block_bytes;
  const int64_t K = xq.K, nb = K / QK;
  alignas(64) int32_t c[4][TILE * RG];
  std::vector<uint8_t> unpacked(Q4 ? 2 * nb * 256 : 0);  // Q4_0: the pair's blocks as bytes, once per pair
  for (int64_t g = g0; g < g1; g += 2) {
    const int64_t pair = std::min<int64_t>(2, g1 - g);
    const uint8_t* group[2] = {w.row(g * RG), w.row((g + pair - 1) * RG)};
    if constexpr (Q4)
      for (int j = 0; j < 2; ++j)
        for (int64_t b = 0; b < nb; ++b) unpack_q4(group[j] + b * GB + 16, unpacked.data() + (j * nb + b) * 256);
    for (int64_t m0 = 0; m0 < Mp; m0 += 2 * TILE) {
      __m512 acc[4][TILE / 2];
      for (auto& a : acc)
        for (auto& v : a) v = _mm512_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        _tile_loadd(4, xq.q.data() + m0 * K + b * QK, K);
        _tile_loadd(5, xq.q.data() + (m0 + TILE) * K + b * QK, K);
        _tile_loadd(6, Q4 ? unpacked.data() + b * 256 : group[0] + b * GB + 16, 32);
        _tile_loadd(7, Q4 ? unpacked.data() + (nb + b) * 256 : group[1] + b * GB + 16, 32);
        zero_c();
        if constexpr (Q4) {  // x signed, u unsigned
          _tile_dpbsud(0, 4, 6);
          _tile_dpbsud(1, 4, 7);
          _tile_dpbsud(2, 5, 6);
          _tile_dpbsud(3, 5, 7);
        } else {
          _tile_dpbssd(0, 4, 6);
          _tile_dpbssd(1, 4, 7);
          _tile_dpbssd(2, 5, 6);
          _tile_dpbssd(3, 5, 7);
        }
        _tile_stored(0, c[0], 32);  // (tile numbers are constants of the instructions)
        _tile_stored(1, c[1], 32);
        _tile_stored(2, c[2], 32);
        _tile_stored(3, c[3], 32);
        for (int t = 0; t < 4; ++t) {  // tile t: group g + t % 2, tokens m0 + 16 (t / 2)
          const int64_t m = m0 + TILE * (t / 2);
          const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group[t % 2] + b * GB)));
          const __m512 dw2 = _mm512_insertf32x8(_mm512_castps256_ps512(dw), dw, 1);
          scale_into<Q4>(c[t], xq.d.data() + m * nb + b, xq.sum8.data() + m * nb + b, nb, dw2, acc[t]);
        }
      }
      for (int t = 0; t < 4; ++t)
        for (int i = 0; i < TILE / 2 && t % 2 < pair; ++i) {
          alignas(64) float rows[16];
          _mm512_store_ps(rows, acc[t][i]);
          for (int h = 0; h < 2; ++h) {
            const int64_t m = m0 + TILE * (t / 2) + 2 * i + h;
            if (m < M) std::memcpy(y + m * ldy + (g + t % 2) * RG, rows + 8 * h, RG * sizeof(float));
          }
        }
    }
  }
}
#endif

bool request_tiles() {
#if QWEN35_AMX
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
  return false;
#endif
}

}  // namespace

bool amx_ready() {
  static const bool ready = request_tiles();
  return ready;
}

namespace {

// The checks both products make: x [M, K] float32, W [N, row] with K inputs per row, tiles usable.
Rows checked(const at::Tensor& x, const Weight& W, const char* who) {
  check(x, "x");
  TORCH_CHECK(x.dim() == 2 && tensor_of(W).dim() == 2, who, ": x must be [M, K] and W [N, row]");
  TORCH_CHECK(amx_ready(), who, ": this build or this CPU has no AMX tiles (lm.kernels.amx_ready)");
  return rows_of(W, x.size(1));
}

}  // namespace

// y = x W^T for a Q8_0 / Q4_0 W on AMX-INT8 tiles, x rounded to Q8_0 (see the top), one thread per
// run of groups; inside another parallel region (the routed experts) it runs on the calling thread.
at::Tensor amx_int8_linear(at::Tensor x, Weight W) {
  const Rows w = checked(x, W, "amx_int8_linear");
  const int64_t M = x.size(0), K = x.size(1), N = tensor_of(W).size(0);
  TORCH_CHECK(w.fmt == Q8_0 || w.fmt == Q4_0, "amx_int8_linear: W must be Q8_0 or Q4_0");
  auto y = at::empty({M, N}, x.options());
#if QWEN35_AMX
  if (M == 0 || N == 0) return y;
  const int64_t Mp = round_up(M, 2 * TILE), nb = K / QK;
  QuantizedX xq;
  size_quantized_x(Mp, K, xq);
  std::fill(xq.q.begin() + M * K, xq.q.end(), 0);
  std::fill(xq.d.begin() + M * nb, xq.d.end(), 0.f);
  std::fill(xq.sum8.begin() + M * nb, xq.sum8.end(), 0);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) { quantize_x_rows(xp, m0, m1, K, xq); });
  float* yp = y.data_ptr<float>();
  const int64_t groups = N / RG, per_task = 4;  // 32 weight rows a task
  at::parallel_for(0, (groups + per_task - 1) / per_task, 1, [&](int64_t t0, int64_t t1) {
    configure_int8_tiles();
    const int64_t g0 = t0 * per_task, g1 = std::min(groups, t1 * per_task);
    if (w.fmt == Q4_0) int8_groups<true>(xq, M, Mp, w, g0, g1, yp, N);
    else int8_groups<false>(xq, M, Mp, w, g0, g1, yp, N);
    _tile_release();
  });
#endif
  return y;
}

// y = x W^T: x [M, K] float32, W [N, row] in any format with K inputs per row -> y [M, N] float32.
bool bf16_rows_built() { return QWEN35_BF16_ROWS; }

// y = x W^T [M, N] for float32 x [M, K] and a weight of any format, with x and W rounded to bf16 and
// torch's bf16 GEMM (oneDNN, AVX512-BF16): W converted to bf16 rows for this call (half the bytes of
// a float32 copy), y rounded to bf16 by the GEMM and returned in float32. Single-threaded inside a
// parallel region (the prefill experts' path on CPUs with AVX512-BF16 and no AMX, expert_mlp.cpp).
at::Tensor bf16_rows_mm(const at::Tensor& x, Weight W) {
  check(x, "x");
  TORCH_CHECK(x.dim() == 2 && tensor_of(W).dim() == 2, "bf16_rows_mm: x must be [M, K] and W [N, row]");
  TORCH_CHECK(QWEN35_BF16_ROWS, "bf16_rows_mm: built without AVX512-BF16");
  const Rows w = rows_of(W, x.size(1));
#if QWEN35_BF16_ROWS
  const int64_t K = x.size(1), N = tensor_of(W).size(0);
  auto w16 = at::empty({N, K}, x.options().dtype(at::kBFloat16));
  weight_to_bf16(w, N, K, K, reinterpret_cast<uint16_t*>(w16.data_ptr()), K);
  return at::mm(x.to(at::kBFloat16), w16.t()).to(at::kFloat);
#else
  return x;
#endif
}

at::Tensor amx_linear(at::Tensor x, Weight W) {
  const Rows w = checked(x, W, "amx_linear");
  const int64_t M = x.size(0), K = x.size(1), N = tensor_of(W).size(0);
  auto y = at::empty({M, N}, x.options());
#if QWEN35_AMX
  if (M == 0 || N == 0) return y;
  const int64_t Kp = round_up(K, KT), Mp = round_up(M, 2 * TILE), ldp = Kp + KT, ldx = Mp + TILE;
  std::unique_ptr<uint16_t[]> xp(new uint16_t[Kp / 2 * ldx * 2]);  // every entry read is written by x_as_pairs
  x_as_pairs(x.data_ptr<float>(), M, K, Mp, Kp, xp.get(), ldx);
  float* yp = y.data_ptr<float>();
  const int64_t tasks = (N + PANEL_ROWS - 1) / PANEL_ROWS;
  // BF16_G8 weights of products of at most 128 rows read where they lie, in tiles of 8 rows (16 x
  // 1024 x 2048: 0.13 ms against 0.23 through panels; 124 rows: equal; 512 rows: 7.3 against 6.5 ms)
  if (w.fmt == BF16_G8 && Mp <= 4 * 2 * TILE) {
    at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
      configure_group_tiles();
      const int64_t per_task = PANEL_ROWS / RG;
      group_product(w, t0 * per_task, std::min(N / RG, t1 * per_task), xp.get(), ldx, M, Mp, K, yp, N);
      _tile_release();
    });
    return y;
  }
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    configure_tiles();
    thread_local std::vector<uint16_t> panel;  // columns past Kp are never read
    if (panel.size() < size_t(PANEL_ROWS * ldp)) panel.resize(PANEL_ROWS * ldp);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * PANEL_ROWS, rows = std::min(PANEL_ROWS, N - n0), padded = round_up(rows, 2 * TILE);
      weight_to_bf16(w.from(n0), rows, K, Kp, panel.data(), ldp);  // grouped formats: rows % 8 == 0 (checked_format)
      std::memset(panel.data() + rows * ldp, 0, (padded - rows) * ldp * sizeof(uint16_t));
      panel_product(panel.data(), padded, ldp, xp.get(), ldx, M, Mp, Kp, n0, N, yp, N);
    }
    _tile_release();
  });
#endif
  return y;
}
