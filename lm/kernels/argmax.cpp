// Greedy sampling's argmax over a row of logits, with numpy's rules: the first largest value, or the
// first NaN where there is one. The logits were just written by the LM head's threads, so each
// thread scans a part in one vector pass. Called right after a batch-1 int4 decode step of the
// benchmark model (vocabulary 248,320; the interpreter's data cache-cold) it takes ~40 us where
// numpy's argmax took ~75 us (a scalar second pass for the index took ~55 us).

#include "vec.h"

using namespace qwen35;

namespace {

struct Best {
  int64_t index = -1;  // -1: empty part
  float value = 0.f;
  bool nan = false;
};

// The part x[i0, i1) in one vector pass: per lane the largest value and the first index that has
// it (a strictly larger value replaces it), and whether a NaN was seen; then the lanes' best, the
// smallest index among equal values. A NaN (rare) sends the part to a scan for the first one.
Best scan(const float* x, int64_t i0, int64_t i1) {
  Best b;
  if (i0 >= i1) return b;
  typedef int32_t ivec __attribute__((vector_size(sizeof(vec))));
  vec m = vec{} + x[i0];
  ivec at = ivec{} + int32_t(i0), nan = ivec{}, lane;
  for (int j = 0; j < V; ++j) lane[j] = j;
  int64_t i = i0;
  for (; i + V <= i1; i += V) {
    const vec v = load(x + i);
    const ivec larger = v > m;
    m = larger ? v : m;
    at = larger ? lane + int32_t(i) : at;
    nan |= v != v;
  }
  bool any_nan = false;
  for (int j = 0; j < V; ++j) {
    any_nan |= nan[j] != 0;
    if (b.index < 0 || m[j] > b.value || (m[j] == b.value && at[j] < b.index)) b = {at[j], m[j], false};
  }
  for (; i < i1; ++i) {
    any_nan |= x[i] != x[i];
    if (x[i] > b.value) b = {i, x[i], false};
  }
  if (any_nan)
    for (int64_t k = i0; k < i1; ++k)
      if (x[k] != x[k]) return {k, x[k], true};
  return b;
}

// The argmax of x[0, n) on all threads (one part each from 32k values on).
int64_t argmax_of(const float* p, int64_t n) {
  const int64_t T = n < (1 << 15) ? 1 : at::get_num_threads();
  std::vector<Best> parts(T);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) parts[t] = scan(p, n * t / T, n * (t + 1) / T);
  });
  Best best;  // the parts in order: the first NaN, else the first of the largest
  for (const Best& b : parts) {
    if (b.index < 0) continue;
    if (b.nan) return b.index;
    if (best.index < 0 || b.value > best.value) best = b;
  }
  return best.index;
}

}  // namespace

int64_t argmax(at::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 1 && x.is_contiguous() && x.numel() > 0 &&
                  x.numel() < (int64_t(1) << 31),
              "argmax: x must be a non-empty contiguous float32 vector of fewer than 2^31 values");
  return argmax_of(x.data_ptr<float>(), x.numel());
}

std::vector<int64_t> argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) > 0 &&
                  x.size(1) < (int64_t(1) << 31),
              "argmax_rows: x must be a float32 CPU [B, V] tensor with 0 < V < 2^31");
  x = x.contiguous();
  std::vector<int64_t> out(x.size(0));
  const float* p = x.data_ptr<float>();
  for (int64_t b = 0; b < x.size(0); ++b) out[b] = argmax_of(p + b * x.size(1), x.size(1));
  return out;
}

// Sampling's top-k: the k largest values of a row of logits and their indices, best first, ranked as
// torch.topk ranks distinct values (a NaN above every number); equal values by index, the first
// first. One pass against a running threshold, the k-th best value so far: most values lie at or
// below it and cost one vector compare; the others go to a buffer that is cut back to the k best
// whenever it holds 4k. Over a 248,320-token vocabulary of random logits on 2 Zen 3 cores: 0.11 ms
// for k = 20 where torch.topk took 0.5-0.8 ms (a sampled row's largest cost beside the decode step),
// 1.0 ms for k = 1,024 against 1.1-1.5 ms.
std::tuple<at::Tensor, at::Tensor> largest_k(at::Tensor x, int64_t k) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 1 && x.is_contiguous() &&
                  x.numel() < (int64_t(1) << 31),
              "largest_k: x must be a contiguous float32 CPU vector of fewer than 2^31 values");
  TORCH_CHECK(k >= 0 && k <= x.numel(), "largest_k: k must be in [0, ", x.numel(), "], not ", k);
  const float* p = x.data_ptr<float>();
  const int64_t n = x.numel();
  auto better = [p](int64_t a, int64_t b) {  // a ranks before b
    const float va = p[a], vb = p[b];
    const bool na = va != va, nb = vb != vb;
    if (na != nb) return na;
    if (!na && va != vb) return va > vb;
    return a < b;
  };
  std::vector<int64_t> kept;
  kept.reserve(4 * k + 16);
  float thr = 0.f;  // the k-th best value kept: a later value enters if larger, or NaN
  bool full = false;  // whether all kept values are NaN: no later value can enter
  auto cut = [&] {
    std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), better);
    kept.resize(k);
    thr = p[kept[k - 1]];  // nth_element put the k-th best there
    full = thr != thr;
  };
  int64_t i = std::min(n, k);
  for (int64_t j = 0; j < i; ++j) kept.push_back(j);
  if (k > 0 && i < n) {
    cut();
    const size_t cap = 4 * size_t(k);
#if defined(__AVX2__)
    __m256 t = _mm256_set1_ps(thr);
    for (; !full && i + 8 <= n; i += 8) {
      int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + i), t, _CMP_NLE_UQ));  // > thr, or NaN
      for (; mask; mask &= mask - 1) kept.push_back(i + __builtin_ctz(mask));
      if (kept.size() >= cap) {
        cut();
        t = _mm256_set1_ps(thr);
      }
    }
#endif
    for (; !full && i < n; ++i) {
      if (!(p[i] <= thr)) kept.push_back(i);
      if (kept.size() >= cap) cut();
    }
  }
  std::sort(kept.begin(), kept.end(), better);
  kept.resize(std::min<int64_t>(k, kept.size()));
  auto values = at::empty({int64_t(kept.size())}, x.options());
  auto indices = at::empty({int64_t(kept.size())}, x.options().dtype(at::kLong));
  float* v = values.data_ptr<float>();
  int64_t* at = indices.data_ptr<int64_t>();
  for (size_t j = 0; j < kept.size(); ++j) v[j] = p[at[j] = kept[j]];
  return {values, indices};
}
