// Prefill experts: the tokens' selections grouped by expert, each group through its expert's SwiGLU,
//   y[g] = (silu(x[g] Wg^T) * (x[g] Wu^T)) Wd^T   with gate_up [E, 2I, H] = [Wg; Wu], down [E, H, I],
// weighted by the routing weights and summed into the tokens' rows (no [N*K, H] buffers).
// One expert's group at a time per thread (its GEMMs single-threaded, taken dynamically from a shared
// counter, largest first) instead of multi-threaded GEMMs one expert after another: the short-K
// down products in particular run ~25% faster, and the gate/up activations stay in cache.
// Q8_0 / Q4_0 experts with int8 activations on (the default) take the decode products' int8 path:
// each group's rows of x, then their activations, rounded to Q8_0 blocks, and integer dot products
// (int8_dot.h: the same error as in decode; in turns against the float32 conversion below, ~2x on
// the GEMMs). Under bf16 compute, AMX tiles where there are some, else (AVX512-BF16) each expert's
// weights converted to bf16 rows and torch's bf16 GEMM. Otherwise compact formats (bf16, or int8
// activations off) are converted to float32 per expert into the thread's scratch first: once per
// expert per prefill call, shared by all of its token rows.

#include "kernels.h"
#include "vec.h"

#include <c10/core/GradMode.h>

#include <atomic>
#include <numeric>

using namespace qwen35;

