// Attention of one new token per row over the KV cache (decode), GQA: the rep = H / KV query heads
// of a KV head are scored against each key in one pass over K, then the values are summed in one
// pass over V, so the cache is read once per step at streaming speed. Any head ratio that
// transformers accepts (e.g. 6 for Qwen3.5-27B's 24 query / 4 KV heads).

#include "kernels.h"
#include "vec.h"

#include <vector>

using namespace qwen35;

namespace {

// The heads of a KV head go through both passes in groups whose accumulators fit in registers:
// up to 8 heads per key of the score pass (one vector each), up to 4 heads of the value pass with
// `value_blocks` vectors of columns each (4 with AVX-512's 32 registers; with AVX2's 16, as many as
// keep the group's accumulators within 12, a power of two so that the head dims in use, multiples
// of 32, have no ragged tail). Any head ratio works; 8 heads of 256 at 8,192 keys (4 layers x 2 KV
// heads) took 16.8 ms as one group of 8 per pass, whole passes over the cache and std::exp, and
// 8.2 ms as below; 4 heads 8.5 -> 4.9 ms.
constexpr int SCORE_GROUP = 8, VALUE_GROUP = 4;
constexpr int value_blocks(int heads) { return W == 16 || heads <= 3 ? 4 : 2; }

// Keys per tile of the value pass: a tile's values (128 KiB at head dim 256) stay in L2 while its
// column blocks pass over it, and the next tile's lines are prefetched meanwhile. One pass per
// column block over the whole cache had read V from memory D / (blocks x V) times over.
constexpr int64_t VALUE_TILE = 128;
constexpr int64_t LINE = 64 / sizeof(float);

// exp(x) for x <= 0 in float32 vectors (vec.h's vexp), 0 below -87.3 (-inf included). std::exp
// one value at a time took as long as a fifth of the whole decode attention.
inline vec exp_nonpositive(vec x) {
  typedef int32_t ivec __attribute__((vector_size(sizeof(vec))));
  return (vec)((ivec)vexp(x) & (x > -87.3f));  // the comparison: all ones where true
}

// p[l * rep + r] = exp(p[l * rep + r] - m[r]) for l < L, and sum[r] = the sum of head r's (a head
// whose every score is -inf, m[r] = -inf: all 0). Whole runs of V keys (rep x V floats, where the
// heads' pattern repeats) go through vectors.
void softmax_numerators(float* p, int64_t L, int64_t rep, const float* m, float* sum) {
  std::vector<float> mp(rep * V), acc(rep * V, 0.f);
  for (int i = 0; i < rep * V; ++i) mp[i] = m[i % rep] == -INFINITY ? 0.f : m[i % rep];
  int64_t l = 0;
  for (; l + V <= L; l += V) {
    float* row = p + l * rep;
    for (int j = 0; j < rep; ++j) {
      const vec e = exp_nonpositive(load(row + j * V) - load(mp.data() + j * V));
      store(row + j * V, e);
      store(acc.data() + j * V, load(acc.data() + j * V) + e);
    }
  }
  for (int r = 0; r < rep; ++r) sum[r] = 0.f;
  for (int i = 0; i < rep * V; ++i) sum[i % rep] += acc[i];
  for (; l < L; ++l)
    for (int r = 0; r < rep; ++r) sum[r] += (p[l * rep + r] = std::exp(p[l * rep + r] - mp[r]));
}

// p[r] = scale * q_r . k for the G heads r < G of q (rows of D), m[r] = max(m[r], p[r]).
template <int G>
inline void score_heads(const float* q, const float* k, int64_t D, float scale, float* p, float* m) {
  vec a[G];
  for (int r = 0; r < G; ++r) a[r] = vec{};
  int64_t d = 0;
  for (; d + V <= D; d += V) {
    const vec x = load(k + d);
    for (int r = 0; r < G; ++r) a[r] += x * load(q + r * D + d);
  }
  for (int r = 0; r < G; ++r) {
    float s = hsum(a[r]);
    for (int64_t j = d; j < D; ++j) s += k[j] * q[r * D + j];
    p[r] = s * scale;
    m[r] = std::max(m[r], p[r]);
  }
}

// out[r] += sum_{l0 <= l < l1} p[l * rep + r] V[l] for the G heads r < G (p and out offset to the
// group's first head), DC columns at a time with G x DC / V accumulators in registers. `next`
// walks the next tile's lines: `per_step` prefetched per key of each column pass.
template <int G>
void value_heads(const float* p, int64_t rep, const float* Vv, int64_t l0, int64_t l1, int64_t D, float* out,
                 const float*& next, const float* next_end, int64_t per_step) {
  constexpr int DC = value_blocks(G) * V;
  for (int64_t d0 = 0; d0 < D; d0 += DC) {
    if (D - d0 < DC) {  // a ragged tail (D not a multiple of DC): scalar
      for (int r = 0; r < G; ++r)
        for (int64_t d = d0; d < D; ++d) {
          float acc = out[r * D + d];
          for (int64_t l = l0; l < l1; ++l) acc += p[l * rep + r] * Vv[l * D + d];
          out[r * D + d] = acc;
        }
      continue;
    }
    vec acc[G][DC / V];
    for (int r = 0; r < G; ++r)
      for (int j = 0; j < DC / V; ++j) acc[r][j] = load(out + r * D + d0 + j * V);
    for (int64_t l = l0; l < l1; ++l) {
      const float* vl = Vv + l * D + d0;
      for (int64_t i = 0; i < per_step && next < next_end; ++i, next += LINE) __builtin_prefetch(next, 0, 3);
      for (int j = 0; j < DC / V; ++j) {
        const vec x = load(vl + j * V);
        for (int r = 0; r < G; ++r) acc[r][j] += x * p[l * rep + r];
      }
    }
    for (int r = 0; r < G; ++r)
      for (int j = 0; j < DC / V; ++j) store(out + r * D + d0 + j * V, acc[r][j]);
  }
}

// The `rep` query heads q [rep, D] of one KV head over keys K, V [L, D], unnormalised: m[r] = head
// r's largest score, sum[r] = sum_l e^(s_rl - m_r), out[r] = sum_l e^(s_rl - m_r) V[l] (a head
// with every key masked: m = -inf, sum and out 0); p: rep x L floats of scratch.
void attend_part(int64_t rep, const float* q, const float* K, const float* Vv, int64_t L, int64_t D,
                 const bool* keep, float scale, float* out, float* m, float* sum, float* p) {
  // p[l * rep + r] = scale * q_r . K[l] (-inf where masked): key-major, so that the value pass
  // reads one key's weights from one line; m[r] = head r's largest
  std::fill(m, m + rep, -INFINITY);
  for (int64_t l = 0; l < L; ++l) {
    const float* kl = K + l * D;
    __builtin_prefetch(kl + 8 * D, 0, 3);
    float* pl = p + l * rep;
    if (keep && !keep[l]) {
      std::fill(pl, pl + rep, -INFINITY);
      continue;
    }
    for (int64_t r = 0; r < rep; r += SCORE_GROUP) {
      const float* qr = q + r * D;
      switch (std::min<int64_t>(SCORE_GROUP, rep - r)) {
        case 1: score_heads<1>(qr, kl, D, scale, pl + r, m + r); break;
        case 2: score_heads<2>(qr, kl, D, scale, pl + r, m + r); break;
        case 3: score_heads<3>(qr, kl, D, scale, pl + r, m + r); break;
        case 4: score_heads<4>(qr, kl, D, scale, pl + r, m + r); break;
        case 5: score_heads<5>(qr, kl, D, scale, pl + r, m + r); break;
        case 6: score_heads<6>(qr, kl, D, scale, pl + r, m + r); break;
        case 7: score_heads<7>(qr, kl, D, scale, pl + r, m + r); break;
        default: score_heads<8>(qr, kl, D, scale, pl + r, m + r); break;
      }
    }
  }
  // softmax per query head: the numerators here, the division where the parts are combined
  softmax_numerators(p, L, rep, m, sum);
  // out_r = sum_l p_r[l] V[l], key tile by key tile (a tile's rows are one contiguous block
  // of V; its successor's lines are prefetched evenly over the tile's column passes)
  const int64_t passes = (rep + VALUE_GROUP - 1) / VALUE_GROUP * ((D + V - 1) / V) / value_blocks(VALUE_GROUP);
  const int64_t per_step = std::max<int64_t>(1, (D / LINE + passes - 1) / std::max<int64_t>(1, passes));
  std::fill(out, out + rep * D, 0.f);
  for (int64_t l0 = 0; l0 < L; l0 += VALUE_TILE) {
    const int64_t l1 = std::min(L, l0 + VALUE_TILE);
    const float *next = Vv + l1 * D, *next_end = Vv + std::min(L, l1 + VALUE_TILE) * D;
    for (int64_t r = 0; r < rep; r += VALUE_GROUP) {
      const float* pr = p + r;
      float* o = out + r * D;
      switch (std::min<int64_t>(VALUE_GROUP, rep - r)) {
        case 1: value_heads<1>(pr, rep, Vv, l0, l1, D, o, next, next_end, per_step); break;
        case 2: value_heads<2>(pr, rep, Vv, l0, l1, D, o, next, next_end, per_step); break;
        case 3: value_heads<3>(pr, rep, Vv, l0, l1, D, o, next, next_end, per_step); break;
        default: value_heads<4>(pr, rep, Vv, l0, l1, D, o, next, next_end, per_step); break;
      }
    }
  }
}

// Keys per part when one KV head's keys are split between threads (fewer rows x KV heads than
// threads: batch 1 on a machine with more cores than KV heads): at least 4 value tiles a part.
constexpr int64_t MIN_PART_KEYS = 4 * VALUE_TILE;

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
  decode_attention_into({B, H, KV, L, D}, q.data_ptr<float>(), k.data_ptr<float>(), k.stride(0), k.stride(1),
                        v.data_ptr<float>(), v.stride(0), v.stride(1), masked ? keep.data_ptr<bool>() : nullptr, lp,
                        float(scale), out.data_ptr<float>());
  return out;
}

