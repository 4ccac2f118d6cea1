// A gated full-attention layer for one token per row (decode), from its q/k/v projections to the
// input of o_proj: per-head zero-centred RMSNorm of q and k, partial rotary on their first R dims,
// the new k and v written into the KV cache at each row's position `pos[b]`, attention over
// positions [0, pos[b]] (one pass over the cache, decode_attention.cpp), and the sigmoid output
// gate. Same maths as lm/attention.py's GatedAttention.forward with T = 1.

#include "kernels.h"
#include "vec.h"

using namespace qwen35;

namespace {

// y = x / rms(x) * (1 + w), then rotate y[:R] by (cos, sin) as rotate_half does: for i < R/2,
// y[i] = y[i] cos[i] - y[i + R/2] sin[i] and y[i + R/2] = y[i + R/2] cos[i + R/2] + y[i] sin[i + R/2].
void norm_rotate(const float* x, const float* w, float eps, const float* cos, const float* sin, int64_t R, int64_t D,
                 float* y) {
  rms_norm_row(x, w, eps, 1.f, D, y);
  const int64_t h = R / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float a = y[i], b = y[i + h];
    y[i] = a * cos[i] - b * sin[i];
    y[i + h] = b * cos[i + h] + a * sin[i + h];
  }
}

}  // namespace

// q [B, H*2D] (per head: query then gate), k, v [B, KV*D]; q_norm_w, k_norm_w [D]; cos, sin [B, R];
// k_cache, v_cache [B, KV, max_len, D] contiguous; pos [B] int64; keep [B, max(pos) + 1] bool or
// empty (no mask).
// Returns [B, H*D] = attention output * sigmoid(gate).
at::Tensor attention_token(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor q_norm_w, at::Tensor k_norm_w,
                           double eps, at::Tensor cos, at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache,
                           at::Tensor pos, at::Tensor keep, double scale) {
  for (auto* t : {&q, &k, &v, &q_norm_w, &k_norm_w, &cos, &sin, &k_cache, &v_cache}) check(*t, "attention tensors");
  const int64_t B = q.size(0), KV = k_cache.size(1), L = k_cache.size(2), D = k_cache.size(3), R = cos.size(1);
  const int64_t H = q.size(1) / (2 * D);
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.dim() == 1 && pos.size(0) == B && pos.is_contiguous(),
              "attention token: pos must be int64 [B]");
  const int64_t* pp = pos.data_ptr<int64_t>();
  int64_t last = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(pp[b] >= 0 && pp[b] < L, "attention token: position ", pp[b], " outside the cache of ", L);
    last = std::max(last, pp[b]);
  }
  TORCH_CHECK(q.size(1) == H * 2 * D && k.size(0) == B && k.size(1) == KV * D && v.sizes() == k.sizes() &&
                  k_cache.size(0) == B && v_cache.sizes() == k_cache.sizes() && q_norm_w.numel() == D &&
                  k_norm_w.numel() == D && cos.size(0) == B && sin.sizes() == cos.sizes() && R % 2 == 0 && R <= D,
              "attention token shapes do not match");
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *qw = q_norm_w.data_ptr<float>(), *kw = k_norm_w.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  auto qn = at::empty({B, H, D}, q.options());
  float* qnp = qn.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const float *cb = cp + b * R, *sb = sp + b * R;
    for (int64_t h = 0; h < H; ++h) norm_rotate(qp + (b * H + h) * 2 * D, qw, float(eps), cb, sb, R, D, qnp + (b * H + h) * D);
    for (int64_t h = 0; h < KV; ++h) {
      const int64_t row = ((b * KV + h) * L + pp[b]) * D;
      norm_rotate(kp + (b * KV + h) * D, kw, float(eps), cb, sb, R, D, kc + row);
      std::copy(vp + (b * KV + h) * D, vp + (b * KV + h + 1) * D, vc + row);
    }
  }
  using at::indexing::Slice;
  auto out = decode_attention(qn, k_cache.index({Slice(), Slice(), Slice(0, last + 1)}),
                              v_cache.index({Slice(), Slice(), Slice(0, last + 1)}), keep, scale, pos + 1);
  float* op = out.data_ptr<float>();  // [B, H, D] -> gated in place
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const float* gate = qp + (b * H + h) * 2 * D + D;
      float* o = op + (b * H + h) * D;
      for (int64_t i = 0; i < D; ++i) o[i] *= sigmoid(gate[i]);
    }
  return out.view({B, H * D});
}
