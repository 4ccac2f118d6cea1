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

// The step's activations in the calling thread's buffers, kept from step to step. A step used to
// make ~250 tensors and vectors, each allocation and free running cache-cold on the main thread
// right after a weight stream while the other threads waited (perf, dense checkpoint int4 batch 1:
// ~10% of the main thread's time in malloc and ATen's dispatch).
struct Buffers {
  enum { NORM, P0, P1, P2, P3, MIX, OUT, FINAL, COS, SIN, HIDDEN, COUNT };
  std::vector<float> b[COUNT];
  float* get(int i, int64_t n) {
    if (int64_t(b[i].size()) < n) b[i].resize(n);
    return b[i].data();
  }
};

Buffers& buffers() {
  thread_local Buffers b;
  return b;
}

const float* f32(const at::Tensor& t) { return t.numel() ? t.data_ptr<float>() : nullptr; }

void norm_rows(const float* x, const float* w, double eps, int64_t B, int64_t H, float* y) {
  for (int64_t b = 0; b < B; ++b) rms_norm_row(x + b * H, w, float(eps), 1.f, H, y + b * H);
}

// h[b] += y[b] (+ bias) for B rows of N
void add_rows(float* h, const float* y, const float* bias, int64_t B, int64_t N) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < N; ++i) h[b * N + i] += bias ? y[b * N + i] + bias[i] : y[b * N + i];
}

void add_bias(float* y, const float* bias, int64_t B, int64_t N) {
  if (bias)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < N; ++i) y[b * N + i] += bias[i];
}

}  // namespace

void DecodePlan::add_deltanet(at::Tensor input_norm, Weight in_proj_qkv, Weight in_proj_z, Weight in_proj_b,
                              Weight in_proj_a, at::Tensor conv, at::Tensor A_log, at::Tensor dt_bias,
                              at::Tensor norm, Weight out_proj, int64_t num_k_heads) {
  for (auto* t : {&input_norm, &conv, &A_log, &dt_bias, &norm}) check(*t, "DeltaNet layer tensors");
  const int64_t H = input_norm.numel(), C = conv.size(0), Hv = A_log.numel(), Dv = norm.numel();
  TORCH_CHECK(conv.dim() == 2 && num_k_heads > 0 && Hv % num_k_heads == 0 && C > Hv * Dv &&
                  (C - Hv * Dv) % (2 * num_k_heads) == 0 && dt_bias.numel() == Hv && Dv % V == 0,
              "decode plan: DeltaNet shapes do not match");
  TORCH_CHECK(hidden_ == 0 || hidden_ == H, "decode plan: every layer's hidden size must be the same");
  hidden_ = H;
  Layer l;
  l.deltanet = true;
  l.mixer = {input_norm, tensor_of(in_proj_qkv), tensor_of(in_proj_z), tensor_of(in_proj_b), tensor_of(in_proj_a),
             conv, A_log, dt_bias, norm, tensor_of(out_proj)};
  l.gdn = {0, C, conv.size(1) - 1, num_k_heads, Hv, (C - Hv * Dv) / (2 * num_k_heads), Dv};
  const int64_t Vd = Hv * Dv;
  l.ops = {{rows_of(in_proj_qkv, H, "in_proj_qkv"), tensor_of(in_proj_qkv).size(0), H},
           {rows_of(in_proj_z, H, "in_proj_z"), tensor_of(in_proj_z).size(0), H},
           {rows_of(in_proj_b, H, "in_proj_b"), tensor_of(in_proj_b).size(0), H},
           {rows_of(in_proj_a, H, "in_proj_a"), tensor_of(in_proj_a).size(0), H},
           {rows_of(out_proj, Vd, "out_proj"), tensor_of(out_proj).size(0), Vd}};
  TORCH_CHECK(l.ops[0].N == C && l.ops[1].N == Vd && l.ops[2].N == Hv && l.ops[3].N == Hv && l.ops[4].N == H,
              "decode plan: DeltaNet projection shapes do not match");
  layers_.push_back(std::move(l));
}

