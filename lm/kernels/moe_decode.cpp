// A whole sparse-MoE block for a few tokens (decode), in three parallel regions:
//   1. router logits (and the shared expert's gate logit);
//   2. (serial) float32 softmax, top-k, renormalisation; rows grouped by expert;
//      then the selected experts' gate_up products together with the shared expert's gate and up;
//   3. the down products of the selected experts and of the shared expert;
//   out[n] = sum_k w[n, k] expert_k(x[n]) + sigmoid(x[n] . shared_gate) shared(x[n]).
// Only the experts some token selected are read (each once, for all of its rows).

#include "vec.h"

#include <numeric>

using namespace qwen35;

// x [N, H]; router [E, H]; gate_up [E, 2I, H] (gate rows, then up rows); down [E, H, I];
// shared gate/up [Is, H], shared down [H, Is], shared expert gate [1, H] -> [N, H].
at::Tensor moe_decode(at::Tensor x, at::Tensor router, at::Tensor gate_up, at::Tensor down,
                         int64_t top_k, at::Tensor sh_gate, at::Tensor sh_up, at::Tensor sh_down,
                         at::Tensor sh_expert_gate) {
  for (auto* t : {&x, &router, &gate_up, &down, &sh_gate, &sh_up, &sh_down, &sh_expert_gate})
    check(*t, "MoE decode tensors");
  const int64_t N = x.size(0), H = x.size(1), E = router.size(0), I = down.size(2), Is = sh_gate.size(0);
  TORCH_CHECK(router.size(1) == H && gate_up.size(0) == E && gate_up.size(1) == 2 * I && gate_up.size(2) == H &&
                  down.size(0) == E && down.size(1) == H && sh_up.size(0) == Is && sh_down.size(0) == H &&
                  sh_down.size(1) == Is && sh_expert_gate.numel() == H && top_k >= 1 && top_k <= E && N <= 8,
              "MoE decode shapes do not match");
  const auto opt = x.options();
  const float* xp = x.data_ptr<float>();

  // 1. router and shared-expert gate logits
  auto logits = at::empty({N, E}, opt), gate_logit = at::empty({N, 1}, opt);
  run_products({{xp, N, H, router.data_ptr<float>(), E, H, logits.data_ptr<float>()},
                {xp, N, H, sh_expert_gate.data_ptr<float>(), 1, H, gate_logit.data_ptr<float>()}});

  // 2. routing: top-k of the softmax, renormalised; selections grouped by expert (stable)
  const int64_t S = N * top_k;
  std::vector<int64_t> chosen(S), count(E, 0);
  std::vector<float> weight(S), probs(E);
  std::vector<int64_t> idx(E);
  const float* lp = logits.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    const float* l = lp + n * E;
    const float m = *std::max_element(l, l + E);
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += (probs[e] = std::exp(l[e] - m));
    for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + top_k, idx.end(),
                      [&](int64_t a, int64_t b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); });
    float total = 0.f;
    for (int64_t k = 0; k < top_k; ++k) total += probs[idx[k]];
    for (int64_t k = 0; k < top_k; ++k) {
      chosen[n * top_k + k] = idx[k];
      weight[n * top_k + k] = probs[idx[k]] / total;
      ++count[idx[k]];
    }
  }
  std::vector<int64_t> start(E + 1, 0), slot(S);  // slot[s]: row of selection s in the grouped order
  for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + count[e];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t s = 0; s < S; ++s) slot[s] = fill[chosen[s]]++;
  }
  auto xs = at::empty({S, H}, opt);
  float* xsp = xs.data_ptr<float>();
  for (int64_t s = 0; s < S; ++s) std::copy(xp + (s / top_k) * H, xp + (s / top_k + 1) * H, xsp + slot[s] * H);

  // 3. gate_up of the selected experts, gate and up of the shared expert
  auto gu = at::empty({S, 2 * I}, opt), sgu = at::empty({2, N, Is}, opt);
  float *gup = gu.data_ptr<float>(), *sgp = sgu.data_ptr<float>(), *sup = sgp + N * Is;
  std::vector<Product> products;
  for (int64_t e = 0; e < E; ++e)
    if (count[e])
      products.push_back({xsp + start[e] * H, count[e], H, gate_up.data_ptr<float>() + e * 2 * I * H, 2 * I, H,
                          gup + start[e] * 2 * I});
  products.push_back({xp, N, H, sh_gate.data_ptr<float>(), Is, H, sgp});
  products.push_back({xp, N, H, sh_up.data_ptr<float>(), Is, H, sup});
  run_products(products);
  auto act = at::empty({S, I}, opt);
  float* ap = act.data_ptr<float>();
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = 0; i < I; ++i) ap[s * I + i] = silu(gup[s * 2 * I + i]) * gup[s * 2 * I + I + i];
  for (int64_t i = 0; i < N * Is; ++i) sgp[i] = silu(sgp[i]) * sup[i];

  // 4. down products
  auto ys = at::empty({S, H}, opt), shared = at::empty({N, H}, opt);
  float *ysp = ys.data_ptr<float>(), *shp = shared.data_ptr<float>();
  products.clear();
  for (int64_t e = 0; e < E; ++e)
    if (count[e])
      products.push_back({ap + start[e] * I, count[e], I, down.data_ptr<float>() + e * H * I, H, I, ysp + start[e] * H});
  products.push_back({sgp, N, Is, sh_down.data_ptr<float>(), H, Is, shp});
  run_products(products);

  // 5. weighted sum of the chosen experts, plus the gated shared expert
  auto out = at::empty({N, H}, opt);
  float* op = out.data_ptr<float>();
  const float* glp = gate_logit.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    float* o = op + n * H;
    std::fill(o, o + H, 0.f);
    for (int64_t k = 0; k < top_k; ++k) {
      const float w = weight[n * top_k + k];
      const float* y = ysp + slot[n * top_k + k] * H;
      for (int64_t h = 0; h < H; ++h) o[h] += w * y[h];
    }
    const float g = sigmoid(glp[n]);
    for (int64_t h = 0; h < H; ++h) o[h] += g * shp[n * H + h];
  }
  return out;
}
