// The Python module of the CPU kernels (one module, one build; the kernels live in their own files).

#include <torch/extension.h>

#include <vector>

torch::Tensor small_m_linear(torch::Tensor x, torch::Tensor W);
std::vector<torch::Tensor> multi_linear(torch::Tensor x, std::vector<torch::Tensor> weights);
torch::Tensor grouped_linear(torch::Tensor x, torch::Tensor W, torch::Tensor experts, torch::Tensor offsets);
torch::Tensor gated_delta_step(torch::Tensor state, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                               torch::Tensor decay, torch::Tensor beta);
torch::Tensor gdn_decode(torch::Tensor qkv, torch::Tensor z, torch::Tensor b_in, torch::Tensor a_in,
                         torch::Tensor window, torch::Tensor conv_w, torch::Tensor A_log, torch::Tensor dt_bias,
                         torch::Tensor state, torch::Tensor norm_w, double eps, int64_t num_k_heads);
torch::Tensor moe_decode(torch::Tensor x, torch::Tensor router, torch::Tensor gate_up, torch::Tensor down,
                         int64_t top_k, torch::Tensor sh_gate, torch::Tensor sh_up, torch::Tensor sh_down,
                         torch::Tensor sh_expert_gate, int64_t pieces_per_expert);
torch::Tensor expert_mlp(torch::Tensor x, torch::Tensor gate_up, torch::Tensor down, torch::Tensor offsets);
std::vector<torch::Tensor> chunked_delta_rule(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g,
                                              torch::Tensor beta, torch::Tensor state, int64_t chunk);
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor keep, double scale);
torch::Tensor attention_token(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor q_norm_w,
                              torch::Tensor k_norm_w, double eps, torch::Tensor cos, torch::Tensor sin,
                              torch::Tensor k_cache, torch::Tensor v_cache, int64_t pos, torch::Tensor keep,
                              double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, double offset);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_m_linear", &small_m_linear, "y = x W^T for few rows of x (float32, CPU)");
  m.def("multi_linear", &multi_linear, "[x W_i^T for each W_i], one parallel region");
  m.def("grouped_linear", &grouped_linear, "per-expert y = x W[e]^T over rows grouped by expert");
  m.def("gated_delta_step", &gated_delta_step, "in-place gated delta rule decode step (float32, CPU)");
  m.def("gdn_decode", &gdn_decode, "a Gated DeltaNet decode step from projections to out_proj input");
  m.def("moe_decode", &moe_decode, "a sparse MoE block (router, experts, shared expert) for a few rows");
  m.def("expert_mlp", &expert_mlp, "per-expert SwiGLU over rows grouped by expert (prefill)");
  m.def("chunked_delta_rule", &chunked_delta_rule, "chunked gated delta rule, heads side by side (prefill)");
  m.def("decode_attention", &decode_attention, "one query token per row over the KV cache (GQA)");
  m.def("attention_token", &attention_token, "a gated attention layer for one token per row, projections to o_proj");
  m.def("rms_norm", &rms_norm, "x / rms(x) * (offset + w) per row");
}
