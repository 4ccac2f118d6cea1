// The kernels' entry points, for the Python bindings (bindings.cpp) and for kernels that call
// other kernels (the decode step, the attention token).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>

#include <vector>

#include "formats.h"

// Weights W of the products, experts and decode plan are in any format of formats.h (float32,
// bf16, Q8_0 or Q4_0 blocks), each passed with its format's code (formats.h: Weight); x,
// activations and results are float32.
// panels: a panel copy of W (kernels.panels; vec.h), used for 5-8 rows, or an empty tensor
at::Tensor small_m_linear(at::Tensor x, qwen35::Weight W, at::Tensor panels);
std::vector<at::Tensor> multi_linear(at::Tensor x, std::vector<qwen35::Weight> weights, std::vector<at::Tensor> panels);
at::Tensor int8_linear(at::Tensor x, qwen35::Weight W);
// prefill products in bf16 on AMX tiles (amx_linear.cpp); amx_ready: built with them and allowed by the OS
at::Tensor amx_linear(at::Tensor x, qwen35::Weight W);
// x W^T through torch's bf16 GEMM, W converted to bf16 rows (amx_linear.cpp; built with AVX512-BF16)
at::Tensor bf16_rows_mm(const at::Tensor& x, qwen35::Weight W);
bool bf16_rows_built();
at::Tensor amx_int8_linear(at::Tensor x, qwen35::Weight W);
bool amx_ready();
at::Tensor grouped_linear(at::Tensor x, qwen35::Weight W, at::Tensor experts, at::Tensor offsets);
at::Tensor dequantize(qwen35::Weight w, int64_t K);
at::Tensor gated_delta_step(at::Tensor state, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor decay,
                            at::Tensor beta);
at::Tensor gdn_decode(at::Tensor qkv, at::Tensor z, at::Tensor b_in, at::Tensor a_in, at::Tensor window,
                      at::Tensor conv_w, at::Tensor A_log, at::Tensor dt_bias, at::Tensor state, at::Tensor norm_w,
                      double eps, int64_t num_k_heads);
// A worker thread of at::parallel_for running ATen ops: no autograd, and the caller's inference mode
// (thread-local: without it, in-place ops on tensors made under torch.inference_mode() fail there).
struct WorkerModes {
  explicit WorkerModes(bool inference) : mode(inference) {}
  c10::NoGradGuard no_grad;
  c10::InferenceMode mode;
};

// gdn_decode on raw float32 rows (its checks done by the caller): how the decode step calls it, with
// no tensor made per call
struct GdnShape {
  int64_t B, C, Km1, Hk, Hv, Dk, Dv;  // rows, conv channels, conv window, key / value heads, head dims
};
void gdn_decode_into(const GdnShape& shape, const float* qkv, const float* z, const float* b_in, const float* a_in,
                     float* window, const float* conv_w, const float* A_log, const float* dt_bias, float* state,
                     const float* norm_w, float eps, float* out);
// ... of the chained rows of a speculative verify (delta_step.cpp says how)
void gdn_verify_into(const GdnShape& shape, const float* qkv, const float* z, const float* b_in, const float* a_in,
                     float* window, const float* conv_w, const float* A_log, const float* dt_bias, float* state,
                     const float* norm_w, float eps, const int64_t* slot, const int64_t* prev,
                     float* window_steps, float* state_steps, float* out);
// decode_attention and the attention layer's token on raw float32 rows (the shape checks done by
// the caller; attention_token_into checks the positions against the cache and the mask): the decode
// step's path. The caches [B, KV, L, D] contiguous; attention_token_into's out [B, H * D].
struct AttentionShape {
  int64_t B, H, KV, L, D;  // rows, query heads, KV heads, keys (cache length), head dim
};
void decode_attention_into(const AttentionShape& shape, const float* q, const float* k, int64_t k_row_stride,
                           int64_t k_head_stride, const float* v, int64_t v_row_stride, int64_t v_head_stride,
                           const bool* keep, const int64_t* lengths, float scale, float* out);
void attention_token_into(const AttentionShape& shape, int64_t R, const float* q, const float* k, const float* v,
                          const float* q_norm_w, const float* k_norm_w, float eps, const float* cos, const float* sin,
                          float* k_cache, float* v_cache, const int64_t* pos, const bool* keep, int64_t keep_keys,
                          double scale, float* out);
// ... of the rows of a speculative verify, row b in cache row slot[b] (attention_token.cpp)
void attention_verify_into(const AttentionShape& shape, int64_t R, const float* q, const float* k, const float* v,
                           const float* q_norm_w, const float* k_norm_w, float eps, const float* cos, const float* sin,
                           float* k_cache, float* v_cache, const int64_t* pos, const int64_t* slot, const bool* keep,
                           int64_t keep_keys, double scale, float* out);
// moe_decode's weights, checked once (moe_weights), and the block on raw rows: x [N, H] -> out [N, H]
struct MoeWeights {
  qwen35::Rows router, sh_expert_gate, gate_up, down, sh_gate, sh_up, sh_down;
  int64_t H, E, I, Is, top_k, pieces;
};
MoeWeights moe_weights(qwen35::Weight router, qwen35::Weight gate_up, qwen35::Weight down, int64_t top_k,
                       qwen35::Weight sh_gate, qwen35::Weight sh_up, qwen35::Weight sh_down, at::Tensor sh_expert_gate,
                       int64_t pieces_per_expert);
