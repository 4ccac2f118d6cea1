// Attention of one new token per row over the KV cache (decode), GQA: the rep = H / KV query heads
// of a KV head are scored against each key in one pass over K, then the values are summed in one
// pass over V, so the cache is read once per step at streaming speed. Any head ratio that
// transformers accepts (e.g. 6 for Qwen3.5-27B's 24 query / 4 KV heads).

#include "vec.h"

#include <vector>

using namespace qwen35;

namespace {

// Value vectors per accumulator block of `rep` heads: 4 (64 columns) with AVX-512's 32 registers;
// with AVX2's 16, as many as keep rep x blocks accumulators within 12 registers (a power of two, so
// that the head dims in use, multiples of 32, have no ragged tail).
constexpr int value_blocks(int rep) { return W == 16 || rep <= 3 ? 4 : rep <= 6 ? 2 : 1; }

template <int rep>  // a compile-time count, so that the accumulators live in registers
void attend(const float* q, const float* K, const float* Vv, int64_t L, int64_t D, const bool* keep, float scale,
            float* out, float* scores) {
  // scores[r * L + l] = scale * q_r . K[l]  (-inf where masked)
  for (int64_t l = 0; l < L; ++l) {
    const float* kl = K + l * D;
    __builtin_prefetch(kl + 8 * D, 0, 3);
    if (keep && !keep[l]) {
      for (int r = 0; r < rep; ++r) scores[r * L + l] = -INFINITY;
      continue;
    }
    vec a[rep];
    for (int r = 0; r < rep; ++r) a[r] = vec{};
    int64_t d = 0;
    for (; d + V <= D; d += V) {
      const vec x = load(kl + d);
      for (int r = 0; r < rep; ++r) a[r] += x * load(q + r * D + d);
    }
    for (int r = 0; r < rep; ++r) {
      float s = hsum(a[r]);
      for (int64_t j = d; j < D; ++j) s += kl[j] * q[r * D + j];
      scores[r * L + l] = s * scale;
    }
  }
  // softmax per query head
  for (int r = 0; r < rep; ++r) {
    float* s = scores + r * L;
    const float m = *std::max_element(s, s + L);
    float sum = 0.f;
    for (int64_t l = 0; l < L; ++l) sum += (s[l] = std::exp(s[l] - m));
    const float inv = 1.f / sum;
    for (int64_t l = 0; l < L; ++l) s[l] *= inv;
  }
  // out_r = sum_l p_r[l] V[l], DC columns at a time with rep x DC / V accumulators in registers
  constexpr int DC = value_blocks(rep) * V;
  for (int64_t d0 = 0; d0 < D; d0 += DC) {
    const int64_t width = std::min<int64_t>(DC, D - d0);
    if (width < DC) {  // a ragged tail (D not a multiple of DC): scalar
      for (int r = 0; r < rep; ++r)
        for (int64_t d = d0; d < d0 + width; ++d) {
          float acc = 0.f;
          for (int64_t l = 0; l < L; ++l) acc += scores[r * L + l] * Vv[l * D + d];
          out[r * D + d] = acc;
        }
      continue;
    }
    vec acc[rep][DC / V];
    for (int r = 0; r < rep; ++r)
      for (int j = 0; j < DC / V; ++j) acc[r][j] = vec{};
    for (int64_t l = 0; l < L; ++l) {
      const float* vl = Vv + l * D + d0;
      __builtin_prefetch(vl + 8 * D, 0, 3);
      for (int j = 0; j < DC / V; ++j) {
        const vec x = load(vl + j * V);
        for (int r = 0; r < rep; ++r) acc[r][j] += x * scores[r * L + l];
      }
    }
    for (int r = 0; r < rep; ++r)
      for (int j = 0; j < DC / V; ++j) store(out + r * D + d0 + j * V, acc[r][j]);
  }
}

// `rep` query heads (any count) of one KV head: the compiled counts directly, others in pieces of
// at most 8 heads (each piece reads the KV head once more).
void attend_heads(int64_t rep, const float* q, const float* K, const float* Vv, int64_t L, int64_t D,
                  const bool* keep, float scale, float* out, float* scores) {
  switch (rep) {
    case 1: return attend<1>(q, K, Vv, L, D, keep, scale, out, scores);
    case 2: return attend<2>(q, K, Vv, L, D, keep, scale, out, scores);
    case 3: return attend<3>(q, K, Vv, L, D, keep, scale, out, scores);
    case 4: return attend<4>(q, K, Vv, L, D, keep, scale, out, scores);
    case 5: return attend<5>(q, K, Vv, L, D, keep, scale, out, scores);
    case 6: return attend<6>(q, K, Vv, L, D, keep, scale, out, scores);
    case 7: return attend<7>(q, K, Vv, L, D, keep, scale, out, scores);
    case 8: return attend<8>(q, K, Vv, L, D, keep, scale, out, scores);
    case 16: return attend<16>(q, K, Vv, L, D, keep, scale, out, scores);
    default:
      for (int64_t r0 = 0; r0 < rep; r0 += 8)
        attend_heads(std::min<int64_t>(8, rep - r0), q + r0 * D, K, Vv, L, D, keep, scale, out + r0 * D, scores);
  }
}

}  // namespace

// q [B, H, D]; k, v [B, KV, L, D] (views into the cache: rows contiguous, any batch/head strides);
// keep [B, L] bool or an empty tensor (all keys valid); lengths [B] int64 (row b attends over its
// first lengths[b] keys) or an empty tensor (all L) -> [B, H, D].
at::Tensor decode_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor keep, double scale,
                            at::Tensor lengths) {
  check(q, "q");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KV = k.size(1), L = k.size(2);
  for (auto* t : {&k, &v})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->size(0) == B && t->size(1) == KV &&
                    t->size(2) == L && t->size(3) == D && t->stride(3) == 1 && t->stride(2) == D,
                "k, v must be float32 [B, KV, L, D] with contiguous rows");
  const int64_t rep = H / KV;
  TORCH_CHECK(KV > 0 && H % KV == 0 && L > 0, "query heads must be a multiple of the KV heads");
  const bool masked = keep.numel() > 0;
  if (masked) TORCH_CHECK(keep.scalar_type() == at::kBool && keep.is_contiguous() && keep.numel() == B * L, "bad mask");
  const bool ragged = lengths.numel() > 0;
  if (ragged)
    TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.numel() == B && lengths.is_contiguous(), "bad lengths");
  const int64_t* lp = ragged ? lengths.data_ptr<int64_t>() : nullptr;
  for (int64_t b = 0; ragged && b < B; ++b) TORCH_CHECK(lp[b] > 0 && lp[b] <= L, "a row's length is outside the cache");
  auto out = at::empty({B, H, D}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const bool* mp = masked ? keep.data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * KV, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(rep * L);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / KV, h = t % KV;
      const float *qh = qp + (b * H + h * rep) * D, *kh = kp + b * k.stride(0) + h * k.stride(1);
      const float* vh = vp + b * v.stride(0) + h * v.stride(1);
      const bool* mh = mp ? mp + b * L : nullptr;
      float* oh = op + (b * H + h * rep) * D;
      attend_heads(rep, qh, kh, vh, lp ? lp[b] : L, D, mh, float(scale), oh, scores.data());
    }
  });
  return out;
}