// x [N, H] the token rows; the selections grouped by expert: offsets [E + 1] their bounds, token [S]
// the token of each, weight [S] its routing weight. Returns [N, H] = sum over selections s of
// weight[s] * expert(x[token[s]]): each thread gathers its expert's rows (they stay in cache) and
// keeps their outputs; then the outputs are weighted and added into the tokens' rows, the columns
// split among the threads and the selections in order, so that each sum's additions come in one
// order: the same bits on every call. (Adding into per-thread rows, whichever thread took an expert,
// and summing those made a prefill of more than a few tokens differ from call to call in its last
// bits, and a greedy generation's near-ties with it.) The kept outputs take S x H floats.
at::Tensor expert_mlp(at::Tensor x, Weight gate_up_w, Weight down_w, at::Tensor offsets, at::Tensor token,
                      at::Tensor weight, int64_t compute) {
  check(x, "x");
  check(weight, "weight");
  const at::Tensor &gate_up = tensor_of(gate_up_w), &down = tensor_of(down_w);
  const int64_t E = gate_up.size(0), I = gate_up.size(1) / 2, N = x.size(0), H = x.size(1), S = token.numel();
  const Rows gu = rows_of(gate_up_w, H, "experts.gate_up_proj"), dn = rows_of(down_w, I, "experts.down_proj");
  const bool compact = gu.fmt != F32 || dn.fmt != F32;
  // compute (lm/kernels/compute.py): 0 float32, 1 bf16 (on AMX tiles, else torch's bf16 GEMM), 2 int8
  // dot products where the weights allow, 3 the same on AMX tiles
  const bool i8 = compute >= 2 && int8_path(gu) && int8_path(dn);  // Q8_0 / Q4_0, int8 activations on
  const bool i8_tiles = i8 && compute == 3 && amx_ready();
  const bool amx = compute == 1 && amx_ready();
  const bool bf16 = compute == 1 && !amx && compact;  // bf16 without AMX: torch's bf16 GEMM (bf16_rows_mm)
  TORCH_CHECK(!bf16 || bf16_rows_built(), "expert_mlp: bf16 compute needs AMX or a build with AVX512-BF16");
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && down.size(0) == E && down.size(1) == H &&
                  offsets.numel() == E + 1 && offsets.scalar_type() == at::kLong &&
                  token.scalar_type() == at::kLong && weight.numel() == S,
              "expert shapes do not match");
  auto o = offsets.contiguous();
  auto tok = token.contiguous();
  const int64_t *op = o.data_ptr<int64_t>(), *tp = tok.data_ptr<int64_t>();
  const float* wp = weight.data_ptr<float>();
  TORCH_CHECK(op[0] == 0 && op[E] == S, "offsets must run from 0 to the number of selections");
  for (int64_t s = 0; s < S; ++s) TORCH_CHECK(tp[s] >= 0 && tp[s] < N, "token index out of range");
  std::vector<int64_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return op[a + 1] - op[a] > op[b + 1] - op[b]; });
  const int64_t T = at::get_num_threads();
  std::vector<at::Tensor> ys(E);  // each expert's outputs [rows, H], unweighted
  std::atomic<int64_t> next{0};
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, T, 1, [&](int64_t, int64_t) {
    const WorkerModes modes(inference);  // inference only (grad and inference modes are per thread)
    at::Tensor gate_up_f, down_f;  // this thread's float32 copy of the current expert (compact formats)
    QuantizedX xq;  // this thread's current expert's rows of x, then of act, in Q8_0 blocks (int8 path)
    std::vector<float> h_buf, act_buf;  // and their gate / up outputs and activations (int8 path)
    if (compact && !i8 && !amx && !bf16)
      gate_up_f = at::empty({2 * I, H}, x.options()), down_f = at::empty({H, I}, x.options());
    for (int64_t i = next++; i < E; i = next++) {
      const int64_t e = order[i], r0 = op[e], rows = op[e + 1] - r0;
      if (rows == 0) break;  // sorted: the rest are empty
      if (i8 && !i8_tiles) {  // x's rows and act rounded to Q8_0, integer dot products (int8_dot.h)
        h_buf.resize(rows * 2 * I), act_buf.resize(rows * I);
        ys[e] = at::empty({rows, H}, x.options());
        float *hp = h_buf.data(), *ap = act_buf.data(), *yp = ys[e].data_ptr<float>();
        quantize_x(x.data_ptr<float>(), rows, H, H, xq, tp + r0);  // the expert's tokens, gathered
        block_i8_rows(xq, rows, gu.from(e * 2 * I), 0, 2 * I, hp, 2 * I);
        for (int64_t r = 0; r < rows; ++r) silu_mul(hp + r * 2 * I, hp + r * 2 * I + I, ap + r * I, I);
        quantize_x(ap, rows, I, I, xq);
        block_i8_rows(xq, rows, dn.from(e * H), 0, H, yp, H);
        continue;
      }
      auto xe = at::index_select(x, 0, tok.narrow(0, r0, rows));  // [rows, H]
      if (i8_tiles) {  // x and act rounded to Q8_0, integer products on AMX tiles (amx_linear.cpp)
        auto h = amx_int8_linear(xe, {gate_up[e], gu.fmt});  // [rows, 2I]
        ys[e] = amx_int8_linear(at::silu(h.narrow(1, 0, I)).mul_(h.narrow(1, I, I)), {down[e], dn.fmt});  // [rows, H]
        continue;
      }
      if (amx) {  // bf16 tiles, each expert's weights converted in panels (amx_linear.cpp), one thread
        auto h = amx_linear(xe, {gate_up[e], gu.fmt});  // [rows, 2I]
        ys[e] = amx_linear(at::silu(h.narrow(1, 0, I)).mul_(h.narrow(1, I, I)), {down[e], dn.fmt});  // [rows, H]
        continue;
      }
      if (bf16) {  // each expert's weights converted to bf16 rows, torch's bf16 GEMM (AVX512-BF16)
        auto h = bf16_rows_mm(xe, {gate_up[e], gu.fmt});  // [rows, 2I]
        ys[e] = bf16_rows_mm(at::silu(h.narrow(1, 0, I)).mul_(h.narrow(1, I, I)), {down[e], dn.fmt});  // [rows, H]
        continue;
      }
      if (compact) {
        to_float(gu.from(e * 2 * I), 2 * I, H, gate_up_f.data_ptr<float>());
        to_float(dn.from(e * H), H, I, down_f.data_ptr<float>());
      }
      auto h = at::mm(xe, (compact ? gate_up_f : gate_up[e]).t());  // [rows, 2I]
      auto act = at::silu(h.narrow(1, 0, I)).mul_(h.narrow(1, I, I));
      ys[e] = at::mm(act, (compact ? down_f : down[e]).t());  // [rows, H]
    }
  });
  auto out = at::zeros({N, H}, x.options());
  float* op_out = out.data_ptr<float>();
  at::parallel_for(0, H, V, [&](int64_t c0, int64_t c1) {  // one block of columns a thread
    for (int64_t e = 0; e < E; ++e) {
      if (!ys[e].defined()) continue;
      const float* yp = ys[e].data_ptr<float>();
      for (int64_t r = 0, rows = op[e + 1] - op[e]; r < rows; ++r) {
        float* dst = op_out + tp[op[e] + r] * H;
        const float c = wp[op[e] + r];
        for (int64_t j = c0; j < c1; ++j) dst[j] += c * yp[r * H + j];
      }
    }
  });
  return out;
}
