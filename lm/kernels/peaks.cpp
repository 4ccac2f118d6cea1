// The peak rates of the instructions the prefill products multiply with, run in registers on every
// thread at once: the limits bench/ttft.py gives a figure's share of where torch's GEMM of that
// format is not native to the CPU (its int8 GEMM without VNNI or AMX). "fp32": fused multiply-adds
// of W floats (2 ops a lane); "int8": the int8 products' dot instruction, vpdpbusd in VNNI builds
// (4 byte products a 32-bit lane) or vpmaddubsw in AVX2 ones (2 a 16-bit lane), 2 ops a byte
// product. Ten independent chains, more than latency x throughput on the CPUs this project meets.

#include <ATen/Parallel.h>

#include <chrono>

#include "int8_dot.h"
#include "kernels.h"

using namespace qwen35;

namespace {

#define QWEN35_TEN(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9)
// keeps the ten chains in registers and each step in the loop
#define QWEN35_KEEP(v)                                                                                       \
  __asm__ volatile("" : "+x"(v##0), "+x"(v##1), "+x"(v##2), "+x"(v##3), "+x"(v##4), "+x"(v##5), "+x"(v##6), \
                   "+x"(v##7), "+x"(v##8), "+x"(v##9))

// ops of one thread's `steps` x 10 instructions; returns the ops it did
double fma_chains(int64_t steps) {
#if defined(__AVX512F__)
  const __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-4f);
#define DECL(i) __m512 f##i = _mm512_set1_ps(i * 1e-3f);
#define STEP(i) f##i = _mm512_fmadd_ps(f##i, b, c);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-4f);
#define DECL(i) __m256 f##i = _mm256_set1_ps(i * 1e-3f);
#define STEP(i) f##i = _mm256_fmadd_ps(f##i, b, c);
#endif
#ifdef DECL
  QWEN35_TEN(DECL)
  for (int64_t s = 0; s < steps; ++s) {
    QWEN35_TEN(STEP)
    QWEN35_KEEP(f);
  }
  QWEN35_KEEP(f);
  return 10.0 * steps * 2 * W;
#undef DECL
#undef STEP
#else
  TORCH_CHECK(false, "instruction_peak('fp32') needs an AVX2 + FMA or AVX-512 build");
  return 0;
#endif
}

double int8_chains(int64_t steps) {
#if QWEN35_I8_TILES  // the prefill tiles' instruction: vpdpbusd on 512-bit registers
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
#define DECL(i) __m512i v##i = _mm512_set1_epi32(i);
#define STEP(i) v##i = _mm512_dpbusd_epi32(v##i, a, b);
  constexpr double products = 64;
#elif QWEN35_VNNI
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5);
#define DECL(i) __m256i v##i = _mm256_set1_epi32(i);
#define STEP(i) v##i = dpbusd(v##i, a, b);
  constexpr double products = 32;
#elif defined(__AVX2__)
  const __m256i b = _mm256_set1_epi8(5);
#define DECL(i) __m256i v##i = _mm256_set1_epi32(i);
#define STEP(i) v##i = _mm256_maddubs_epi16(v##i, b);
  constexpr double products = 32;
#endif
#ifdef DECL
  QWEN35_TEN(DECL)
  for (int64_t s = 0; s < steps; ++s) {
    QWEN35_TEN(STEP)
    QWEN35_KEEP(v);
  }
  QWEN35_KEEP(v);
  return 10.0 * steps * 2 * products;
#undef DECL
#undef STEP
#else
  TORCH_CHECK(false, "instruction_peak('int8') needs an AVX2 build");
  return 0;
#endif
}

}  // namespace

double instruction_peak(const std::string& kind, int64_t steps) {
  TORCH_CHECK(kind == "fp32" || kind == "int8", "instruction_peak: kind must be 'fp32' or 'int8', not '", kind, "'");
  TORCH_CHECK(steps > 0, "instruction_peak: steps must be positive");
  const int64_t T = at::get_num_threads();
  std::vector<double> ops(T, 0.0);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) ops[t] = kind == "fp32" ? fma_chains(steps) : int8_chains(steps);
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  double total = 0;
  for (double o : ops) total += o;
  return total / seconds;
}
