// A whole sparse-MoE block for a few tokens (decode):
//   1. router logits and the shared expert's gate logit (one parallel region);
//   2. (serial) float32 softmax, top-k, renormalisation; rows grouped by expert;
//   3. the shared expert and every selected expert in one parallel region, as a queue of pieces
//      taken by the threads in order: first the gate/up pieces of all experts (rows of gate and
//      up -> columns of act = silu(x Wg^T) * (x Wu^T)), then the down pieces (rows of down: their
//      output columns, weighted and added into the running thread's output rows). A down piece
//      waits for its expert's act to be complete, which in queue order has almost always happened.
//      Every piece reads a contiguous block of weights, and no barrier stops the threads between
//      gate/up and down; the thread outputs are summed at the end.
//   out[n] = sum_k w[n, k] expert_k(x[n]) + sigmoid(x[n] . shared_gate) shared(x[n]).
// Only the experts some token selected are read (each once, for all of its rows).

#include "vec.h"

#include <atomic>
#include <numeric>
#include <thread>

using namespace qwen35;

namespace {

// One SwiGLU expert on rows of x: x [M, H], gate/up [I, H], down [H, I]; act [M, I] its activations;
// output row m is added, times weight[m], into out row token[m]. `ready` counts finished gate/up pieces.
struct Expert {
  const float* x;
  int64_t M;
  Rows gate, up, down;  // any weight format (formats.h)
  int64_t I;
  float* act;
  const int64_t* token;
  const float* weight;
  std::atomic<int64_t>* ready;
  const QuantizedX* xq = nullptr;  // x in Q8_0 blocks, once for all gate/up pieces (int8 path)
};

struct Piece {
  int64_t expert, begin, end;  // rows [begin, end) of gate and up, or of down
  bool down;
};

void gate_up_piece(const Expert& e, int64_t i0, int64_t i1, int64_t H, float* scratch) {
  const int64_t w = i1 - i0;
  float *g = scratch, *u = g + e.M * w;
  if (e.xq) {
    block_i8(*e.xq, e.M, e.gate.from(i0), 0, w, g, w);
    block_i8(*e.xq, e.M, e.up.from(i0), 0, w, u, w);
  } else {
    block(e.x, e.M, H, e.gate.from(i0), H, 0, w, g, w);
    block(e.x, e.M, H, e.up.from(i0), H, 0, w, u, w);
  }
  for (int64_t m = 0; m < e.M; ++m)
    for (int64_t i = 0; i < w; ++i) e.act[m * e.I + i0 + i] = silu(g[m * w + i]) * u[m * w + i];
  e.ready->fetch_add(1, std::memory_order_release);
}

void down_piece(const Expert& e, int64_t h0, int64_t h1, int64_t H, float* out, float* scratch) {
  const int64_t w = h1 - h0;
  float* y = scratch;
  block(e.act, e.M, e.I, e.down.from(h0), e.I, 0, w, y, w);
  for (int64_t m = 0; m < e.M; ++m) {
    float* o = out + e.token[m] * H + h0;
    const float c = e.weight[m];
    for (int64_t h = 0; h < w; ++h) o[h] += c * y[m * w + h];
  }
}

// Cut [0, n) into `parts` near-equal ranges, at multiples of 8 rows (whole Q8_0 / Q4_0 groups).
void cut(std::vector<Piece>& pieces, int64_t expert, int64_t n, int64_t parts, bool down) {
  auto at = [&](int64_t p) { return p == parts ? n : n * p / parts / RG * RG; };
  for (int64_t p = 0; p < parts; ++p) pieces.push_back({expert, at(p), at(p + 1), down});  // may be empty: counted
}

}  // namespace

