// The Python module of the CPU kernels (one module, one build; the kernels live in their own files).

#include <omp.h>
#include <torch/extension.h>

#include "formats.h"
#include "int8_dot.h"
#include "kernels.h"

// Every weight argument is a (tensor, format code) pair (formats.h: Weight; lm/formats: Format.code).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_m_linear", &small_m_linear, "y = x W^T for few rows of x (float32, CPU)", py::arg("x"),
        py::arg("weight"), py::arg("panels"));
  m.def("multi_linear", &multi_linear, "[x W_i^T for each W_i], one parallel region", py::arg("x"),
        py::arg("weights"), py::arg("panels") = std::vector<at::Tensor>());
  m.def("int8_linear", &int8_linear, "y = x W^T for many rows of x and a Q8_0 / Q4_0 W, x rounded to Q8_0 (prefill)",
        py::arg("x"), py::arg("weight"));
  m.def("amx_linear", &amx_linear, "y = x W^T for many rows of x, W of any format, in bf16 on AMX tiles (prefill)",
        py::arg("x"), py::arg("weight"));
  m.def("amx_int8_linear", &amx_int8_linear, "y = x W^T for many rows of x and a Q8_0 / Q4_0 W, x rounded "
        "to Q8_0, in int8 on AMX tiles (prefill)", py::arg("x"), py::arg("weight"));
  m.def("amx_ready", &amx_ready, "whether this build has the AMX-BF16 products and the OS lets this process use tiles");
  m.def("dequantize", &dequantize, "a (weight [..., N, row], format code) of any format (formats.h) -> float32 [..., N, K]",
        py::arg("weight"), py::arg("K"));
  // the accumulator width the format kernels were built with (16 floats with AVX-512, 8 with AVX2)
  m.attr("VECTOR_FLOATS") = qwen35::W;
  m.attr("INT8_DOT") = qwen35::INT8_DOT;  // built with the int8-activation dot products (AVX2)
  m.attr("VNNI") = qwen35::VNNI;  // ... and they use vpdpbusd (AVX512-VNNI or AVX-VNNI)
  m.def("set_int8_activations", [](bool on) { qwen35::int8_activations() = on; },
        "Q8_0 / Q4_0 products with activations quantized to Q8_0 (on) or in float32 (off)");
  m.def("int8_activations", [] { return qwen35::int8_activations(); }, "whether set_int8_activations is on");
  m.def("grouped_linear", &grouped_linear, "per-expert y = x W[e]^T over rows grouped by expert");
  m.def("gated_delta_step", &gated_delta_step, "in-place gated delta rule decode step (float32, CPU)");
  m.def("gdn_decode", &gdn_decode, "a Gated DeltaNet decode step from projections to out_proj input");
  m.def("moe_decode", &moe_decode, "a sparse MoE block (router, experts, shared expert) for a few rows");
  m.def("expert_mlp", &expert_mlp, "tokens through their selected experts, weighted and summed (prefill)");
  m.def("chunked_delta_rule", &chunked_delta_rule, "chunked gated delta rule, heads side by side (prefill)");
  m.def("decode_attention", &decode_attention,
        "one query token per row over the KV cache (GQA); lengths [B] int64 per row, or empty: all keys");
  m.def("rms_norm", &rms_norm, "x / rms(x) * (offset + w) per row");
  m.def("gated_rms_norm", &gated_rms_norm, "w * x / rms(x) * silu(z) per row (the Gated DeltaNet output norm)");
  m.def("argmax", &argmax, "the index of the first largest value of a float32 vector, or of its first NaN (numpy's rules)");
  // the calling thread's OpenMP worker threads end (its next parallel region starts new ones):
  // lm.kernels.release_openmp_workers says why. 0 on success, -1 inside a parallel region.
  m.def("release_openmp_workers", [] { return omp_pause_resource_all(omp_pause_soft); });
  m.def("instruction_peak", &instruction_peak, "op/s of the products' 'fp32' FMA or 'int8' dot instruction, in registers "
        "on every thread (a benchmark's limit)", py::arg("kind"), py::arg("steps") = 20000000);
  m.def("argmax_rows", &argmax_rows, "argmax of each row of a float32 [B, V] tensor (argmax's rules)");
  m.def("largest_k", &largest_k, "(values, indices) of the k largest values of a float32 vector, best first: torch.topk's "
        "order for distinct values (NaN first), equal values by index", py::arg("x"), py::arg("k"));
  m.def("apply_token_bits", &apply_token_bits, "logits with -inf where a packed token bitmask's bit is clear (a new tensor)");
  m.def("causal_conv", &causal_conv, "depthwise causal conv + SiLU along time, one pass (prefill)");
  m.def("bf16_attention", &bf16_attention, "softmax(scale q k^T) v of bf16 q [B, T, H, D], k, v [B, L, KV, D] (AVX512-BF16)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("causal") = false);
  m.attr("BF16_ROWS") = bf16_rows_built();  // built with AVX512-BF16: bf16 experts without AMX (expert_mlp)
  m.attr("BF16_ATTENTION") = bf16_attention_built();  // built with AVX512-BF16: bf16_attention runs
  // module_local: two builds of these kernels can be loaded in one process (an A/B of two versions)
  py::class_<DecodePlan>(m, "DecodePlan", py::module_local(), "a whole decode step through the layer stack (see kernels.h)")
      .def(py::init<double>())
      .def("add_deltanet", &DecodePlan::add_deltanet)
      .def("add_attention", &DecodePlan::add_attention)
      .def("add_moe", &DecodePlan::add_moe)
      .def("add_dense_mlp", &DecodePlan::add_dense_mlp)
      .def("set_final_norm", &DecodePlan::set_final_norm)
      .def("add_panels", &DecodePlan::add_panels)
      .def("run", &DecodePlan::run)
      .def("set_ends", &DecodePlan::set_ends)
      .def("has_ends", &DecodePlan::has_ends)
      // a step runs without the GIL: the server's other threads (HTTP, detokenising) go on meanwhile
      .def("step", &DecodePlan::step, py::call_guard<py::gil_scoped_release>())
      .def("step_tokens", &DecodePlan::step_tokens, py::call_guard<py::gil_scoped_release>())
      .def("verify", &DecodePlan::verify, py::call_guard<py::gil_scoped_release>());
}