void DecodePlan::add_attention(at::Tensor input_norm, Weight q_proj, Weight k_proj, Weight v_proj, Weight o_proj,
                               std::vector<at::Tensor> biases, at::Tensor q_norm, at::Tensor k_norm, double scale) {
  TORCH_CHECK(biases.size() == 4, "attention biases: q, k, v, o (empty where absent)");
  check(input_norm, "attention input norm");
  const int64_t H = input_norm.numel(), D = q_norm.numel(), Q = tensor_of(q_proj).size(0);
  TORCH_CHECK(hidden_ == 0 || hidden_ == H, "decode plan: every layer's hidden size must be the same");
  TORCH_CHECK(D > 0 && Q % (2 * D) == 0, "decode plan: q_proj must give a query and a gate per head");
  hidden_ = H;
  Layer l;
  l.mixer = {input_norm, tensor_of(q_proj), tensor_of(k_proj), tensor_of(v_proj), tensor_of(o_proj), biases[0],
             biases[1], biases[2], biases[3], q_norm, k_norm};
  l.ops = {{rows_of(q_proj, H, "q_proj"), Q, H},
           {rows_of(k_proj, H, "k_proj"), tensor_of(k_proj).size(0), H},
           {rows_of(v_proj, H, "v_proj"), tensor_of(v_proj).size(0), H},
           {rows_of(o_proj, Q / 2, "o_proj"), tensor_of(o_proj).size(0), Q / 2}};
  const int64_t KV = l.ops[1].N / D;
  TORCH_CHECK(l.ops[3].N == H && l.ops[1].N % D == 0 && l.ops[2].N == l.ops[1].N && KV > 0 && (Q / 2 / D) % KV == 0 &&
                  k_norm.numel() == D,
              "decode plan: attention shapes do not match (o_proj to the hidden size, whole KV heads, query heads "
              "a multiple of them)");
  check(q_norm, "q_norm"), check(k_norm, "k_norm");
  for (int i = 0; i < 4; ++i) {
    if (!biases[i].numel()) continue;
    check(biases[i], "attention bias");
    TORCH_CHECK(biases[i].numel() == l.ops[i].N, "decode plan: a projection's bias does not match its outputs");
  }
  l.scale = scale;
  layers_.push_back(std::move(l));
}

void DecodePlan::add_moe(at::Tensor post_norm, Weight router, Weight gate_up, Weight down, int64_t top_k,
                         Weight shared_gate, Weight shared_up, Weight shared_down, at::Tensor shared_expert_gate,
                         int64_t pieces_per_expert) {
  TORCH_CHECK(!layers_.empty() && layers_.back().mlp.empty(), "add_moe must follow a layer's mixer");
  check(post_norm, "MoE post norm");
  TORCH_CHECK(post_norm.numel() == hidden_, "decode plan: the MoE norm does not match the hidden size");
  Layer& l = layers_.back();
  l.moe = true;
  l.mlp = {post_norm,          tensor_of(router),      tensor_of(gate_up),     tensor_of(down),
           tensor_of(shared_gate), tensor_of(shared_up), tensor_of(shared_down), shared_expert_gate};
  l.moe_w = moe_weights(router, gate_up, down, top_k, shared_gate, shared_up, shared_down, shared_expert_gate,
                        pieces_per_expert);
  TORCH_CHECK(l.moe_w.H == hidden_, "decode plan: the MoE block does not match the hidden size");
}

void DecodePlan::add_dense_mlp(at::Tensor post_norm, Weight gate, Weight up, Weight down) {
  TORCH_CHECK(!layers_.empty() && layers_.back().mlp.empty(), "add_dense_mlp must follow a layer's mixer");
  check(post_norm, "MLP post norm");
  const int64_t H = hidden_, I = tensor_of(gate).size(0);
  TORCH_CHECK(post_norm.numel() == H, "decode plan: the MLP norm does not match the hidden size");
  Layer& l = layers_.back();
  l.mlp = {post_norm, tensor_of(gate), tensor_of(up), tensor_of(down)};
  l.ops.push_back({rows_of(gate, H, "gate_proj"), I, H});
  l.ops.push_back({rows_of(up, H, "up_proj"), tensor_of(up).size(0), H});
  l.ops.push_back({rows_of(down, I, "down_proj"), tensor_of(down).size(0), I});
  TORCH_CHECK(l.ops.back().N == H && l.ops[l.ops.size() - 2].N == I, "decode plan: MLP shapes do not match");
}

