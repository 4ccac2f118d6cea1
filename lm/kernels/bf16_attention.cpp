// Attention of bf16 queries, keys and values, with no mask (the vision tower's segments) or causal
// (the LM's prefill of an unpadded prompt, any chunk of it: the last T of L positions; grouped key
// heads), on CPUs with AVX512-BF16: one vdpbf16ps multiplies 16 pairs of bf16 and adds them to 16
// float32 sums, twice the float32 FMA rate, where torch's SDPA runs bf16 inputs at its float32 rate.
// Per (row, head):
//   s[i, j] = scale * (q_i . k_j)                 float32 sums of the bf16 products (exact products)
//   p[i, j] = exp(s[i, j] - max_j s[i, j])        float32, over all of the keys query i sees at once
//   out_i   = sum_j bf16(p[i, j]) v_j / sum_j p[i, j]   float32 sums, rounded to bf16 at the end
// The probabilities are rounded to bf16 for the product with v (as a bf16 SDPA's matmul takes them);
// the softmax is exact (two passes over a row of scores kept in L2, not flash attention's running
// rescale). Error against float32 attention of the same bf16 inputs: tests/lm/test_compute.py.
//
// Layouts: each (row, key head)'s keys are copied into tiles of 16 keys whose pairs of dims lie side
// by side (kt [L / 16][D / 2][16][2], L padded to pairs of tiles), so one load serves 16 keys of one
// dim pair, against a query's dim pair broadcast; its values into pairs of keys (vt [L / 2][Dp][2],
// Dp = D rounded up to 16), so one load serves 16 dims of two keys, against the two keys'
// probabilities broadcast.

#include "kernels.h"
#include "vec.h"

#include <c10/util/BFloat16.h>

#include <atomic>

using namespace qwen35;

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define QWEN35_BF16_ATTENTION 1
#else
#define QWEN35_BF16_ATTENTION 0
#endif

bool bf16_attention_built() { return QWEN35_BF16_ATTENTION; }

#if QWEN35_BF16_ATTENTION
namespace {

constexpr int QROWS = 16;  // queries of one task (their probabilities share each pass over the values)
constexpr int SROWS = 8;   // queries of one pass over the keys (8 x 2 sums: two tiles of keys a step)

using bf16 = uint16_t;

inline __m512 dot2(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }

inline __m512i pair_of(const bf16* p) {  // two bf16 in every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

struct Head {
  const bf16* q;  // query 0 of this (row, head); queries `lq` apart
  int64_t lq;
  const bf16* kt;  // the keys of its key head in tiles (see above)
  const bf16* vt;  // the values of its key head in pairs of keys
  bf16* out;       // out row of query 0; rows `lo` apart
  int64_t lo;
  int64_t D, Dp;
  int64_t seen;  // keys query 0 sees (causal: L - T + 1; else all L); query i sees seen + i (at most L)
  int64_t L;
};

// Scores of R queries i0.. against the first `keys` keys (whole tiles of 16) into s [R][Lt], times
// scale, -inf where a query may not look; their maxima into m. Two tiles of keys a step, so that each
// broadcast of a query's dim pair serves two products (the keys are laid out in whole pairs of tiles).
template <int R>
void scores(const Head& h, int64_t i0, int64_t keys, float scale, float* s, int64_t Lt, float* m) {
  const int64_t D = h.D;
  __m512 mx[R];
  for (int r = 0; r < R; ++r) mx[r] = _mm512_set1_ps(-INFINITY);
  for (int64_t j0 = 0; j0 < keys; j0 += 32) {
    const bf16 *tile = h.kt + j0 * D, *next = tile + 16 * D;
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; ++p) {
      const __m512i k0 = _mm512_loadu_si512(tile + p * 32), k1 = _mm512_loadu_si512(next + p * 32);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i qp = pair_of(h.q + (i0 + r) * h.lq + 2 * p);
        acc[r][0] = dot2(acc[r][0], k0, qp);
        acc[r][1] = dot2(acc[r][1], k1, qp);
      }
    }
    for (int t = 0; t < 2 && j0 + 16 * t < keys; ++t)
      for (int r = 0; r < R; ++r) {
        const int64_t seen = std::min(h.L, h.seen + i0 + r) - j0 - 16 * t;  // keys of this tile query r sees
        const __mmask16 real = seen >= 16 ? __mmask16(0xffff) : seen <= 0 ? __mmask16(0) : __mmask16((1u << seen) - 1);
        const __m512 v = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), real, acc[r][t], _mm512_set1_ps(scale));
        _mm512_storeu_ps(s + r * Lt + j0 + 16 * t, v);
        mx[r] = _mm512_max_ps(mx[r], v);
      }
  }
  for (int r = 0; r < R; ++r) m[r] = _mm512_reduce_max_ps(mx[r]);
}

