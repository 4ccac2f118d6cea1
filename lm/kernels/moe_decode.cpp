// A whole sparse-MoE block for a few tokens (decode), in one parallel region whose threads take
// pieces of work from one queue, in order:
//   1. the router logits (its rows cut into one piece per thread; the first piece also takes the
//      shared expert's gate logit). The thread that finishes the last router piece does the routing
//      (float32 softmax, top-k, renormalisation; the rows of experts several tokens chose side by side)
//      and publishes it, while the other threads go on with the shared expert;
//   2. the gate/up pieces, first the shared expert's, then every selected expert's (rows of gate and
//      up -> columns of act = silu(x Wg^T) * (x Wu^T));
//   3. once the queue is empty, the down pieces, shared then selected (rows of down: their output
//      columns, weighted and added into the thread's output rows): down piece d goes to thread
//      d mod T, which takes its pieces in order. A down piece waits for its expert's act to be
//      complete, which has almost always happened; a piece past the shared expert's gate/up waits
//      for the routing.
//   out[n] = sum_k w[n, k] expert_k(x[n]) + sigmoid(x[n] . shared_gate) shared(x[n]).
// Every piece reads a contiguous block of weights, and no barrier stops the threads between the
// router, gate/up and down: the serial routing overlaps the shared expert's weight stream, and a
// decode step pays one fork/join per MoE block. Only the experts some token selected are read (each
// once, for all of its rows). The thread outputs are summed at the end, in thread order. With the
// down pieces dealt out in a fixed way, each output's additions come in one order: the same input
// gives the same bits on every call (with the down pieces in the queue too, whichever thread took
// one added it to its own sum, and 87-99% of repeated calls differed in their last bits, and
// greedy near-ties with them). Whole batch-1 steps against the queued down pieces: within the noise.

#include "kernels.h"
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
  const QuantizedX* xq = nullptr;  // x in Q8_0 blocks (int8 path): rows [x0, x0 + M) of *xq
  int64_t x0 = 0;
};

