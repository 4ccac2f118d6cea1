// A whole decode step in C++: the layer loop of the decode fast path (lm/decode.py) without Python
// around each kernel. On the benchmark model that saves ~1 ms of a ~20 ms batch-1 step and ~2 ms of
// a ~60 ms batch-8 step (the interpreter runs cache-cold after every weight stream). Per layer, the
// same kernels the layers use:
//   Gated DeltaNet: norm, the four input projections (one region), the token step (delta_step.cpp),
//                   out_proj;
//   attention:      norm, q/k/v projections (+ biases), attention_token.cpp, o_proj (+ bias);
//   MLP:            norm, the fused MoE block (moe_decode.cpp) or a SwiGLU through the products;
// each with its residual add; then the final norm. With 5-8 rows, the products of the weights given
// to add_panels stream their panel copies (vec.h). `step` adds the ends: the token embeddings and
// rotary angles before, the LM head after.

#include "kernels.h"
#include "vec.h"

using namespace qwen35;

namespace {

at::Tensor plus_bias(at::Tensor y, const at::Tensor& bias) { return bias.numel() ? y.add_(bias) : y; }

}  // namespace

void DecodePlan::add_deltanet(at::Tensor input_norm, at::Tensor in_proj_qkv, at::Tensor in_proj_z,
                              at::Tensor in_proj_b, at::Tensor in_proj_a, at::Tensor conv, at::Tensor A_log,
                              at::Tensor dt_bias, at::Tensor norm, at::Tensor out_proj, int64_t num_k_heads) {
  Layer l;
  l.deltanet = true;
  l.mixer = {input_norm, in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv, A_log, dt_bias, norm, out_proj};
  l.num_k_heads = num_k_heads;
  layers_.push_back(std::move(l));
}

void DecodePlan::add_attention(at::Tensor input_norm, at::Tensor q_proj, at::Tensor k_proj, at::Tensor v_proj,
                               at::Tensor o_proj, std::vector<at::Tensor> biases, at::Tensor q_norm,
                               at::Tensor k_norm, double scale) {
  TORCH_CHECK(biases.size() == 4, "attention biases: q, k, v, o (empty where absent)");
  Layer l;
  l.mixer = {input_norm, q_proj, k_proj, v_proj, o_proj, biases[0], biases[1], biases[2], biases[3], q_norm, k_norm};
  l.scale = scale;
  layers_.push_back(std::move(l));
}

void DecodePlan::add_moe(at::Tensor post_norm, at::Tensor router, at::Tensor gate_up, at::Tensor down, int64_t top_k,
                         at::Tensor shared_gate, at::Tensor shared_up, at::Tensor shared_down,
                         at::Tensor shared_expert_gate, int64_t pieces_per_expert) {
  TORCH_CHECK(!layers_.empty() && layers_.back().mlp.empty(), "add_moe must follow a layer's mixer");
  Layer& l = layers_.back();
  l.moe = true;
  l.mlp = {post_norm, router, gate_up, down, shared_gate, shared_up, shared_down, shared_expert_gate};
  l.top_k = top_k;
  l.pieces = pieces_per_expert;
}

void DecodePlan::add_dense_mlp(at::Tensor post_norm, at::Tensor gate, at::Tensor up, at::Tensor down) {
  TORCH_CHECK(!layers_.empty() && layers_.back().mlp.empty(), "add_dense_mlp must follow a layer's mixer");
  layers_.back().mlp = {post_norm, gate, up, down};
}

// x times each weight (one parallel region), through the weights' panel copies where the plan has them
std::vector<at::Tensor> DecodePlan::products(const at::Tensor& x, std::vector<at::Tensor> weights) const {
  std::vector<at::Tensor> panels;
  for (const auto& w : weights) {
    const auto it = panels_.find(w.data_ptr());
    panels.push_back(it == panels_.end() ? at::Tensor() : it->second);
  }
  return multi_linear(x, weights, panels);
}

at::Tensor DecodePlan::run(at::Tensor x, std::vector<at::Tensor> states, at::Tensor cos, at::Tensor sin,
                           at::Tensor keep, at::Tensor pos) const {
  TORCH_CHECK(states.size() == 2 * layers_.size() && final_norm_.defined(), "decode plan and cache do not match");
  at::Tensor h = x.clone();  // the residual stream, updated in place
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    const auto& w = l.mixer;
    TORCH_CHECK(!l.mlp.empty(), "decode plan: layer ", i, " has no MLP");
    const at::Tensor n = rms_norm(h, w[0], eps_, 1.0);
    if (l.deltanet) {
      const auto p = products(n, {w[1], w[2], w[3], w[4]});
      const at::Tensor out = gdn_decode(p[0], p[1], p[2], p[3], states[2 * i], w[5], w[6], w[7], states[2 * i + 1],
                                        w[8], eps_, l.num_k_heads);
      h.add_(products(out, {w[9]})[0]);
    } else {
      const auto p = products(n, {w[1], w[2], w[3]});
      const at::Tensor out = attention_token(plus_bias(p[0], w[5]), plus_bias(p[1], w[6]), plus_bias(p[2], w[7]),
                                             w[9], w[10], eps_, cos, sin, states[2 * i], states[2 * i + 1], pos,
                                             keep, l.scale);
      h.add_(plus_bias(products(out, {w[4]})[0], w[8]));
    }
    const auto& m = l.mlp;
    const at::Tensor n2 = rms_norm(h, m[0], eps_, 1.0);
    if (l.moe) {
      h.add_(moe_decode(n2, m[1], m[2], m[3], l.top_k, m[4], m[5], m[6], m[7], l.pieces));
    } else {
      const auto p = products(n2, {m[1], m[2]});
      silu_mul(p[0].data_ptr<float>(), p[1].data_ptr<float>(), p[0].data_ptr<float>(), p[0].numel());
      h.add_(products(p[0], {m[3]})[0]);
    }
  }
  return rms_norm(h, final_norm_, eps_, 1.0);
}