void moe_decode_into(const MoeWeights& w, const float* x, int64_t N, float* out);
at::Tensor moe_decode(at::Tensor x, qwen35::Weight router, qwen35::Weight gate_up, qwen35::Weight down, int64_t top_k,
                      qwen35::Weight sh_gate, qwen35::Weight sh_up, qwen35::Weight sh_down, at::Tensor sh_expert_gate,
                      int64_t pieces_per_expert);
at::Tensor expert_mlp(at::Tensor x, qwen35::Weight gate_up, qwen35::Weight down, at::Tensor offsets, at::Tensor token,
                      at::Tensor weight, int64_t compute);
std::vector<at::Tensor> chunked_delta_rule(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g, at::Tensor beta,
                                           at::Tensor state, int64_t chunk);
at::Tensor decode_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor keep, double scale,
                            at::Tensor lengths);
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps, double offset);
at::Tensor gated_rms_norm(at::Tensor x, at::Tensor z, at::Tensor w, double eps);
std::vector<at::Tensor> causal_conv(at::Tensor x, at::Tensor window, at::Tensor weight);
at::Tensor bf16_attention(at::Tensor q, at::Tensor k, at::Tensor v, double scale, bool causal);
bool bf16_attention_built();
// greedy sampling: the index of the first largest value of a float32 vector (the first NaN if any)
int64_t argmax(at::Tensor x);
// ... of each row of a float32 [B, V] tensor
std::vector<int64_t> argmax_rows(at::Tensor x);
// sampling's top-k: (values, indices) of the k largest of a float32 vector, best first (argmax.cpp)
std::tuple<at::Tensor, at::Tensor> largest_k(at::Tensor x, int64_t k);
// peaks.cpp: op/s of the products' fp32 or int8 instruction in registers on every thread (bench limits)
double instruction_peak(const std::string& kind, int64_t steps);
// a constrained token's packed bitmask (bit t % 32 of word t / 32) applied: the others' logits -inf
at::Tensor apply_token_bits(at::Tensor logits, at::Tensor bits);

// A whole decode step through the layer stack, one token per row (decode_step.cpp). lm/decode.py
// adds the layers' weights once per generation, in layer order: each layer's mixer (add_deltanet or
// add_attention), then its MLP (add_moe or add_dense_mlp); then the final norm. Every RMS norm of
// the model uses the one `eps` (the config's rms_norm_eps).
class DecodePlan {
 public:
  explicit DecodePlan(double eps) : eps_(eps) {}
  void add_deltanet(at::Tensor input_norm, qwen35::Weight in_proj_qkv, qwen35::Weight in_proj_z,
                    qwen35::Weight in_proj_b, qwen35::Weight in_proj_a, at::Tensor conv, at::Tensor A_log,
                    at::Tensor dt_bias, at::Tensor norm, qwen35::Weight out_proj, int64_t num_k_heads);
  // biases: q, k, v, o projections' biases, an empty tensor where a projection has none
  void add_attention(at::Tensor input_norm, qwen35::Weight q_proj, qwen35::Weight k_proj, qwen35::Weight v_proj,
                     qwen35::Weight o_proj, std::vector<at::Tensor> biases, at::Tensor q_norm, at::Tensor k_norm,
                     double scale);
  void add_moe(at::Tensor post_norm, qwen35::Weight router, qwen35::Weight gate_up, qwen35::Weight down, int64_t top_k,
               qwen35::Weight shared_gate, qwen35::Weight shared_up, qwen35::Weight shared_down,
               at::Tensor shared_expert_gate, int64_t pieces_per_expert);
  void add_dense_mlp(at::Tensor post_norm, qwen35::Weight gate, qwen35::Weight up, qwen35::Weight down);
  void set_final_norm(at::Tensor norm) { final_norm_ = norm; }
  // the panel copy of one of the plan's weights (vec.h): its products with 5-8 rows go through it
  void add_panels(at::Tensor weight, at::Tensor panels);
  // the ends of a whole step (for `step`): the embedding table [vocab, hidden] (float32 or bf16),
  // the rotary frequencies inv_freq [R/2] float32 with the position row (0 t, 1 h, 2 w) of each,
  // axis [R/2] int64, and the LM head [vocab, hidden] (any format)
  void set_ends(qwen35::Weight embedding, at::Tensor inv_freq, at::Tensor axis, qwen35::Weight head);
  bool has_ends() const { return head_.defined(); }
  // x [B, hidden] token embeddings; states: two per layer, (conv window, recurrent state) or
  // (k cache, v cache); cos, sin [B, R] rotary angles; pos [B] int64 the cache position of each
  // row's token (rows may differ: the serving engine's rows each have their own length); keep
  // [B, max(pos) + 1] bool or empty (no mask). Returns the final-normed hidden states [B, hidden].
  at::Tensor run(at::Tensor x, std::vector<at::Tensor> states, at::Tensor cos, at::Tensor sin, at::Tensor keep,
                 at::Tensor pos) const;
  // `run` between its ends (set_ends): ids [B] (or [B, 1]) int64 the tokens, positions [3, B] (or
  // [3, B, 1]) int64 their mRoPE positions -> logits [B, vocab]: the embedding rows, cos / sin of the rotary angles (as
  // lm/rotary.py), the layers, the head. One call instead of some 30 tensor operations in Python,
  // each of which runs cache-cold after the weight streams (~0.4 ms a step on the benchmark model).
  at::Tensor step(at::Tensor ids, at::Tensor positions, std::vector<at::Tensor> states, at::Tensor keep,
                  at::Tensor pos) const;
  // `step` from Python ints: each row's token, its position (on all three mRoPE axes, as a generated
  // token's) and its cache position. The engine's decode loop then builds no tensor in Python: each
  // tensor operation there runs cache-cold after a step's weight stream (30-80 us each). With the
  // sampler's argmax_rows, the Python of a batch-1 int4 token of the benchmark model went from
  // 0.59-0.66 ms to 0.21-0.24 ms (of ~11 ms).
  at::Tensor step_tokens(std::vector<int64_t> ids, std::vector<int64_t> positions, std::vector<at::Tensor> states,
                         at::Tensor keep, std::vector<int64_t> pos) const;
  // A speculative verify in one call (lm/decode.py verify_logits): `step` over rows that are the
  // tokens of a few sequences, each sequence's tokens consecutive rows. Row r lives in cache row
  // slot[r] (states as `step`'s, one row per sequence; keep [sequences, max(pos) + 1] or empty) at
  // cache position pos[r]; prev[r] is the row whose token comes right before it in its sequence, or
  // -1 for a sequence's first. steps: per DeltaNet layer, in layer order, (window steps [rows, Km1,
  // C], state steps [rows, Hv, Dk, Dv]): row r's conv window and recurrent state after its token,
  // written for every row but a sequence's last, whose are the cache row's own, stepped in place
  // (the caller copies back the accepted row's on a rejection). KV positions are written in place. Returns the final-normed hidden states [rows, hidden] and the
  // logits [rows, vocab].
  std::vector<at::Tensor> verify(std::vector<int64_t> ids, std::vector<int64_t> positions, std::vector<at::Tensor> states,
                    at::Tensor keep, std::vector<int64_t> pos, std::vector<int64_t> slot, std::vector<int64_t> prev,
                    std::vector<at::Tensor> steps) const;

