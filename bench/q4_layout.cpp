// Q4_0 x Q8_0 decode product at one row: GGUF's row-major blocks (as lm/kernels/int8_dot.h reads
// them) against 8 rows' blocks interleaved (their 8 fp16 scales together, then for each group of 4
// quant bytes the 8 rows side by side), the layout llama.cpp repacks Q4_0 into for AVX2. Not used by
// the pipeline: it measures what that storage layout would gain.
//
//     g++ -O3 -march=native -fopenmp -o /tmp/q4_layout bench/q4_layout.cpp
//     OMP_NUM_THREADS=1 /tmp/q4_layout 4096 400   # 4096 x 1024 weights (2.4 MB, cache-resident)
//     OMP_NUM_THREADS=2 /tmp/q4_layout 262144 6   # 262144 x 1024 (151 MB, from memory)
//
// The two kernels agree to float32 rounding; the interleaved one needs no horizontal sums per row
// and converts 8 scales with one instruction (lm/formats/blocks.py cites its result).
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
#include <cmath>
constexpr int QK = 32;
static inline float h2f(const uint8_t* p) { uint16_t b; std::memcpy(&b, p, 2); return _cvtsh_ss(b); }
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s)); return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
// row-major: row n = nb blocks of [fp16 d][16 bytes q]
void gemv_rows(const uint8_t* W, int N, int K, const int8_t* xq, const float* xd, const float* xoff, float* y) {
  const int nb = K / QK; const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(15);
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const uint8_t* w = W + (size_t)n * nb * 18;
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}; float off[2] = {0, 0};
    for (int b = 0; b < nb; b += 2)
      for (int c = 0; c < 2; ++c) {
        const uint8_t* p = w + (b + c) * 18;
        __builtin_prefetch(p + 4096);
        const float dw = h2f(p);
        const __m128i q = _mm_loadu_si128((const __m128i*)(p + 2));
        const __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
        const __m256i x = _mm256_loadu_si256((const __m256i*)(xq + (b + c) * 32));
        const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones);
        off[c] += dw * xoff[b + c];
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(dw * xd[b + c]), acc[c]);
      }
    y[n] = hsum8(_mm256_add_ps(acc[0], acc[1])) - off[0] - off[1];
  }
}
// interleaved: group g of 8 rows, block b: [8 fp16 d][4 chunks of 32 bytes: chunk c, lane r = row r's q bytes 4c..4c+3]
void repack(const uint8_t* W, int N, int K, uint8_t* R) {
  const int nb = K / QK;
  for (int g = 0; g < N / 8; ++g)
    for (int b = 0; b < nb; ++b) {
      uint8_t* o = R + ((size_t)g * nb + b) * 144;
      for (int r = 0; r < 8; ++r) {
        const uint8_t* p = W + ((size_t)(g * 8 + r) * nb + b) * 18;
        std::memcpy(o + 2 * r, p, 2);
        for (int c = 0; c < 4; ++c) std::memcpy(o + 16 + c * 32 + r * 4, p + 2 + 4 * c, 4);
      }
    }
}
void gemv_x8(const uint8_t* R, int N, int K, const int8_t* xq, const float* xd, const int* xsum8, float* y) {
  const int nb = K / QK; const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(15);
#pragma omp parallel for schedule(static)
  for (int g = 0; g < N / 8; ++g) {
    const uint8_t* base = R + (size_t)g * nb * 144;
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      const uint8_t* o = base + b * 144;
      __builtin_prefetch(o + 2048); __builtin_prefetch(o + 2048 + 64); __builtin_prefetch(o + 2048 + 128);
      const __m256 d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)o)), _mm256_set1_ps(xd[b]));
      const int32_t* x4 = (const int32_t*)(xq + b * 32);
      __m256i s = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i q = _mm256_loadu_si256((const __m256i*)(o + 16 + c * 32));
        const __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x4[c])));      // weights 4c..4c+3
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x4[4 + c])));  // weights 16+4c..
      }
      const __m256i dot = _mm256_sub_epi32(_mm256_madd_epi16(s, ones), _mm256_set1_epi32(xsum8[b]));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d, acc);
    }
    _mm256_storeu_ps(y + g * 8, acc);
  }
}
int main(int argc, char** argv) {
  const int K = 1024, N = atoi(argv[1]), reps = atoi(argv[2]);
  const int nb = K / QK;
  std::mt19937 rng(0);
  std::vector<uint8_t> W((size_t)N * nb * 18), R(W.size());
  for (size_t i = 0; i < W.size(); ++i) W[i] = rng() & 255;
  for (int n = 0; n < N; ++n) for (int b = 0; b < nb; ++b) { uint16_t h = 0x2000 + (rng() & 0xff); std::memcpy(&W[((size_t)n * nb + b) * 18], &h, 2); }
  repack(W.data(), N, K, R.data());
  std::vector<int8_t> xq(K); std::vector<float> xd(nb), xoff(nb); std::vector<int> xsum8(nb);
  for (int i = 0; i < K; ++i) xq[i] = int8_t((int)(rng() % 255) - 127);
  for (int b = 0; b < nb; ++b) { int s = 0; for (int j = 0; j < 32; ++j) s += xq[b * 32 + j]; xd[b] = 0.01f + b * 1e-4f; xoff[b] = 8.f * xd[b] * s; xsum8[b] = 8 * s; }
  std::vector<float> y1(N), y2(N);
  for (int which = 0; which < 2; ++which)
    for (int t = 0; t < 3; ++t) {
      auto s = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r)
        if (which == 0) gemv_rows(W.data(), N, K, xq.data(), xd.data(), xoff.data(), y1.data());
        else gemv_x8(R.data(), N, K, xq.data(), xd.data(), xsum8.data(), y2.data());
      double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count() / reps;
      printf("%s N=%d: %.1f G w/s\n", which ? "interleaved x8" : "row-major   ", N, (double)N * K / sec / 1e9);
    }
  double md = 0, mx = 0;
  for (int n = 0; n < N; ++n) { md = std::fmax(md, std::fabs(y1[n] - y2[n])); mx = std::fmax(mx, std::fabs(y1[n])); }
  printf("max |diff| %.3g of max |y| %.3g\n", md, mx);
}