void gate_up_piece(const Expert& e, int64_t i0, int64_t i1, int64_t H, float* scratch) {
  const int64_t w = i1 - i0;
  float *g = scratch, *u = g + e.M * w;
  if (e.xq) {
    block_i8(*e.xq, e.M, e.gate.from(i0), 0, w, g, w, e.x0);
    block_i8(*e.xq, e.M, e.up.from(i0), 0, w, u, w, e.x0);
  } else {
    block(e.x, e.M, H, e.gate.from(i0), H, 0, w, g, w);
    block(e.x, e.M, H, e.up.from(i0), H, 0, w, u, w);
  }
  for (int64_t m = 0; m < e.M; ++m) silu_mul(g + m * w, u + m * w, e.act + m * e.I + i0, w);
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

// Bound p of `parts` near-equal ranges of [0, n), at multiples of 8 rows (whole Q8_0 / Q4_0 groups).
int64_t cut(int64_t n, int64_t p, int64_t parts) { return p == parts ? n : n * p / parts / RG * RG; }

// The routing of N rows of router logits [N, E] (step 1 above), and the experts it selects, which it
// writes into experts[1..] (experts[0], the shared one, is set up before): returns their count.
// An expert one token selected reads that token's row of x (and of x's Q8_0 blocks, quantized once
// before the region) where it is; the rows of an expert several tokens selected are copied side by
// side (float32 rows, or their Q8_0 blocks: the same bytes a quantization of the copies would give).
// Its buffers live in the caller's Workspace (below), so a call allocates nothing once warm.
// (It runs serially while the other threads stream the shared expert. Quantizing a copy of x per
// selection instead, it took 15k cycles with its buffers in cache and 16-55k after a layer's weight
// stream had evicted them: ~20 KiB of cold writes for one token.)
struct Routing {
  const float* logits;
  int64_t N, E, top_k, H, I;
  const float* x;
  const QuantizedX* xq_in;  // x [N, H] in Q8_0 blocks when the experts take the int8 path, else null
  Rows gate_up, down;
  float* xs;    // [S, H] the float32 rows of the experts several tokens selected (float path)
  float* acts;  // [S, I] their activations
  // filled by run():
  std::vector<int64_t> count, start, row_token, chosen, idx, fill, slot, hit;
  std::vector<float> row_weight, weight, probs;
  QuantizedX xq;  // [S, H] the Q8_0 rows of the experts several tokens selected (int8 path)

  int64_t run(std::vector<Expert>& experts, std::atomic<int64_t>* ready) {
    const int64_t S = N * top_k;
    chosen.resize(S), idx.resize(E), weight.resize(S), probs.resize(E);
    count.assign(E, 0);
    for (int64_t n = 0; n < N; ++n) {
      const float* l = logits + n * E;
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
    start.assign(E + 1, 0);  // selections grouped by expert (stable): slot[s] is selection s's row
    for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + count[e];
    fill.assign(start.begin(), start.end() - 1);
    slot.resize(S);
    for (int64_t s = 0; s < S; ++s) slot[s] = fill[chosen[s]]++;
    row_token.resize(S);
    row_weight.resize(S);
    const int64_t nb = H / QK;  // Q8_0 blocks a row
    if (xq_in) xq.K = H, xq.q.resize(S * H), xq.d.resize(S * nb), xq.sum8.resize(S * nb);
    for (int64_t s = 0; s < S; ++s) {
      const int64_t n = s / top_k, r = slot[s];
      row_token[r] = n;
      row_weight[r] = weight[s];
      if (count[chosen[s]] == 1) continue;  // read in place
      if (!xq_in) {
        std::copy(x + n * H, x + (n + 1) * H, xs + r * H);
        continue;
      }
      std::copy_n(xq_in->q.data() + n * H, H, xq.q.data() + r * H);
      std::copy_n(xq_in->d.data() + n * nb, nb, xq.d.data() + r * nb);
      std::copy_n(xq_in->sum8.data() + n * nb, nb, xq.sum8.data() + r * nb);
    }
    hit.clear();  // the selected experts, most rows first
    for (int64_t e = 0; e < E; ++e)
      if (count[e]) hit.push_back(e);
    std::stable_sort(hit.begin(), hit.end(), [&](int64_t a, int64_t b) { return count[a] > count[b]; });
    for (size_t j = 0; j < hit.size(); ++j) {
      const int64_t e = hit[j], first = start[e], token = row_token[first];
      const bool alone = count[e] == 1;  // its one row: x's row `token`, in place
      experts[j + 1] = {alone ? x + token * H : xs + first * H, count[e], gate_up.from(e * 2 * I),
                        gate_up.from((e * 2 + 1) * I), down.from(e * H), I, acts + first * I,
                        row_token.data() + first, row_weight.data() + first, &ready[j + 1],
                        !xq_in ? nullptr : alone ? xq_in : &xq, alone ? token : first};
    }
    return int64_t(hit.size());
  }
};

// The buffers of a call, kept by each calling thread between its calls: a decode step calls this
// once per layer, and a dozen allocations and frees per call ran cache-cold on the thread the other
// one waits for (bench.ab, whole batch-1 steps against fresh vectors: int4 1.008x, int8 1.00-1.02x,
// bf16 1.010x; batch 8 1.002x).
struct Workspace {
  std::vector<float> logits, gate_logit, shared_weight, xs, acts, partial;
  std::vector<int64_t> tokens;
  std::vector<std::atomic<int64_t>> ready;  // per expert (shared first): finished gate/up pieces
  std::vector<Expert> experts;  // the shared expert, then the selected ones (written by the routing)
  QuantizedX xq;  // x in Q8_0 blocks (int8 path)
  Routing routing;
};

}  // namespace

MoeWeights moe_weights(Weight router_w, Weight gate_up_w, Weight down_w, int64_t top_k, Weight sh_gate_w,
                       Weight sh_up_w, Weight sh_down_w, at::Tensor sh_expert_gate, int64_t pieces_per_expert) {
  check(sh_expert_gate, "MoE shared-expert gate");  // float32; the router and the experts: any format
  const at::Tensor &router = tensor_of(router_w), &gate_up = tensor_of(gate_up_w), &down = tensor_of(down_w),
                   &sh_gate = tensor_of(sh_gate_w), &sh_up = tensor_of(sh_up_w), &sh_down = tensor_of(sh_down_w);
  const int64_t H = router.size(1), E = router.size(0), I = gate_up.size(1) / 2, Is = sh_gate.size(0);
  TORCH_CHECK(gate_up.dim() == 3 && gate_up.size(0) == E && down.dim() == 3 && down.size(0) == E &&
                  down.size(1) == H && sh_up.size(0) == Is && sh_down.size(0) == H && sh_expert_gate.numel() == H &&
                  top_k >= 1 && top_k <= E,
              "MoE decode shapes do not match");
  // the expert weights in any format (formats.h): gate_up [E, 2I, H], down [E, H, I], shared [Is, H] / [H, Is]
  return {rows_of(router_w, H, "router"), rows_of({sh_expert_gate.view({1, H}), F32}, H, "shared expert gate"),
          rows_of(gate_up_w, H, "experts.gate_up_proj"), rows_of(down_w, I, "experts.down_proj"),
          rows_of(sh_gate_w, H, "shared gate_proj"), rows_of(sh_up_w, H, "shared up_proj"),
          rows_of(sh_down_w, Is, "shared down_proj"), H, E, I, Is, top_k, std::max<int64_t>(1, pieces_per_expert)};
}

at::Tensor moe_decode(at::Tensor x, Weight router, Weight gate_up, Weight down,
                         int64_t top_k, Weight sh_gate, Weight sh_up, Weight sh_down,
                         at::Tensor sh_expert_gate, int64_t pieces_per_expert) {
  check(x, "MoE decode x");
  const MoeWeights w =
      moe_weights(router, gate_up, down, top_k, sh_gate, sh_up, sh_down, sh_expert_gate, pieces_per_expert);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.H && x.size(0) >= 1 && x.size(0) <= 8,
              "MoE decode: x must be [N, hidden] with 1 to 8 rows");
  auto result = at::empty({x.size(0), w.H}, x.options());
  moe_decode_into(w, x.data_ptr<float>(), x.size(0), result.data_ptr<float>());
  return result;
}

