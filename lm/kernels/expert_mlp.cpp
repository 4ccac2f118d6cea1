// Prefill experts: rows of x grouped by expert, each group through its expert's SwiGLU,
//   y[g] = (silu(x[g] Wg^T) * (x[g] Wu^T)) Wd^T   with gate_up [E, 2I, H] = [Wg; Wu], down [E, H, I].
// One expert's group at a time per thread (its GEMMs single-threaded, taken dynamically from a shared
// counter, largest first) instead of multi-threaded GEMMs one expert after another: the short-K
// down products in particular run ~25% faster, and the gate/up activations stay in cache.

#include "vec.h"

#include <c10/core/GradMode.h>

#include <atomic>
#include <numeric>

using namespace qwen35;

at::Tensor expert_mlp(at::Tensor x, at::Tensor gate_up, at::Tensor down, at::Tensor offsets) {
  check(x, "x");
  check(gate_up, "gate_up");
  check(down, "down");
  const int64_t E = gate_up.size(0), I = down.size(2), H = x.size(1);
  TORCH_CHECK(gate_up.size(1) == 2 * I && gate_up.size(2) == H && down.size(0) == E && down.size(1) == H &&
                  offsets.numel() == E + 1 && offsets.scalar_type() == at::kLong,
              "expert shapes do not match");
  auto o = offsets.contiguous();
  const int64_t* op = o.data_ptr<int64_t>();
  TORCH_CHECK(op[0] == 0 && op[E] == x.size(0), "offsets must run from 0 to the number of rows");
  auto y = at::empty({x.size(0), H}, x.options());
  std::vector<int64_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return op[a + 1] - op[a] > op[b + 1] - op[b]; });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    c10::NoGradGuard no_grad;  // inference only (grad mode is per thread)
    for (int64_t i = next++; i < E; i = next++) {
      const int64_t e = order[i], r0 = op[e], rows = op[e + 1] - r0;
      if (rows == 0) break;  // sorted: the rest are empty
      auto h = at::mm(x.narrow(0, r0, rows), gate_up[e].t());  // [rows, 2I]
      auto act = at::silu(h.narrow(1, 0, I)).mul_(h.narrow(1, I, I));
      auto out = y.narrow(0, r0, rows);
      at::mm_out(out, act, down[e].t());
    }
  });
  return y;
}
