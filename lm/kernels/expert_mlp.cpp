// Prefill experts: the tokens' selections grouped by expert, each group through its expert's SwiGLU,
//   y[g] = (silu(x[g] Wg^T) * (x[g] Wu^T)) Wd^T   with gate_up [E, 2I, H] = [Wg; Wu], down [E, H, I],
// weighted by the routing weights and summed into the tokens' rows (no [N*K, H] buffers).
// One expert's group at a time per thread (its GEMMs single-threaded, taken dynamically from a shared
// counter, largest first) instead of multi-threaded GEMMs one expert after another: the short-K
// down products in particular run ~25% faster, and the gate/up activations stay in cache.

#include "vec.h"

#include <c10/core/GradMode.h>

#include <atomic>
#include <numeric>

using namespace qwen35;

// x [N, H] the token rows; the selections grouped by expert: offsets [E + 1] their bounds, token [S]
// the token of each, weight [S] its routing weight. Returns [N, H] = sum over selections s of
// weight[s] * expert(x[token[s]]): each thread gathers its expert's rows (they stay in cache) and
// adds its weighted outputs into its own output rows; the threads' rows are summed at the end.
at::Tensor expert_mlp(at::Tensor x, at::Tensor gate_up, at::Tensor down, at::Tensor offsets, at::Tensor token,
                      at::Tensor weight) {
  check(x, "x");
  check(gate_up, "gate_up");
  check(down, "down");
  check(weight, "weight");
  const int64_t E = gate_up.size(0), I = down.size(2), N = x.size(0), H = x.size(1), S = token.numel();
  TORCH_CHECK(gate_up.size(1) == 2 * I && gate_up.size(2) == H && down.size(0) == E && down.size(1) == H &&
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
  auto partial = at::zeros({T, N, H}, x.options());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t) {
    c10::NoGradGuard no_grad;  // inference only (grad mode is per thread)
    float* out = partial.data_ptr<float>() + t0 * N * H;
    for (int64_t i = next++; i < E; i = next++) {
      const int64_t e = order[i], r0 = op[e], rows = op[e + 1] - r0;
      if (rows == 0) break;  // sorted: the rest are empty
      auto xe = at::index_select(x, 0, tok.narrow(0, r0, rows));  // [rows, H]
      auto h = at::mm(xe, gate_up[e].t());                         // [rows, 2I]
      auto act = at::silu(h.narrow(1, 0, I)).mul_(h.narrow(1, I, I));
      auto y = at::mm(act, down[e].t());  // [rows, H]
      const float* yp = y.data_ptr<float>();
      for (int64_t r = 0; r < rows; ++r) {
        float* dst = out + tp[r0 + r] * H;
        const float c = wp[r0 + r];
        for (int64_t j = 0; j < H; ++j) dst[j] += c * yp[r * H + j];
      }
    }
  });
  return T == 1 ? partial[0] : partial.sum(0);
}