at::Tensor moe_decode(at::Tensor x, at::Tensor router, at::Tensor gate_up, at::Tensor down,
                         int64_t top_k, at::Tensor sh_gate, at::Tensor sh_up, at::Tensor sh_down,
                         at::Tensor sh_expert_gate, int64_t pieces_per_expert) {
  for (auto* t : {&x, &router, &sh_expert_gate}) check(*t, "MoE decode x, router and shared-expert gate");
  const int64_t N = x.size(0), H = x.size(1), E = router.size(0), I = gate_up.size(1) / 2, Is = sh_gate.size(0);
  TORCH_CHECK(router.size(1) == H && gate_up.dim() == 3 && gate_up.size(0) == E && down.dim() == 3 &&
                  down.size(0) == E && down.size(1) == H && sh_up.size(0) == Is && sh_down.size(0) == H &&
                  sh_expert_gate.numel() == H && top_k >= 1 && top_k <= E && N <= 8,
              "MoE decode shapes do not match");
  // the expert weights in any format (formats.h): gate_up [E, 2I, H], down [E, H, I], shared [Is, H] / [H, Is]
  const Rows gu = rows_of(gate_up, H, "experts.gate_up_proj"), dn = rows_of(down, I, "experts.down_proj");
  const Rows sg = rows_of(sh_gate, H, "shared gate_proj"), su = rows_of(sh_up, H, "shared up_proj");
  const Rows sd = rows_of(sh_down, Is, "shared down_proj");
  const auto opt = x.options();
  const float* xp = x.data_ptr<float>();

  // 1. router and shared-expert gate logits
  auto logits = at::empty({N, E}, opt), gate_logit = at::empty({N, 1}, opt);
  run_products({{xp, N, H, rows_of(router, H), E, H, logits.data_ptr<float>()},
                {xp, N, H, rows_of(sh_expert_gate.view({1, H}), H), 1, H, gate_logit.data_ptr<float>()}});

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
  std::vector<int64_t> row_token(S);
  std::vector<float> row_weight(S);
  for (int64_t s = 0; s < S; ++s) {
    std::copy(xp + (s / top_k) * H, xp + (s / top_k + 1) * H, xsp + slot[s] * H);
    row_token[slot[s]] = s / top_k;
    row_weight[slot[s]] = weight[s];
  }

  // 3. the experts: the shared one first (all rows), then the selected ones, most rows first
  std::vector<int64_t> tokens(N);
  std::iota(tokens.begin(), tokens.end(), 0);
  std::vector<float> shared_weight(N);
  const float* glp = gate_logit.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) shared_weight[n] = sigmoid(glp[n]);
  std::vector<int64_t> hit;
  for (int64_t e = 0; e < E; ++e)
    if (count[e]) hit.push_back(e);
  std::stable_sort(hit.begin(), hit.end(), [&](int64_t a, int64_t b) { return count[a] > count[b]; });
  auto acts = at::empty({N * Is + S * I}, opt);
  float* actp = acts.data_ptr<float>();
  std::vector<std::atomic<int64_t>> ready(hit.size() + 1);
  for (auto& r : ready) r.store(0);
  std::vector<Expert> experts{{xp, N, sg, su, sd, Is, actp, tokens.data(), shared_weight.data(), &ready[0]}};
  for (size_t j = 0; j < hit.size(); ++j) {
    const int64_t e = hit[j];
    experts.push_back({xsp + start[e] * H, count[e], gu.from(e * 2 * I), gu.from((e * 2 + 1) * I), dn.from(e * H),
                       I, actp + N * Is + start[e] * I, row_token.data() + start[e], row_weight.data() + start[e],
                       &ready[j + 1]});
  }
  std::vector<QuantizedX> xqs(experts.size());
  for (size_t j = 0; j < experts.size(); ++j)
    if (int8_path(experts[j].gate)) {
      quantize_x(experts[j].x, experts[j].M, H, H, xqs[j]);
      experts[j].xq = &xqs[j];
    }
  const int64_t parts = std::max<int64_t>(1, pieces_per_expert);
  std::vector<Piece> pieces;
  for (size_t j = 0; j < experts.size(); ++j) cut(pieces, j, experts[j].I, parts, false);
  for (size_t j = 0; j < experts.size(); ++j) cut(pieces, j, H, parts, true);

  const int64_t T = at::get_num_threads();
  auto partial = at::zeros({T, N, H}, opt);  // each thread's share of the output
  std::atomic<int64_t> next{0};
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t) {
    std::vector<float> scratch(2 * 8 * std::max(std::max(I, Is), H));
    float* out = partial.data_ptr<float>() + t0 * N * H;
    for (int64_t p = next++; p < (int64_t)pieces.size(); p = next++) {
      const Piece& piece = pieces[p];
      const Expert& e = experts[piece.expert];
      if (!piece.down) {
        gate_up_piece(e, piece.begin, piece.end, H, scratch.data());
        continue;
      }
      while (e.ready->load(std::memory_order_acquire) < parts) std::this_thread::yield();  // gate/up still running
      down_piece(e, piece.begin, piece.end, H, out, scratch.data());
    }
  });
  return partial.sum(0);
}