void DecodePlan::add_panels(at::Tensor weight, at::Tensor panels) {
  const void* data = weight.data_ptr();
  std::vector<Operand*> uses;  // the operands of this weight (a tied weight may serve twice)
  for (auto& l : layers_)
    for (auto& o : l.ops)
      if (o.W.data == data) uses.push_back(&o);
  if (head_op_.W.data == data) uses.push_back(&head_op_);
  TORCH_CHECK(!uses.empty(), "add_panels: the weight is none of the plan's products");
  const Operand& op = *uses[0];
  check_panels(op.W.fmt, weight, panels, op.N);
  for (Operand* o : uses) o->panels = panels.data_ptr();
  panels_.push_back(panels);
}

void DecodePlan::check_caches(const std::vector<at::Tensor>& states, int64_t B, int64_t R, const bool* keep,
                              int64_t keep_keys, const int64_t* pos, int64_t rows) const {
  TORCH_CHECK(states.size() == 2 * layers_.size() && final_norm_.defined(), "decode plan and cache do not match");
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    TORCH_CHECK(!l.mlp.empty(), "decode plan: layer ", i, " has no MLP");
    const at::Tensor &a = states[2 * i], &b = states[2 * i + 1];
    if (l.deltanet) {
      const GdnShape& g = l.gdn;
      for (auto* t : {&a, &b}) check(*t, "DeltaNet cache");
      TORCH_CHECK(a.dim() == 3 && a.size(0) == rows && a.size(1) == g.Km1 && a.size(2) == g.C && b.dim() == 4 &&
                      b.size(0) == rows && b.size(1) == g.Hv && b.size(2) == g.Dk && b.size(3) == g.Dv,
                  "decode plan: layer ", i, "'s DeltaNet cache does not match the layer");
      continue;
    }
    for (auto* t : {&a, &b}) check(*t, "KV cache");
    const int64_t D = l.mixer[9].numel(), KV = l.ops[1].N / D, L = a.size(2);
    TORCH_CHECK(a.dim() == 4 && a.size(0) == rows && a.size(1) == KV && a.size(3) == D && b.sizes() == a.sizes() &&
                    R % 2 == 0 && R <= D,
                "decode plan: layer ", i, "'s KV cache does not match the layer");
    last_position(pos, B, L, keep, keep_keys, {"decode plan", int64_t(i)});  // before any layer steps
  }
}

