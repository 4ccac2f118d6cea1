// Prefill form of the gated delta rule (see lm/delta_rule.py, chunked_gated_delta_rule: the same
// maths, op for op, except that each chunk's triangular system is inverted and then applied, which
// is cheaper than solving it for all Dv + Dk right-hand sides), one (row, head) per thread at a
// time: each head's chunk scan is a sequence of small matrix products, which run far better
// single-threaded side by side than split across threads one at a time.

#include "kernels.h"
#include "vec.h"

#include <c10/core/GradMode.h>

#include <immintrin.h>

#include <atomic>

using namespace qwen35;

namespace {

// Denormal floats read and written as zero (MXCSR's DAZ and FTZ) in this thread while it lives. A
// decay below 2^-126 (the smallest normal float) then counts as 0, a change of less than 2^-126
// relative to the terms beside it, and every float operation runs at full speed.
struct FlushDenormals {
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
};

}  // namespace

// q, k [BH, T, Dk] (unit-norm, q scaled), v [BH, T, Dv], g, beta [BH, T], state [BH, Dk, Dv] (not
// modified) -> (out [BH, T, Dv], new state [BH, Dk, Dv]).
std::vector<at::Tensor> chunked_delta_rule(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g, at::Tensor beta,
                                           at::Tensor state, int64_t chunk) {
  for (auto* t : {&q, &k, &v, &g, &beta, &state}) check(*t, "delta rule tensors");
  const int64_t BH = q.size(0), T = q.size(1), Dk = q.size(2), Dv = v.size(2);
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(0) == BH && v.size(1) == T && g.size(0) == BH && g.size(1) == T &&
                  beta.sizes() == g.sizes() && state.size(0) == BH && state.size(1) == Dk && state.size(2) == Dv,
              "delta rule shapes do not match");
  const int64_t pad = (chunk - T % chunk) % chunk, N = (T + pad) / chunk, C = chunk;
  auto out = at::empty({BH, N * C, Dv}, v.options());
  auto new_state = at::empty_like(state);
  const auto opt = q.options();
  const auto causal = at::ones({C, C}, opt.dtype(at::kBool)).tril();
  const auto eye = at::eye(C, opt);
  std::atomic<int64_t> next{0};
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const WorkerModes modes(inference);
    const FlushDenormals flush;  // strongly decaying heads make denormal decays (exp of -100s): 4-8x slower
    for (int64_t h = next++; h < BH; h = next++) {
      // padded steps have k = v = 0 and g = 0: they leave the state untouched
      auto qh = at::constant_pad_nd(q[h], {0, 0, 0, pad}).view({N, C, Dk});
      auto kh = at::constant_pad_nd(k[h], {0, 0, 0, pad}).view({N, C, Dk});
      auto vh = at::constant_pad_nd(v[h], {0, 0, 0, pad}).view({N, C, Dv});
      auto gh = at::constant_pad_nd(g[h], {0, pad}).view({N, C});
      auto bh = at::constant_pad_nd(beta[h], {0, pad}).view({N, C}).unsqueeze(-1);
      auto gamma = gh.cumsum(-1);  // [N, C]
      auto decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill_(causal.logical_not(), -INFINITY).exp_();
      auto k_beta = kh * bh;
      auto system = at::bmm(k_beta, kh.transpose(1, 2)).mul_(decay).tril_(-1).add_(eye);
      auto rhs = at::cat({vh * bh, k_beta * gamma.exp().unsqueeze(-1)}, -1);
      // solve against the identity (C right-hand sides, not Dv + Dk), then one batched product
      auto inverse = at::linalg_solve_triangular(system, eye.expand({N, C, C}), /*upper=*/false, /*left=*/true,
                                                 /*unitriangular=*/true);
      auto sol = at::bmm(inverse, rhs);
      auto u = sol.narrow(-1, 0, Dv), w = sol.narrow(-1, Dv, Dk);
      auto intra = at::bmm(qh, kh.transpose(1, 2)).mul_(decay);
      auto q_decayed = qh * gamma.exp().unsqueeze(-1);
      auto k_to_end = kh * (gamma.narrow(1, C - 1, 1) - gamma).exp().unsqueeze(-1);
      auto chunk_decay = gamma.select(1, C - 1).exp();
      auto s = state[h].clone();
      auto oh = out[h].view({N, C, Dv});
      for (int64_t i = 0; i < N; ++i) {
        auto v_new = u[i] - at::mm(w[i], s);
        auto o = oh[i];
        at::addmm_out(o, at::mm(q_decayed[i], s), intra[i], v_new);
        s = at::addmm(s * chunk_decay[i], k_to_end[i].t(), v_new);
      }
      new_state[h].copy_(s);
    }
  });
  return {out.narrow(1, 0, T), new_state};
}