 private:
  // A weight of the plan as its products read it: rows in its format, outputs N, inputs K, and its
  // panel copy (add_panels) or null.
  struct Operand {
    qwen35::Rows W;
    int64_t N = 0, K = 0;
    const void* panels = nullptr;
  };
  struct Layer {
    bool deltanet = false, moe = false;
    std::vector<at::Tensor> mixer, mlp;  // weights in the order of the add_* arguments (kept alive, norms read)
    std::vector<Operand> ops;            // the products' weights: the mixer's projections, then the dense MLP's
    GdnShape gdn{};  // a DeltaNet layer's shapes (B set per step)
    MoeWeights moe_w{};  // a MoE layer's weights
    double scale = 0;
  };
  // The layer stack on the residual rows h [B, hidden] (updated in place) -> out [B, hidden], the
  // final-normed rows: `run` and `step` on raw rows, the activations in buffers kept between steps.
  // cos, sin [B, R] the rotary angles; pos [B] each row's cache position; keep [B, max(pos) + 1] or
  // null (no mask). `run` and `step` check them.
  // A verify's rows (see `verify`): cache row and previous row of each, the DeltaNet steps.
  struct Chain {
    const int64_t *slot, *prev;
    const std::vector<at::Tensor>* steps;
    int64_t sequences;  // cache rows
  };
  void layers(float* h, int64_t B, const std::vector<at::Tensor>& states, const float* cos, const float* sin,
              int64_t R, const bool* keep, int64_t keep_keys, const int64_t* pos, float* out,
              const Chain* chain = nullptr) const;
  // Every layer's cache against the layer, and the positions and key mask against every KV cache,
  // before the first layer steps: a bad cache or position fails the step with the caches untouched.
  // `rows` of the caches (B, or a verify's sequences), B positions.
  void check_caches(const std::vector<at::Tensor>& states, int64_t B, int64_t R, const bool* keep, int64_t keep_keys,
                    const int64_t* pos, int64_t rows) const;
  // `step`'s embedding rows and rotary angles of B tokens into the HIDDEN, COS and SIN buffers
  void ends_in(const int64_t* ids, const int64_t* positions, int64_t B, float** x, float** cos, float** sin) const;
  int64_t hidden_ = 0;
  std::vector<Layer> layers_;
  std::vector<at::Tensor> panels_;  // the panel copies the operands point into (kept alive)
  at::Tensor final_norm_, embedding_, inv_freq_, axis_, head_;
  qwen35::Rows table_;  // the embedding table's rows
  Operand head_op_;     // the LM head's
  double eps_;
};