// exp(x) for x <= 0 (-inf: any value, masked by the caller): 2^(x log2(e)) as 2^n 2^f, n the nearest
// integer, |f| <= 1/2, 2^f by its degree-4 Taylor polynomial (relative error below 5e-5: the
// probabilities are rounded to bf16 next, 2^-9).
inline __m512 exp_to_bf16(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.00961813f), f, _mm512_set1_ps(0.05550411f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022651f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314718f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Row s [keys] of scores -> p = bf16(exp(s - m)) (0 where s is -inf), returns the float32 sum.
float probabilities(const float* s, float m, int64_t keys, bf16* p) {
  __m512 sum = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(m);
  for (int64_t j = 0; j < keys; j += 16) {
    const __m512 x = _mm512_loadu_ps(s + j);
    const __mmask16 seen = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    const __m512 e = _mm512_maskz_mov_ps(seen, exp_to_bf16(_mm512_sub_ps(x, mv)));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), (__m256i)_mm512_cvtneps_pbh(e));
  }
  return _mm512_reduce_add_ps(sum);
}

// Dims [16 c0, 16 (c0 + NC)) of the out rows of R queries = p [R][Lt] . v / l over `keys` keys.
template <int R, int NC>
void weighted_values(const Head& h, int64_t i0, const bf16* p, int64_t Lt, int64_t keys, const float* l, int64_t c0) {
  __m512 acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t jp = 0; jp < keys / 2; ++jp) {
    const bf16* pair = h.vt + (jp * h.Dp + c0 * 16) * 2;
    __m512i w[R];
    for (int r = 0; r < R; ++r) w[r] = pair_of(p + r * Lt + 2 * jp);
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      const __m512i v = _mm512_loadu_si512(pair + c * 32);
      for (int r = 0; r < R; ++r) acc[r][c] = dot2(acc[r][c], v, w[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    bf16* o = h.out + (i0 + r) * h.lo;
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int c = 0; c < NC; ++c) {
      const __m256i y = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], inv));
      const int64_t n = std::min<int64_t>(16, h.D - (c0 + c) * 16);
      _mm256_mask_storeu_epi16(o + (c0 + c) * 16, __mmask16((1u << n) - 1), y);
    }
  }
}

template <int NC>
void values_pass(const Head& h, int64_t i0, int64_t rows, const bf16* p, int64_t Lt, int64_t keys, const float* l,
                 int64_t c0) {
  constexpr int R = NC == 1 ? 15 : NC == 2 ? 10 : NC == 3 ? 7 : NC == 4 ? 6 : 5;  // R (NC + 1) < 32 registers
  for (int64_t r = 0; r < rows; r += R) {
    const bf16* pr = p + r * Lt;
    const int64_t n = std::min<int64_t>(R, rows - r);
    if (n == R) {
      weighted_values<R, NC>(h, i0 + r, pr, Lt, keys, l + r, c0);
      continue;
    }
    switch (n) {  // the last rows of the task
#define ROWS(m) case m: if constexpr (m < R) weighted_values<m, NC>(h, i0 + r, pr, Lt, keys, l + r, c0); break;
      ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14)
#undef ROWS
    }
  }
}

// Queries [i0, i0 + rows) of one head (rows <= QROWS), s and p the thread's scratch [QROWS][Lt].
void query_rows(const Head& h, int64_t i0, int64_t rows, float scale, float* s, bf16* p, int64_t Lt) {
  const int64_t keys = (std::min(h.L, h.seen + i0 + rows - 1) + 15) / 16 * 16;  // whole tiles the rows see
  float m[QROWS], l[QROWS];
  for (int64_t r0 = 0; r0 < rows; r0 += SROWS) {  // the scores, SROWS rows of the task a pass over the keys
    float* sr = s + r0 * Lt;
    switch (std::min<int64_t>(SROWS, rows - r0)) {
#define ROWS(n) case n: scores<n>(h, i0 + r0, keys, scale, sr, Lt, m + r0); break;
      ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7)
#undef ROWS
      default: scores<SROWS>(h, i0 + r0, keys, scale, sr, Lt, m + r0); break;
    }
  }
  for (int64_t r = 0; r < rows; ++r) l[r] = probabilities(s + r * Lt, m[r], keys, p + r * Lt);
  // up to 80 dims in one pass over the values, wider heads 64 a pass (measured best of 32 / 48 / 64 / 80)
  const int64_t vectors = h.Dp / 16, block = vectors <= 5 ? vectors : 4;
  for (int64_t c0 = 0; c0 < vectors; c0 += block) {
    switch (std::min<int64_t>(block, vectors - c0)) {
      case 1: values_pass<1>(h, i0, rows, p, Lt, keys, l, c0); break;
      case 2: values_pass<2>(h, i0, rows, p, Lt, keys, l, c0); break;
      case 3: values_pass<3>(h, i0, rows, p, Lt, keys, l, c0); break;
      case 4: values_pass<4>(h, i0, rows, p, Lt, keys, l, c0); break;
      default: values_pass<5>(h, i0, rows, p, Lt, keys, l, c0); break;
    }
  }
}

