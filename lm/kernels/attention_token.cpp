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
  check_positions(pos, keep, B, "attention token");
  TORCH_CHECK(q.size(1) == H * 2 * D && k.size(0) == B && k.size(1) == KV * D && v.sizes() == k.sizes() &&
                  k_cache.size(0) == B && v_cache.sizes() == k_cache.sizes() && q_norm_w.numel() == D &&
                  k_norm_w.numel() == D && cos.size(0) == B && sin.sizes() == cos.sizes() && R % 2 == 0 && R <= D,
              "attention token shapes do not match");
  auto out = at::empty({B, H * D}, q.options());
  attention_token_into({B, H, KV, L, D}, R, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                       q_norm_w.data_ptr<float>(), k_norm_w.data_ptr<float>(), float(eps), cos.data_ptr<float>(),
                       sin.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), pos.data_ptr<int64_t>(),
                       keep.numel() ? keep.data_ptr<bool>() : nullptr, keep.numel() ? keep.size(-1) : 0, scale,
                       out.data_ptr<float>());
  return out;
}

void attention_token_into(const AttentionShape& shape, int64_t R, const float* qp, const float* kp, const float* vp,
                          const float* qw, const float* kw, float eps, const float* cp, const float* sp, float* kc,
                          float* vc, const int64_t* pp, const bool* keep, int64_t keep_keys, double scale,
                          float* op) {
  const int64_t B = shape.B, H = shape.H, KV = shape.KV, L = shape.L, D = shape.D;
  int64_t last = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(pp[b] >= 0 && pp[b] < L, "attention token: position ", pp[b], " outside the cache of ", L);
    last = std::max(last, pp[b]);
  }
  TORCH_CHECK(!keep || keep_keys == last + 1, "attention token: the key mask must cover ", last + 1, " keys, not ",
              keep_keys);
  thread_local std::vector<float> qn_;
  thread_local std::vector<int64_t> lengths_;
  qn_.resize(B * H * D), lengths_.resize(B);
  float* qnp = qn_.data();
  for (int64_t b = 0; b < B; ++b) {
    const float *cb = cp + b * R, *sb = sp + b * R;
    for (int64_t h = 0; h < H; ++h) norm_rotate(qp + (b * H + h) * 2 * D, qw, eps, cb, sb, R, D, qnp + (b * H + h) * D);
    for (int64_t h = 0; h < KV; ++h) {
      const int64_t row = ((b * KV + h) * L + pp[b]) * D;
      norm_rotate(kp + (b * KV + h) * D, kw, eps, cb, sb, R, D, kc + row);
      std::copy(vp + (b * KV + h) * D, vp + (b * KV + h + 1) * D, vc + row);
    }
    lengths_[b] = pp[b] + 1;
  }
  // over the cache's first last + 1 positions, each row its own length
  decode_attention_into({B, H, KV, last + 1, D}, qnp, kc, KV * L * D, L * D, vc, KV * L * D, L * D, keep,
                        lengths_.data(), float(scale), op);
  for (int64_t b = 0; b < B; ++b)  // [B, H, D] gated in place
    for (int64_t h = 0; h < H; ++h) {
      const float* gate = qp + (b * H + h) * 2 * D + D;
      float* o = op + (b * H + h) * D;
      for (int64_t i = 0; i < D; ++i) o[i] *= sigmoid(gate[i]);
    }
}