void moe_decode_into(const MoeWeights& w, const float* xp, int64_t N, float* rp) {
  const int64_t H = w.H, E = w.E, I = w.I, Is = w.Is, top_k = w.top_k, parts = w.pieces;
  const Rows &gu = w.gate_up, &dn = w.down, &sg = w.sh_gate, &su = w.sh_up, &sd = w.sh_down, &rt = w.router,
             &seg = w.sh_expert_gate;
  const int64_t S = N * top_k, T = at::get_num_threads();

  thread_local Workspace ws;
  ws.logits.resize(N * E), ws.gate_logit.resize(N), ws.shared_weight.resize(N);
  ws.xs.resize(S * H), ws.acts.resize(N * Is + S * I);
  ws.partial.assign(T * N * H, 0.f);
  ws.tokens.resize(N);
  std::iota(ws.tokens.begin(), ws.tokens.end(), 0);
  if (int64_t(ws.ready.size()) < 1 + S) ws.ready = std::vector<std::atomic<int64_t>>(1 + S);  // atomics: no resize
  std::atomic<int64_t>* ready = ws.ready.data();
  for (int64_t j = 0; j < 1 + S; ++j) ready[j].store(0);
  ws.experts.resize(1 + S);
  std::vector<Expert>& experts = ws.experts;
  float *logits = ws.logits.data(), *gate_logit = ws.gate_logit.data(), *shared_weight = ws.shared_weight.data();
  float* partial = ws.partial.data();
  const bool shared_int8 = int8_path(sg), routed_int8 = int8_path(gu);
  if (shared_int8 || routed_int8) quantize_x(xp, N, H, H, ws.xq);  // once, for the shared and the routed experts
  experts[0] = {xp, N, sg, su, sd, Is, ws.acts.data(), ws.tokens.data(), shared_weight, &ready[0],
                shared_int8 ? &ws.xq : nullptr, 0};
  Routing& routing = ws.routing;
  routing.logits = logits, routing.N = N, routing.E = E, routing.top_k = top_k, routing.H = H, routing.I = I;
  routing.x = xp, routing.xq_in = routed_int8 ? &ws.xq : nullptr, routing.gate_up = gu, routing.down = dn;
  routing.xs = ws.xs.data(), routing.acts = ws.acts.data() + N * Is;

  // the queue: T router pieces, then the gate/up pieces of experts 0 (shared), 1, ..., k; `routed`
  // is 1 + k once the routing is out (0 before)
  std::atomic<int64_t> next{0}, routers_done{0}, routed{0};
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> scratch;  // a piece's products (kept: no allocation per call)
    scratch.resize(2 * 8 * std::max(std::max(I, Is), H));
    int64_t count = 0;
    for (int64_t p = next++;; p = next++) {
      if (p < T) {  // a router piece
        const int64_t r0 = E * p / T, r1 = E * (p + 1) / T;
        block(xp, N, H, rt, H, r0, r1, logits, E);
        if (p == 0) {
          block(xp, N, H, seg, H, 0, 1, gate_logit, 1);
          for (int64_t n = 0; n < N; ++n) shared_weight[n] = sigmoid(gate_logit[n]);
        }
        if (routers_done.fetch_add(1, std::memory_order_acq_rel) + 1 == T)  // the last one routes
          routed.store(1 + routing.run(experts, ready), std::memory_order_release);
        continue;
      }
      const int64_t q = p - T;
      count = q < parts ? 1 : 0;  // experts known: the shared one's gate/up needs no routing
      if (!count)
        while ((count = routed.load(std::memory_order_acquire)) == 0) std::this_thread::yield();
      if (q >= count * parts) break;
      const Expert& e = experts[q / parts];
      gate_up_piece(e, cut(e.I, q % parts, parts), cut(e.I, q % parts + 1, parts), H, scratch.data());
    }
    for (int64_t t = t0; t < t1; ++t)  // (all of [0, T) on one thread when the region runs serially)
      for (int64_t d = t; d < count * parts; d += T) {
        const Expert& e = experts[d / parts];
        while (e.ready->load(std::memory_order_acquire) < parts) std::this_thread::yield();  // gate/up still running
        down_piece(e, cut(H, d % parts, parts), cut(H, d % parts + 1, parts), H, partial + t * N * H, scratch.data());
      }
  });
  std::copy(partial, partial + N * H, rp);
  for (int64_t t = 1; t < T; ++t)
    for (int64_t i = 0; i < N * H; ++i) rp[i] += partial[t * N * H + i];
}
