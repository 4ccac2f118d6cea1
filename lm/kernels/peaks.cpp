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

// `steps` rounds of `step` on ten registers started at `init` (independent chains, kept in registers
// and each round in the loop by the empty asm)
template <class V, class Step>
void chains(int64_t steps, V init, Step step) {
#define QWEN35_TEN(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9)
#define QWEN35_DECL(i) V v##i = init;
#define QWEN35_STEP(i) v##i = step(v##i);
#define QWEN35_KEEP                                                                                     \
  __asm__ volatile("" : "+x"(v0), "+x"(v1), "+x"(v2), "+x"(v3), "+x"(v4), "+x"(v5), "+x"(v6), "+x"(v7), \
                   "+x"(v8), "+x"(v9))
  QWEN35_TEN(QWEN35_DECL)
  for (int64_t s = 0; s < steps; ++s) {
    QWEN35_TEN(QWEN35_STEP)
    QWEN35_KEEP;
  }
#undef QWEN35_TEN
#undef QWEN35_DECL
#undef QWEN35_STEP
#undef QWEN35_KEEP
}

// the ops one thread does in `steps` rounds of ten instructions of `kind`
double ops(const std::string& kind, int64_t steps) {
  if (kind == "fp32") {
#if defined(__AVX512F__)
    const __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-4f);
    chains(steps, _mm512_set1_ps(1e-3f), [&](__m512 v) { return _mm512_fmadd_ps(v, b, c); });
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-4f);
    chains(steps, _mm256_set1_ps(1e-3f), [&](__m256 v) { return _mm256_fmadd_ps(v, b, c); });
#else
    TORCH_CHECK(false, "instruction_peak('fp32') needs an AVX2 + FMA or AVX-512 build");
#endif
    return 10.0 * steps * 2 * W;
  }
#if QWEN35_I8_TILES  // the prefill tiles' instruction: vpdpbusd on 512-bit registers, 64 byte products
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  chains(steps, _mm512_set1_epi32(1), [&](__m512i v) { return _mm512_dpbusd_epi32(v, a, b); });
  return 10.0 * steps * 2 * 64;
#elif QWEN35_VNNI
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5);
  chains(steps, _mm256_set1_epi32(1), [&](__m256i v) { return dpbusd(v, a, b); });
  return 10.0 * steps * 2 * 32;
#elif defined(__AVX2__)
  const __m256i b = _mm256_set1_epi8(5);
  chains(steps, _mm256_set1_epi32(1), [&](__m256i v) { return _mm256_maddubs_epi16(v, b); });
  return 10.0 * steps * 2 * 32;
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
  std::vector<double> done(T, 0.0);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) done[t] = ops(kind, steps);
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  double total = 0;
  for (double o : done) total += o;
  return total / seconds;
}
