// How fast FMAs run when each takes its x operand from a load, by where x lies: the measurement
// behind lm/kernels/vec.h's block_row_pairs (products of 3-8 rows of x with float32 / bf16 rows on
// AVX2). Not used by the pipeline. Three loops, 8 chains of 256-bit FMAs each, one thread:
//   stride S: each FMA loads x from one of 8 rows S bytes apart (dot_row_fmt's loads: x's rows of
//             K = 1024 floats lie 4096 bytes apart), over the rows' first 1 KiB;
//   sweep X:  each FMA loads x from a working set of X bytes swept in order, a bf16 weight vector
//             converted every 8 FMAs (dot_row_fmt with x packed);
//   pairs X:  each load of x feeds two FMAs (two weight rows), over X bytes (block_row_pairs).
//
//     g++ -O2 -mavx2 -mfma -o /tmp/x_loads bench/x_loads.cpp && /tmp/x_loads
//
// Measured on the 2-core AMD EPYC Zen 3 (family 25 model 1) VM of the 26th session, G MAC/s of one
// core over several runs (peak: 2 FMAs a cycle, 46-50): stride 128 41-48, 1024 33-45, 2048 17-21,
// 4096 9-15, 4160 16-19, 5120 31-37; sweep 1-4 KiB 36-42, 8-32 KiB 17-23; pairs 4 KiB 29-36, 16 KiB
// 25-33. An FMA with a load from more than 4 KiB of x issues at about one a cycle there, so a product
// loads each x vector once for two weight rows (docs/kernel-decisions.md).
#include <chrono>
#include <cstdio>
#include <initializer_list>

alignas(4096) static float xs[16384];
alignas(4096) static unsigned short ws[16384];

#define F(o, r) "vfmadd231ps " #o "(%0), %%ymm12, %%ymm" #r "\n\t"
#define STRIDED(o) F(o, 0) "vfmadd231ps " #o "(%0,%1,1), %%ymm12, %%ymm1\n\t" \
  "vfmadd231ps " #o "(%0,%1,2), %%ymm12, %%ymm2\n\t" "vfmadd231ps " #o "(%2), %%ymm12, %%ymm3\n\t" \
  "vfmadd231ps " #o "(%0,%1,4), %%ymm12, %%ymm4\n\t" "vfmadd231ps " #o "(%2,%1,2), %%ymm12, %%ymm5\n\t" \
  "vfmadd231ps " #o "(%3), %%ymm12, %%ymm6\n\t" "vfmadd231ps " #o "(%3,%1,1), %%ymm12, %%ymm7\n\t"
#define SWEPT(j) F(j + 0, 0) F(j + 128, 1) F(j + 256, 2) F(j + 384, 3) F(j + 512, 4) F(j + 640, 5) F(j + 768, 6) F(j + 896, 7)
#define CVT(o) "vpmovzxwd " #o "(%1), %%ymm12\n\t vpslld $16, %%ymm12, %%ymm12\n\t"
#define G(o, r) "vmovups " #o "(%0), %%ymm14\n\t vfmadd231ps %%ymm14, %%ymm12, %%ymm" #r "\n\t vfmadd231ps %%ymm14, %%ymm13, %%ymm1" #r "\n\t"
#define PAIRED(j) G(j + 0, 0) G(j + 128, 1) G(j + 256, 2) G(j + 384, 3)
#define CVT2(o) CVT(o) "vpmovzxwd " #o "+2048(%1), %%ymm13\n\t vpslld $16, %%ymm13, %%ymm13\n\t"
#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14"

template <class Body>
static double rate(long macs_per_call, Body body) {
  const long calls = 20000000;
  const auto start = std::chrono::steady_clock::now();
  for (long i = 0; i < calls; ++i) body(i);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return calls * macs_per_call / s / 1e9;
}

int main() {
  for (long stride : {128L, 1024L, 2048L, 4096L, 4160L, 5120L}) {
    const double r = rate(4 * 64, [&](long i) {
      const char* p = reinterpret_cast<const char*>(xs) + (i & 7) * 128;
      asm volatile(STRIDED(0) STRIDED(32) STRIDED(64) STRIDED(96)
                   :: "r"(p), "r"(stride), "r"(p + 3 * stride), "r"(p + 6 * stride) : CLOBBER);
    });
    std::printf("stride %5ld bytes: %5.1f G MAC/s\n", stride, r);
  }
  for (long span : {1024L, 4096L, 8192L, 16384L, 32768L}) {
    const double r = rate(4 * 64, [&](long i) {
      const char* p = reinterpret_cast<const char*>(xs) + (i * 1024 & (span - 1));
      const char* q = reinterpret_cast<const char*>(ws) + (i * 64 & 2047);
      asm volatile(CVT(0) SWEPT(0) CVT(16) SWEPT(32) CVT(32) SWEPT(64) CVT(48) SWEPT(96) :: "r"(p), "r"(q) : CLOBBER);
    });
    std::printf("sweep %5ld bytes:  %5.1f G MAC/s\n", span, r);
  }
  for (long span : {4096L, 16384L}) {
    const double r = rate(4 * 64, [&](long i) {
      const char* p = reinterpret_cast<const char*>(xs) + (i * 512 & (span - 1));
      const char* q = reinterpret_cast<const char*>(ws) + (i * 64 & 2047);
      asm volatile(CVT2(0) PAIRED(0) CVT2(16) PAIRED(32) CVT2(32) PAIRED(64) CVT2(48) PAIRED(96) :: "r"(p), "r"(q) : CLOBBER);
    });
    std::printf("pairs %5ld bytes:  %5.1f G MAC/s\n", span, r);
  }
}
