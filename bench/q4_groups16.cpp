// Q4_0 x Q8_0 one-row decode products on AVX-512 VNNI: rows in groups of 8 (lm/formats/blocks.py's
// layout: 144-byte blocks; int8_dot.h's 512-bit kernel puts two chunks of 8 rows in one register,
// permutes x's quants into place per chunk pair and sums the register's two halves per block)
// against groups of 16 (288-byte blocks, one chunk of 16 rows per register, x's 4 quants broadcast
// from memory). Not used by the pipeline: random bytes, the speed of the two loops alone.
//
//     g++ -O3 -march=native -fopenmp -o /tmp/q4_groups16 bench/q4_groups16.cpp
//     taskset -c 0 /tmp/q4_groups16 2048 1024 1000   # 2048 x 1024 weights (1.2 MB, L2-resident), one core
//     /tmp/q4_groups16 stream    # from memory (113 MB): a plain read, groups of 8, of 16; 1 and 2 threads
//     /tmp/q4_groups16 regions   # from memory, 2 threads: one parallel region, or 96 of 1.18 MB each
//
// From memory (the 18th session, same machine, rounds in turns; its memory moves between a slow
// state, ~30 GB/s read by 2 threads, and a fast one, ~50-60): one thread streams at the read's rate
// with either loop (24-31 GB/s); in the fast state 2 threads of groups of 8 read 42-65 GB/s beside a
// plain read's 49-63 (16: 47-69), so the loop streams near the bus's rate when its stream is long.
// Cut into 96 regions of 1.18 MB (a fork and join each, as a decode step's ~80 kernel calls are)
// it ran ~42 GB/s where one region ran ~50 (4-5 us lost a region); each thread prefetching 64 KiB of
// its next share at the end of a region ran ~40. In the slow state all of them read the same ~30.
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
#include <string>
#include <vector>

#include <omp.h>
#include <sys/mman.h>
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

// A plain streaming read of [p, p + bytes) (the bus's rate for one thread's stream).
__attribute__((noinline)) float sum_read(const uint8_t* p, size_t bytes) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 256 <= bytes; i += 256) {
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 64));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 128));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 192));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

// Random Q4_0 rows (finite fp16 scales) and x's Q8_0 blocks.
struct Data {
  int N, K, nb;
  size_t bytes;
  uint8_t* W;
  std::vector<int8_t> xq;
  std::vector<float> xd, y;
  std::vector<int> sum8;
  Data(int N_, int K_, size_t align) : N(N_), K(K_), nb(K_ / QK), bytes(size_t(N_) * (K_ / QK) * 18) {
    // 64-byte aligned, as a loaded model's weights are (lm/hugepages.py): with a vector's 16-byte
    // alignment every 512-bit load of the 16-row loop crosses a cache line, and it ran ~1.05x, not ~1.4x
    W = static_cast<uint8_t*>(std::aligned_alloc(align, (bytes + align - 1) / align * align));
    if (align > 64) madvise(W, bytes, MADV_HUGEPAGE);  // huge pages, as the weights'
    for (size_t i = 0; i < bytes; ++i) W[i] = rand();
    for (size_t i = 0; i + 1 < bytes; i += 18) { const uint16_t h = 0x2000 + (rand() & 0x3ff); std::memcpy(&W[i], &h, 2); }
    xq.resize(K), xd.assign(nb, 0.01f), y.resize(N), sum8.resize(nb);
    for (auto& q : xq) q = rand() % 255 - 127;
    for (int b = 0; b < nb; ++b) { int s = 0; for (int j = 0; j < QK; ++j) s += xq[b * QK + j]; sum8[b] = 8 * s; }
  }
  // rows [n0, n0 + n) through loop 0 (a plain read of their bytes), 8 or 16
  void run(int loop, int n0, int n) {
    static volatile float sink;
    const uint8_t* w = W + size_t(n0) * nb * 18;
    if (loop == 0) sink = sum_read(w, size_t(n) * nb * 18);
    else if (loop == 8) groups8(xq.data(), xd.data(), sum8.data(), nb, w, n, y.data() + n0);
    else groups16(xq.data(), xd.data(), sum8.data(), nb, w, n, y.data() + n0);
  }
};

// Best of 3 of fn(), in GB/s of `bytes`.
template <class F> double rate(size_t bytes, F fn) {
  double best = 1e9;
  for (int rep = 0; rep < 3; ++rep) {
    const double t0 = now();
    fn();
    best = std::min(best, now() - t0);
  }
  return bytes / best / 1e9;
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "stream" || mode == "regions") {
    const int regions = 96, per = 2048;  // 96 x 2048 rows of 1024: 113 MB, 1.18 MB a region
    Data d(regions * per, 1024, 1 << 21);
    for (int round = 0; round < 12; ++round) {
      if (mode == "stream") {
        double r[2][3];
        for (int threads = 1; threads <= 2; ++threads)
          for (int loop : {0, 8, 16})
            r[threads - 1][loop / 8] = rate(d.bytes, [&] {
              #pragma omp parallel num_threads(threads)
              {
                const int t = omp_get_thread_num(), n0 = d.N / threads * t / 16 * 16;
                d.run(loop, n0, (t == threads - 1 ? d.N : d.N / threads * (t + 1) / 16 * 16) - n0);
              }
            });
        printf("GB/s  1 thread: read %5.1f  groups of 8 %5.1f  of 16 %5.1f | 2 threads: read %5.1f  8 %5.1f  16 %5.1f\n",
               r[0][0], r[0][1], r[0][2], r[1][0], r[1][1], r[1][2]);
      } else {
        double r[4];
        for (int kind = 0; kind < 4; ++kind)  // read, one region, 96 regions, 96 regions prefetching ahead
          r[kind] = rate(d.bytes, [&] {
            for (int c = 0; c < (kind < 2 ? 1 : regions); ++c) {
              const int rows = kind < 2 ? d.N : per, first = kind < 2 ? 0 : c * per;
              #pragma omp parallel num_threads(2)
              {
                const int t = omp_get_thread_num();
                d.run(kind == 0 ? 0 : 8, first + rows / 2 * t, rows / 2);
                if (kind == 3 && c + 1 < regions) {  // 64 KiB of this thread's share of the next region
                  const uint8_t* next = d.W + (size_t(first + per) + per / 2 * t) * d.nb * 18;
                  for (int o = 0; o < 65536; o += 64) __builtin_prefetch(next + o, 0, 2);
                }
              }
            }
          });
        printf("GB/s, 2 threads: read %5.1f  groups of 8: one region %5.1f, %d regions %5.1f, prefetching ahead %5.1f\n",
               r[0], r[1], regions, r[2], r[3]);
      }
      fflush(stdout);
    }
    return 0;
  }
  const int N = argc > 1 ? atoi(argv[1]) : 2048, K = argc > 2 ? atoi(argv[2]) : 1024, reps = argc > 3 ? atoi(argv[3]) : 1000;
  Data d(N, K, 64);
  for (int round = 0; round < 3; ++round) {
    const double t0 = now();
    for (int r = 0; r < reps; ++r) d.run(8, 0, N);
    const double t1 = now();
    for (int r = 0; r < reps; ++r) d.run(16, 0, N);
    const double t2 = now();
    const double w = double(N) * K * reps;
    printf("groups of 8: %5.1f G weights/s   groups of 16: %5.1f G weights/s\n", w / (t1 - t0) / 1e9, w / (t2 - t1) / 1e9);
  }
}