void DecodePlan::layers(float* h, int64_t B, const std::vector<at::Tensor>& states, const float* cos,
                        const float* sin, int64_t R, const bool* keep, int64_t keep_keys, const int64_t* pos,
                        float* out, const Chain* chain) const {
  check_caches(states, B, R, keep, keep_keys, pos, chain ? chain->sequences : B);
  size_t gdn_layer = 0;  // the DeltaNet layers' index in chain->steps
  const int64_t H = hidden_;
  Buffers& buf = buffers();
  float *n = buf.get(Buffers::NORM, B * H), *y = buf.get(Buffers::OUT, B * H);
  const auto product = [B](const Operand& o, const float* x, float* out) {
    return Product{x, B, o.K, o.W, o.N, o.K, out, o.panels};
  };
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    const auto& w = l.mixer;
    const auto& o = l.ops;
    norm_rows(h, w[0].data_ptr<float>(), eps_, B, H, n);
    if (l.deltanet) {
      GdnShape g = l.gdn;
      g.B = B;
      const at::Tensor &window = states[2 * i], &state = states[2 * i + 1];
      float *qkv = buf.get(Buffers::P0, B * o[0].N), *z = buf.get(Buffers::P1, B * o[1].N);
      float *b = buf.get(Buffers::P2, B * o[2].N), *a = buf.get(Buffers::P3, B * o[3].N);
      const Product in[] = {product(o[0], n, qkv), product(o[1], n, z), product(o[2], n, b), product(o[3], n, a)};
      run_products(in, 4);
      float* mix = buf.get(Buffers::MIX, B * o[4].K);
      if (chain) {
        const at::Tensor &win_steps = (*chain->steps)[2 * gdn_layer], &state_steps = (*chain->steps)[2 * gdn_layer + 1];
        ++gdn_layer;
        gdn_verify_into(g, qkv, z, b, a, window.data_ptr<float>(), w[5].data_ptr<float>(), w[6].data_ptr<float>(),
                        w[7].data_ptr<float>(), state.data_ptr<float>(), w[8].data_ptr<float>(), float(eps_),
                        chain->slot, chain->prev, win_steps.data_ptr<float>(), state_steps.data_ptr<float>(), mix);
      } else {
        gdn_decode_into(g, qkv, z, b, a, window.data_ptr<float>(), w[5].data_ptr<float>(), w[6].data_ptr<float>(),
                        w[7].data_ptr<float>(), state.data_ptr<float>(), w[8].data_ptr<float>(), float(eps_), mix);
      }
      const Product out_proj = product(o[4], mix, y);
      run_products(&out_proj, 1);
      add_rows(h, y, nullptr, B, H);
    } else {
      float *q = buf.get(Buffers::P0, B * o[0].N), *k = buf.get(Buffers::P1, B * o[1].N);
      float* v = buf.get(Buffers::P2, B * o[2].N);
      const Product in[] = {product(o[0], n, q), product(o[1], n, k), product(o[2], n, v)};
      run_products(in, 3);
      add_bias(q, f32(w[5]), B, o[0].N), add_bias(k, f32(w[6]), B, o[1].N), add_bias(v, f32(w[7]), B, o[2].N);
      const at::Tensor &k_cache = states[2 * i], &v_cache = states[2 * i + 1];
      const int64_t D = w[9].numel(), KV = o[1].N / D, L = k_cache.size(2);
      float* mix = buf.get(Buffers::MIX, B * o[3].K);
      if (chain)
        attention_verify_into({B, o[3].K / D, KV, L, D}, R, q, k, v, w[9].data_ptr<float>(), w[10].data_ptr<float>(),
                              float(eps_), cos, sin, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), pos,
                              chain->slot, keep, keep_keys, l.scale, mix);
      else
        attention_token_into({B, o[3].K / D, KV, L, D}, R, q, k, v, w[9].data_ptr<float>(), w[10].data_ptr<float>(),
                             float(eps_), cos, sin, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), pos, keep,
                             keep_keys, l.scale, mix);
      const Product o_proj = product(o[3], mix, y);
      run_products(&o_proj, 1);
      add_rows(h, y, f32(w[8]), B, H);
    }
    const auto& m = l.mlp;
    norm_rows(h, m[0].data_ptr<float>(), eps_, B, H, n);
    if (l.moe) {
      moe_decode_into(l.moe_w, n, B, y);
      add_rows(h, y, nullptr, B, H);
    } else {
      const Operand &gate = o[o.size() - 3], &up = o[o.size() - 2], &down = o[o.size() - 1];
      float *g = buf.get(Buffers::P0, B * gate.N), *u = buf.get(Buffers::P1, B * up.N);
      const Product in[] = {product(gate, n, g), product(up, n, u)};
      run_products(in, 2);
      silu_mul(g, u, g, B * gate.N);
      const Product d = product(down, g, y);
      run_products(&d, 1);
      add_rows(h, y, nullptr, B, H);
    }
  }
  norm_rows(h, final_norm_.data_ptr<float>(), eps_, B, H, out);
}

at::Tensor DecodePlan::run(at::Tensor x, std::vector<at::Tensor> states, at::Tensor cos, at::Tensor sin,
                           at::Tensor keep, at::Tensor pos) const {
  for (auto* t : {&x, &cos, &sin}) check(*t, "x, cos and sin");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.size(0) >= 1 && x.size(0) <= 8,
              "decode plan: x must be [B, hidden] with 1 to 8 rows");
  const int64_t B = x.size(0);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == B && sin.sizes() == cos.sizes(), "decode plan: cos, sin must be [B, R]");
  check_positions(pos, keep, B, "decode plan");
  float* h = buffers().get(Buffers::HIDDEN, B * hidden_);  // the residual stream, updated in place
  std::copy_n(x.data_ptr<float>(), B * hidden_, h);
  auto out = at::empty({B, hidden_}, x.options());
  layers(h, B, states, cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(1),
         keep.numel() ? keep.data_ptr<bool>() : nullptr, keep.numel() ? keep.size(1) : 0, pos.data_ptr<int64_t>(),
         out.data_ptr<float>());
  return out;
}

