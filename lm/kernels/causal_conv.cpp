// Depthwise causal conv + SiLU along time for prefill (lm/gated_deltanet.py, causal_conv: the same
// sum in the same order) and its SiLU, in one pass over [B, T, C], instead of a concatenation, K
// multiply-add passes and a SiLU pass: out[b, t, c] = silu(sum_j full[b, t + j, c] * w[c, j])
// with full = [window; x].

#include "vec.h"

using namespace qwen35;

// x [B, T, C]; window [B, K-1, C] the previous inputs; weight [C, K] -> (out [B, T, C], new window)
std::vector<at::Tensor> causal_conv(at::Tensor x, at::Tensor window, at::Tensor weight) {
  for (auto* t : {&x, &window, &weight}) check(*t, "causal conv tensors");
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), K = weight.size(1);
  TORCH_CHECK(x.dim() == 3 && window.size(0) == B && window.size(1) == K - 1 && window.size(2) == C &&
                  weight.size(0) == C && K >= 1,
              "causal conv shapes do not match");
  auto out = at::empty_like(x);
  auto new_window = at::empty_like(window);
  // the weight transposed to [K, C], so that each tap is a contiguous row over the channels
  auto wt = weight.t().contiguous();
  const float *xp = x.data_ptr<float>(), *wp = window.data_ptr<float>(), *tp = wt.data_ptr<float>();
  float *op = out.data_ptr<float>(), *nw = new_window.data_ptr<float>();
  auto full_row = [&](int64_t b, int64_t f) {  // row f of full = [window; x] for batch row b
    return f < K - 1 ? wp + (b * (K - 1) + f) * C : xp + (b * T + f - (K - 1)) * C;
  };
  at::parallel_for(0, B * T, std::max<int64_t>(1, 16384 / std::max<int64_t>(C, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / T, t = r % T;
      float* o = op + r * C;
      for (int64_t j = 0; j < K; ++j) {
        const float *in = full_row(b, t + j), *w = tp + j * C;
        if (j == 0)
          for (int64_t c = 0; c < C; ++c) o[c] = in[c] * w[c];
        else
          for (int64_t c = 0; c < C; ++c) o[c] += in[c] * w[c];
      }
      silu_mul(o, nullptr, o, C);  // SiLU while the row is in L1 (vexp; a scalar exp took 3x the conv)
    }
  });
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < K - 1; ++i) {  // rows T .. T+K-2 of full
      const float* in = full_row(b, T + i);
      std::copy(in, in + C, nw + (b * (K - 1) + i) * C);
    }
  return {out, new_window};
}
