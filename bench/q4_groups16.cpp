// Q4_0 x Q8_0 one-row decode products on AVX-512 VNNI: rows in groups of 8 (lm/formats/blocks.py's
// layout: 144-byte blocks; int8_dot.h's 512-bit kernel puts two chunks of 8 rows in one register,
// permutes x's quants into place per chunk pair and sums the register's two halves per block)
// against groups of 16 (288-byte blocks, one chunk of 16 rows per register, x's 4 quants broadcast
// from memory). Not used by the pipeline: random bytes, the speed of the two loops alone.
//
//     g++ -O3 -march=native -o /tmp/q4_groups16 bench/q4_groups16.cpp
//     taskset -c 0 /tmp/q4_groups16 2048 1024 1000   # 2048 x 1024 weights (1.2 MB, L2-resident), one core
//
// One core of the 2-core Zen 4 (AMD EPYC, family 25 model 17): groups of 8 59-67 G weights/s, groups
// of 16 73-76 (84-97 in a first harness that also prefetched 2 KiB ahead). The 16th session built the 16-row layout through the quantizer, the weight cache and
// the kernels (commit bb7a82d, reverted in the next one). On Zen 4's AVX-512 build the decode
// products ran faster (8 rows of x: int8 1.34x, int4 1.50x; one row: int4 1.08x, int8 0.89-1.10x by
// memory state), and whole steps moved little (batch 1: int4 1.006x, int8 1.011x; batch 8: int4
// 1.08-1.16x, int8 0.95-1.02x). The AVX2 build, which takes each 16-row chunk as two 8-row halves,
// lost at 2-8 rows of x: its 4-row products ran 0.82-0.90x, whole steps 0.69-0.86x at batch 4 and
// 0.80-0.88x at batch 8, with x's broadcasts not kept in registers, the halves taken over tiles of 8
// blocks and the kernels inlined; the cause was not found. One layout serves both builds, so the
// 8-row one stays.
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
constexpr int QK = 32;

static inline __m512i x_pair(__m512i x8, int i) {
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(i, i, i, i, i, i, i, i, i + 1, i + 1, i + 1, i + 1, i + 1, i + 1, i + 1, i + 1), x8);
}

// 8-row groups: block = 8 fp16 scales, then chunks of 8 rows x 4 bytes (144 bytes)
__attribute__((noinline)) void groups8(const int8_t* xq, const float* xd, const int* sum8, int nb, const uint8_t* W, int N, float* y) {
  const __m512i m4 = _mm512_set1_epi8(15);
  for (int n = 0; n < N; n += 8) {
    const uint8_t* group = W + (size_t)n / 8 * nb * 144;
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      const uint8_t* o = group + b * 144;
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)o));
      const __m512i x8 = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(xq + b * QK)));
      const __m512i q0 = _mm512_loadu_si512(o + 16), q1 = _mm512_loadu_si512(o + 80);
      __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(q0, m4), x_pair(x8, 0));
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(q1, m4), x_pair(x8, 2));
      s0 = _mm512_dpbusd_epi32(s0, _mm512_and_si512(_mm512_srli_epi16(q0, 4), m4), x_pair(x8, 4));
      s1 = _mm512_dpbusd_epi32(s1, _mm512_and_si512(_mm512_srli_epi16(q1, 4), m4), x_pair(x8, 6));
      const __m512i s = _mm512_add_epi32(s0, s1);
      const __m256i d = _mm256_sub_epi32(_mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti32x8_epi32(s, 1)), _mm256_set1_epi32(sum8[b]));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(dw, _mm256_set1_ps(xd[b])), acc);
    }
    _mm256_storeu_ps(y + n, acc);
  }
}

// 16-row groups: block = 16 fp16 scales, then chunks of 16 rows x 4 bytes (288 bytes)
__attribute__((noinline)) void groups16(const int8_t* xq, const float* xd, const int* sum8, int nb, const uint8_t* W, int N, float* y) {
  const __m512i m4 = _mm512_set1_epi8(15);
  for (int n = 0; n < N; n += 16) {
    const uint8_t* group = W + (size_t)n / 16 * nb * 288;
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      const uint8_t* o = group + b * 288;
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)o));
      int32_t x4[8];
      std::memcpy(x4, xq + b * QK, 32);
      __m512i s[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
      for (int c = 0; c < 4; ++c) {
        const __m512i w = _mm512_loadu_si512(o + 32 + 64 * c);
        s[c % 2] = _mm512_dpbusd_epi32(s[c % 2], _mm512_and_si512(w, m4), _mm512_set1_epi32(x4[c]));
        s[c % 2] = _mm512_dpbusd_epi32(s[c % 2], _mm512_and_si512(_mm512_srli_epi16(w, 4), m4), _mm512_set1_epi32(x4[c + 4]));
      }
      const __m512i d = _mm512_sub_epi32(_mm512_add_epi32(s[0], s[1]), _mm512_set1_epi32(sum8[b]));
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(dw, _mm512_set1_ps(xd[b])), acc);
    }
    _mm512_storeu_ps(y + n, acc);
  }
}

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

int main(int argc, char** argv) {
  const int N = argc > 1 ? atoi(argv[1]) : 2048, K = argc > 2 ? atoi(argv[2]) : 1024, reps = argc > 3 ? atoi(argv[3]) : 1000;
  const int nb = K / QK;
  const size_t bytes = (size_t)N * nb * 18;
  // 64-byte aligned, as a loaded model's weights are (lm/hugepages.py): with a vector's 16-byte
  // alignment every 512-bit load of the 16-row loop crosses a cache line, and it ran ~1.05x, not ~1.4x
  uint8_t* W = static_cast<uint8_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
  for (size_t i = 0; i < bytes; ++i) W[i] = rand();
  for (size_t i = 0; i + 1 < bytes; i += 18) { const uint16_t h = 0x2000 + (rand() & 0x3ff); std::memcpy(&W[i], &h, 2); }  // finite scales
  std::vector<int8_t> xq(K);
  std::vector<float> xd(nb, 0.01f), y(N);
  std::vector<int> sum8(nb);
  for (auto& q : xq) q = rand() % 255 - 127;
  for (int b = 0; b < nb; ++b) { int s = 0; for (int j = 0; j < QK; ++j) s += xq[b * QK + j]; sum8[b] = 8 * s; }
  for (int round = 0; round < 3; ++round) {
    const double t0 = now();
    for (int r = 0; r < reps; ++r) groups8(xq.data(), xd.data(), sum8.data(), nb, W, N, y.data());
    const double t1 = now();
    for (int r = 0; r < reps; ++r) groups16(xq.data(), xd.data(), sum8.data(), nb, W, N, y.data());
    const double t2 = now();
    const double w = double(N) * K * reps;
    printf("groups of 8: %5.1f G weights/s   groups of 16: %5.1f G weights/s\n", w / (t1 - t0) / 1e9, w / (t2 - t1) / 1e9);
  }
}