void DecodePlan::set_ends(Weight table, at::Tensor inv_freq, at::Tensor axis, Weight head_w) {
  const at::Tensor &embedding = tensor_of(table), &head = tensor_of(head_w);
  const int64_t table_fmt = std::get<1>(table);
  TORCH_CHECK(embedding.dim() == 2 && (table_fmt == F32 || table_fmt == BF16 || table_fmt == BF16_G8),
              "decode plan: the embedding table must be float32 or bf16 (rows, or rows in groups of 8) [vocab, hidden]");
  check(inv_freq, "inv_freq");
  TORCH_CHECK(axis.scalar_type() == at::kLong && axis.is_contiguous() && axis.numel() == inv_freq.numel(),
              "decode plan: axis must be int64 with one row index per rotary frequency");
  const int64_t* a = axis.data_ptr<int64_t>();
  for (int64_t i = 0; i < axis.numel(); ++i) TORCH_CHECK(a[i] >= 0 && a[i] < 3, "decode plan: axis values are 0, 1 or 2");
  TORCH_CHECK(embedding.size(1) == hidden_, "decode plan: the embedding table does not match the layers' hidden size");
  table_ = rows_of(table, hidden_, "embedding");
  head_op_ = {rows_of(head_w, hidden_, "lm_head"), head.size(0), hidden_};  // a clear error now, not at a step
  embedding_ = embedding, inv_freq_ = inv_freq, axis_ = axis, head_ = head;
}

void DecodePlan::ends_in(const int64_t* ip, const int64_t* pp, int64_t B, float** x, float** cos, float** sin) const {
  const int64_t H = embedding_.size(1), vocab = embedding_.size(0), F = inv_freq_.numel();
  const int64_t* ax = axis_.data_ptr<int64_t>();
  Buffers& buf = buffers();
  float *xp = buf.get(Buffers::HIDDEN, B * H), *cp = buf.get(Buffers::COS, B * 2 * F);
  float* sp = buf.get(Buffers::SIN, B * 2 * F);
  const float* inv = inv_freq_.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_INDEX(ip[b] >= 0 && ip[b] < vocab, "step: token id ", ip[b], " outside the vocabulary of ", vocab);
    row_to_float(table_, ip[b], H, xp + b * H);  // float32 or bf16 (exact), rows or rows in groups of 8
    for (int64_t i = 0; i < F; ++i) {  // emb = [freqs, freqs], freqs[i] = float(position of row axis[i]) inv_freq[i]
      const float angle = float(pp[ax[i] * B + b]) * inv[i];
      cp[b * 2 * F + i] = cp[b * 2 * F + F + i] = std::cos(angle);
      sp[b * 2 * F + i] = sp[b * 2 * F + F + i] = std::sin(angle);
    }
  }
  *x = xp, *cos = cp, *sin = sp;
}

at::Tensor DecodePlan::step(at::Tensor ids, at::Tensor positions, std::vector<at::Tensor> states, at::Tensor keep,
                            at::Tensor pos) const {
  TORCH_CHECK(head_.defined(), "decode plan: step needs set_ends first");
  TORCH_CHECK(ids.scalar_type() == at::kLong && (ids.dim() == 1 || (ids.dim() == 2 && ids.size(1) == 1)),
              "step: ids must be int64 [B] or [B, 1]");
  ids = ids.reshape({-1}).contiguous();
  const int64_t B = ids.size(0);
  TORCH_CHECK(B >= 1 && B <= 8, "step: 1 to 8 rows");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.size(0) == 3 && positions.numel() == 3 * B &&
                  (positions.dim() == 2 || (positions.dim() == 3 && positions.size(2) == 1)),
              "step: positions must be int64 [3, B] or [3, B, 1]");
  check_positions(pos, keep, B, "decode plan");
  const auto p = positions.reshape({3, B}).contiguous();
  float *xp, *cp, *sp;
  ends_in(ids.data_ptr<int64_t>(), p.data_ptr<int64_t>(), B, &xp, &cp, &sp);
  const int64_t H = embedding_.size(1), F = inv_freq_.numel();
  Buffers& buf = buffers();
  float* final = buf.get(Buffers::FINAL, B * H);
  layers(xp, B, states, cp, sp, 2 * F, keep.numel() ? keep.data_ptr<bool>() : nullptr, keep.numel() ? keep.size(1) : 0,
         pos.data_ptr<int64_t>(), final);
  auto logits = at::empty({B, head_op_.N}, inv_freq_.options());
  const Product lm_head{final, B, H, head_op_.W, head_op_.N, H, logits.data_ptr<float>(), head_op_.panels};
  run_products(&lm_head, 1);
  return logits;
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