void DecodePlan::set_ends(at::Tensor embedding, at::Tensor inv_freq, at::Tensor axis, at::Tensor head) {
  TORCH_CHECK(embedding.dim() == 2 && embedding.is_contiguous() &&
                  (embedding.scalar_type() == at::kFloat || embedding.scalar_type() == at::kBFloat16),
              "decode plan: the embedding table must be a contiguous float32 or bfloat16 [vocab, hidden] tensor");
  check(inv_freq, "inv_freq");
  TORCH_CHECK(axis.scalar_type() == at::kLong && axis.is_contiguous() && axis.numel() == inv_freq.numel(),
              "decode plan: axis must be int64 with one row index per rotary frequency");
  const int64_t* a = axis.data_ptr<int64_t>();
  for (int64_t i = 0; i < axis.numel(); ++i) TORCH_CHECK(a[i] >= 0 && a[i] < 3, "decode plan: axis values are 0, 1 or 2");
  rows_of(head, embedding.size(1), "lm_head");  // a clear error now rather than at the first step
  embedding_ = embedding, inv_freq_ = inv_freq, axis_ = axis, head_ = head;
}

at::Tensor DecodePlan::step(at::Tensor ids, at::Tensor positions, std::vector<at::Tensor> states, at::Tensor keep,
                            at::Tensor pos) const {
  TORCH_CHECK(head_.defined(), "decode plan: step needs set_ends first");
  TORCH_CHECK(ids.scalar_type() == at::kLong && (ids.dim() == 1 || (ids.dim() == 2 && ids.size(1) == 1)),
              "step: ids must be int64 [B] or [B, 1]");
  ids = ids.reshape({-1}).contiguous();
  const int64_t B = ids.size(0), H = embedding_.size(1), vocab = embedding_.size(0), F = inv_freq_.numel();
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.size(0) == 3 && positions.numel() == 3 * B &&
                  (positions.dim() == 2 || (positions.dim() == 3 && positions.size(2) == 1)),
              "step: positions must be int64 [3, B] or [3, B, 1]");
  const auto p = positions.reshape({3, B}).contiguous();
  const int64_t *ip = ids.data_ptr<int64_t>(), *pp = p.data_ptr<int64_t>(), *ax = axis_.data_ptr<int64_t>();
  const Rows table = rows_of(embedding_, H, "embedding");
  auto x = at::empty({B, H}, inv_freq_.options());
  auto cos = at::empty({B, 2 * F}, x.options()), sin = at::empty({B, 2 * F}, x.options());
  float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const float* inv = inv_freq_.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_INDEX(ip[b] >= 0 && ip[b] < vocab, "step: token id ", ip[b], " outside the vocabulary of ", vocab);
    to_float(table.from(ip[b]), 1, H, xp + b * H);  // float32 or bf16 (exact) rows
    for (int64_t i = 0; i < F; ++i) {  // emb = [freqs, freqs], freqs[i] = float(position of row axis[i]) inv_freq[i]
      const float angle = float(pp[ax[i] * B + b]) * inv[i];
      cp[b * 2 * F + i] = cp[b * 2 * F + F + i] = std::cos(angle);
      sp[b * 2 * F + i] = sp[b * 2 * F + F + i] = std::sin(angle);
    }
  }
  return products(run(x, std::move(states), cos, sin, keep, pos), {head_})[0];
}

at::Tensor DecodePlan::step_tokens(std::vector<int64_t> ids, std::vector<int64_t> positions,
                                   std::vector<at::Tensor> states, at::Tensor keep, std::vector<int64_t> pos) const {
  const int64_t B = ids.size();
  TORCH_CHECK(B > 0 && int64_t(positions.size()) == B && int64_t(pos.size()) == B,
              "step_tokens: one token, one position and one cache position per row");
  const auto longs = at::TensorOptions().dtype(at::kLong);
  auto p = at::empty({3, B}, longs);
  for (int64_t axis = 0; axis < 3; ++axis) std::copy(positions.begin(), positions.end(), p.data_ptr<int64_t>() + axis * B);
  return step(at::from_blob(ids.data(), {B}, longs), p, std::move(states), keep, at::from_blob(pos.data(), {B}, longs));
}
