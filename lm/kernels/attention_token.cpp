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

// Row b's query heads normed and rotated into qn [H, D], its key (normed, rotated) and value into
// cache row c of k_cache / v_cache [rows, KV, L, D] at position p.
void row_in(const AttentionShape& shape, int64_t R, int64_t b, int64_t c, int64_t p, const float* qp, const float* kp,
            const float* vp, const float* qw, const float* kw, float eps, const float* cp, const float* sp, float* qn,
            float* kc, float* vc) {
  const int64_t H = shape.H, KV = shape.KV, L = shape.L, D = shape.D;
  const float *cb = cp + b * R, *sb = sp + b * R;
  for (int64_t h = 0; h < H; ++h) norm_rotate(qp + (b * H + h) * 2 * D, qw, eps, cb, sb, R, D, qn + h * D);
  for (int64_t h = 0; h < KV; ++h) {
    const int64_t row = ((c * KV + h) * L + p) * D;
    norm_rotate(kp + (b * KV + h) * D, kw, eps, cb, sb, R, D, kc + row);
    std::copy(vp + (b * KV + h) * D, vp + (b * KV + h + 1) * D, vc + row);
  }
}

// out [B, H, D] *= sigmoid(gate), each head's gate the second half of its q projection
void gate_rows(int64_t B, int64_t H, int64_t D, const float* qp, float* op) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const float* gate = qp + (b * H + h) * 2 * D + D;
      float* o = op + (b * H + h) * D;
      for (int64_t i = 0; i < D; ++i) o[i] *= sigmoid(gate[i]);
    }
}

}  // namespace

// q [B, H*2D] (per head: query then gate), k, v [B, KV*D]; q_norm_w, k_norm_w [D]; cos, sin [B, R];
// k_cache, v_cache [B, KV, L, D] contiguous; pos [B]; keep [B, keep_keys = max(pos) + 1] or null (no
// mask). out [B, H*D] = attention output * sigmoid(gate).
void attention_token_into(const AttentionShape& shape, int64_t R, const float* qp, const float* kp, const float* vp,
                          const float* qw, const float* kw, float eps, const float* cp, const float* sp, float* kc,
                          float* vc, const int64_t* pp, const bool* keep, int64_t keep_keys, double scale,
                          float* op) {
  const int64_t B = shape.B, H = shape.H, KV = shape.KV, L = shape.L, D = shape.D;
  const int64_t last = last_position(pp, B, L, keep, keep_keys, {"attention token"});
  thread_local std::vector<float> qn_;
  thread_local std::vector<int64_t> lengths_;
  qn_.resize(B * H * D), lengths_.resize(B);
  float* qnp = qn_.data();
  for (int64_t b = 0; b < B; ++b) {
    row_in(shape, R, b, b, pp[b], qp, kp, vp, qw, kw, eps, cp, sp, qnp + b * H * D, kc, vc);
    lengths_[b] = pp[b] + 1;
  }
  // over the cache's first last + 1 positions, each row its own length
  decode_attention_into({B, H, KV, last + 1, D}, qnp, kc, KV * L * D, L * D, vc, KV * L * D, L * D, keep,
                        lengths_.data(), float(scale), op);
  gate_rows(B, H, D, qp, op);
}

// attention_token_into for the rows of a speculative verify: row b's token goes to cache row
// slot[b] (several rows share one: the tokens of one sequence) at position pos[b], and attends to
// that cache row's first pos[b] + 1 positions; keep [cache rows, max(pos) + 1] or null. All rows'
// keys and values are written before any row attends, so a row sees the earlier tokens of its
// sequence in this verify and none after it.
void attention_verify_into(const AttentionShape& shape, int64_t R, const float* qp, const float* kp, const float* vp,
                           const float* qw, const float* kw, float eps, const float* cp, const float* sp, float* kc,
                           float* vc, const int64_t* pp, const int64_t* slot, const bool* keep, int64_t keep_keys,
                           double scale, float* op) {
  const int64_t B = shape.B, H = shape.H, KV = shape.KV, L = shape.L, D = shape.D;
  const int64_t last = last_position(pp, B, L, keep, keep_keys, {"attention verify"});
  std::vector<float> qn(B * H * D);
  for (int64_t b = 0; b < B; ++b)
    row_in(shape, R, b, slot[b], pp[b], qp, kp, vp, qw, kw, eps, cp, sp, qn.data() + b * H * D, kc, vc);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t length = pp[b] + 1, at = slot[b] * KV * L * D;
    decode_attention_into({1, H, KV, last + 1, D}, qn.data() + b * H * D, kc + at, KV * L * D, L * D, vc + at,
                          KV * L * D, L * D, keep ? keep + slot[b] * keep_keys : nullptr, &length, float(scale),
                          op + b * H * D);
  }
  gate_rows(B, H, D, qp, op);
}