// One key head's keys and values [L, D] (rows lk and lv apart) into the tiles (a whole number of
// pairs of them) and pairs above, zero-padded.
void lay_out(const bf16* k, int64_t lk, const bf16* v, int64_t lv, int64_t L, int64_t D, bf16* kt, bf16* vt) {
  const int64_t Lt = (L + 15) / 16 * 16, Dp = (D + 15) / 16 * 16, Lk = (L + 31) / 32 * 32;
  std::fill(kt, kt + Lk * D, bf16(0));
  std::fill(vt, vt + Lt * Dp, bf16(0));
  for (int64_t j = 0; j < L; ++j) {
    bf16* kj = kt + j / 16 * D * 16 + j % 16 * 2;  // tile j / 16, key j % 16 of it
    bf16* vj = vt + j / 2 * Dp * 2 + j % 2;         // pair j / 2, key j % 2 of it
    for (int64_t d = 0; d < D; ++d) {
      kj[d / 2 * 32 + d % 2] = k[j * lk + d];
      vj[d * 2] = v[j * lv + d];
    }
  }
}

}  // namespace

// q bf16 [B, T, H, D], k and v bf16 [B, L, KV, D] (H a multiple of KV: query head h reads key head
// h / (H / KV)), any strides but D contiguous and even, D <= 256; causal: query i sees keys
// j <= i + L - T (the last T of L positions), else all -> out bf16 [B, T, H, D] contiguous.
at::Tensor bf16_attention(at::Tensor q, at::Tensor k, at::Tensor v, double scale, bool causal) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "bf16_attention: q, k, v must be bfloat16");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(3) == q.size(3),
              "bf16_attention: q must be [B, T, H, D], k and v [B, L, KV, D]");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3), L = k.size(1), KV = k.size(2);
  TORCH_CHECK(KV > 0 && H % KV == 0 && D % 2 == 0 && D <= 256 && (!causal || L >= T),
              "bf16_attention: query heads a multiple of key heads, an even head dim of at most 256, causal L >= T");
  for (auto* t : {&q, &k, &v}) TORCH_CHECK(t->stride(3) == 1, "bf16_attention: the head dim must be contiguous");
  auto out = at::empty({B, T, H, D}, q.options());
  if (out.numel() == 0) return out;
  const int64_t Lt = (L + 15) / 16 * 16, Dp = (D + 15) / 16 * 16, rep = H / KV, Lk = (L + 31) / 32 * 32;
  auto kt = at::empty({B * KV, Lk * D}, q.options()), vt = at::empty({B * KV, Lt * Dp}, q.options());
  auto ptr = [](const at::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); };
  bf16 *ktp = reinterpret_cast<bf16*>(kt.data_ptr()), *vtp = reinterpret_cast<bf16*>(vt.data_ptr());
  at::parallel_for(0, B * KV, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = g / KV, kh = g % KV;
      lay_out(ptr(k) + b * k.stride(0) + kh * k.stride(2), k.stride(1), ptr(v) + b * v.stride(0) + kh * v.stride(2),
              v.stride(1), L, D, ktp + g * Lk * D, vtp + g * Lt * Dp);
    }
  });
  const int64_t blocks = (T + QROWS - 1) / QROWS, tasks = B * H * blocks;
  const float s = float(scale);
  std::atomic<int64_t> next{0};  // tasks taken one at a time: causal ones grow along the queries
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores(QROWS * Lt);
    std::vector<bf16> probs(QROWS * Lt);
    for (int64_t t = next++; t < tasks; t = next++) {
      const int64_t bh = t / blocks, i0 = t % blocks * QROWS, b = bh / H, h = bh % H, g = b * KV + h / rep;
      const Head head{ptr(q) + b * q.stride(0) + h * q.stride(2), q.stride(1), ktp + g * Lk * D, vtp + g * Lt * Dp,
                      reinterpret_cast<bf16*>(out.data_ptr()) + (b * T * H + h) * D, H * D, D, Dp,
                      causal ? L - T + 1 : L, L};
      query_rows(head, i0, std::min<int64_t>(QROWS, T - i0), s, scores.data(), probs.data(), Lt);
    }
  });
  return out;
}
#else
at::Tensor bf16_attention(at::Tensor, at::Tensor, at::Tensor, double, bool) {
  TORCH_CHECK(false, "bf16_attention: these kernels were built without AVX512-BF16");
}
#endif