std::vector<at::Tensor> DecodePlan::verify(std::vector<int64_t> ids, std::vector<int64_t> positions, std::vector<at::Tensor> states,
                              at::Tensor keep, std::vector<int64_t> pos, std::vector<int64_t> slot,
                              std::vector<int64_t> prev, std::vector<at::Tensor> steps) const {
  TORCH_CHECK(head_.defined(), "decode plan: verify needs set_ends first");
  const int64_t B = ids.size();
  TORCH_CHECK(B >= 1 && B <= 8 && int64_t(positions.size()) == B && int64_t(pos.size()) == B &&
                  int64_t(slot.size()) == B && int64_t(prev.size()) == B,
              "verify: 1 to 8 rows, each with a token, a position, a cache position, a cache row and a previous row");
  int64_t sequences = 0;
  for (int64_t r = 0; r < B; ++r) {
    TORCH_CHECK(slot[r] >= 0 && (prev[r] < 0 ? true : prev[r] < r && slot[prev[r]] == slot[r]),
                "verify: row ", r, " continues row ", prev[r], " of another cache row or a later one");
    sequences = std::max(sequences, slot[r] + 1);
  }
  TORCH_CHECK(!keep.numel() || (keep.scalar_type() == at::kBool && keep.is_contiguous() && keep.dim() == 2 &&
                                keep.size(0) == sequences),
              "verify: keep must be a contiguous bool [sequences, keys] tensor or empty");
  size_t deltanets = 0;
  for (const Layer& l : layers_) deltanets += l.deltanet;
  TORCH_CHECK(steps.size() == 2 * deltanets, "verify: two step tensors per DeltaNet layer");
  size_t i = 0;
  for (const Layer& l : layers_) {
    if (!l.deltanet) continue;
    const at::Tensor &w = steps[2 * i], &s = steps[2 * i + 1];
    for (auto* t : {&w, &s}) check(*t, "verify steps");
    TORCH_CHECK(w.dim() == 3 && w.size(0) == B && w.size(1) == l.gdn.Km1 && w.size(2) == l.gdn.C && s.dim() == 4 &&
                    s.size(0) == B && s.size(1) == l.gdn.Hv && s.size(2) == l.gdn.Dk && s.size(3) == l.gdn.Dv,
                "verify: DeltaNet steps ", i, " do not match the layer");
    ++i;
  }
  const auto longs = at::TensorOptions().dtype(at::kLong);
  auto p = at::empty({3, B}, longs);
  for (int64_t axis = 0; axis < 3; ++axis) std::copy(positions.begin(), positions.end(), p.data_ptr<int64_t>() + axis * B);
  float *xp, *cp, *sp;
  ends_in(ids.data(), p.data_ptr<int64_t>(), B, &xp, &cp, &sp);
  const int64_t H = embedding_.size(1), F = inv_freq_.numel();
  auto hidden = at::empty({B, H}, inv_freq_.options());
  const Chain chain{slot.data(), prev.data(), &steps, sequences};
  layers(xp, B, states, cp, sp, 2 * F, keep.numel() ? keep.data_ptr<bool>() : nullptr, keep.numel() ? keep.size(1) : 0,
         pos.data(), hidden.data_ptr<float>(), &chain);
  auto logits = at::empty({B, head_op_.N}, inv_freq_.options());
  const Product lm_head{hidden.data_ptr<float>(), B, H, head_op_.W, head_op_.N, H, logits.data_ptr<float>(),
                        head_op_.panels};
  run_products(&lm_head, 1);
  return {hidden, logits};
}