void decode_attention_into(const AttentionShape& shape, const float* qp, const float* kp, int64_t k_row_stride,
                           int64_t k_head_stride, const float* vp, int64_t v_row_stride, int64_t v_head_stride,
                           const bool* mp, const int64_t* lp, float scale, float* op) {
  const int64_t B = shape.B, H = shape.H, D = shape.D, KV = shape.KV, L = shape.L, rep = H / KV;
  // Tasks: (row, KV head, part); a KV head's keys are split into `parts` when there are fewer
  // (row, KV head) pairs than threads, each part's softmax kept unnormalised (its max, sum and
  // weighted values) and the parts combined at the end, so that every thread reads its share of
  // the cache (flash-decoding's split). The parts' results live in the calling thread's buffers,
  // kept between calls.
  const int64_t pairs = B * KV, threads = at::get_num_threads();
  const int64_t parts =
      pairs >= threads ? 1 : std::max<int64_t>(1, std::min((threads + pairs - 1) / pairs, L / MIN_PART_KEYS));
  thread_local std::vector<float> outs_, ms_, sums_;
  outs_.resize(pairs * parts * rep * D), ms_.resize(pairs * parts * rep), sums_.resize(pairs * parts * rep);
  float *outs = outs_.data(), *ms = ms_.data(), *sums = sums_.data();
  at::parallel_for(0, pairs * parts, 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> scores;
    scores.resize(rep * ((L + parts - 1) / parts + 1));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / parts / KV, h = t / parts % KV, part = t % parts;
      const int64_t length = lp ? lp[b] : L, l0 = length * part / parts, l1 = length * (part + 1) / parts;
      const float *qh = qp + (b * H + h * rep) * D, *kh = kp + b * k_row_stride + h * k_head_stride + l0 * D;
      const float* vh = vp + b * v_row_stride + h * v_head_stride + l0 * D;
      const bool* mh = mp ? mp + b * L + l0 : nullptr;
      attend_part(rep, qh, kh, vh, l1 - l0, D, mh, scale, &outs[t * rep * D], &ms[t * rep], &sums[t * rep],
                  scores.data());
    }
  });
  // out_r = sum_parts e^(m_part - M) out_part / sum_parts e^(m_part - M) sum_part, M the largest m
  // (a few thousand floats: in this thread); (row b, KV head h) -> query heads h * rep.. of row b
  for (int64_t i = 0; i < pairs * rep; ++i) {
    const int64_t pair = i / rep, r = i % rep;
    float M = -INFINITY;
    for (int64_t part = 0; part < parts; ++part) M = std::max(M, ms[(pair * parts + part) * rep + r]);
    float total = 0.f;
    float* o = op + i * D;
    std::fill(o, o + D, 0.f);
    for (int64_t part = 0; part < parts; ++part) {
      const int64_t j = (pair * parts + part) * rep + r;
      const float w = ms[j] == -INFINITY ? 0.f : std::exp(ms[j] - M);  // 1 for the part holding M
      total += w * sums[j];
      const float* po = &outs[j * D];
      for (int64_t d = 0; d < D; ++d) o[d] += w * po[d];
    }
    const float inv = 1.f / total;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}
