// Gated DeltaNet decode (one token per row), float32 state updated in place.
//
// gated_delta_step: the recurrence alone. gdn_decode: everything of a DeltaNet layer between its
// input projections and its output projection (conv window update + SiLU, q/k L2 norms, the decay
// and beta gates, the recurrence, the gated RMSNorm) in one parallel region of (row, key head) tasks, instead of
// ~40 tensor operations whose fixed costs dominate at decode sizes.
//
// Per (row, value head) with old state S [Dk, Dv], d = exp(g):
//   kv = S^T k, qs = S^T q; delta = beta (v - d kv); out = d qs + (q.k) delta; S <- d S + k delta^T.
// One read and one write of the state per head (the reference form needs five passes).

#include "kernels.h"
#include "vec.h"

using namespace qwen35;

namespace {

// Value columns [c, c + V) of one head: s points at S[0, c] (row stride Dv).
inline void delta_block(float* s, int64_t Dk, int64_t Dv, const float* q, const float* k, const float* v,
                        float d, float beta, float qk, float* out) {
  vec kv{}, qs{};
  for (int64_t i = 0; i < Dk; ++i) {
    const vec row = load(s + i * Dv);
    kv += row * k[i];
    qs += row * q[i];
  }
  const vec delta = (load(v) - kv * d) * beta;
  store(out, qs * d + delta * qk);
  for (int64_t i = 0; i < Dk; ++i) store(s + i * Dv, load(s + i * Dv) * d + delta * k[i]);
}

// A whole head (Dv = NV * V columns) in two row-major passes over its state: S^T k and S^T q with
// all columns in registers (on AVX2, NV = 16: 32 accumulators for 16 registers; the spills hit L1
// and still ran ~1.8x faster than strips of 8 columns), then the update. Sequential reads stream
// better than the column strips of delta_block (batch-8 decode steps ~7% faster here).
template <int NV>
inline void delta_head(float* s, int64_t Dk, const float* q, const float* k, const float* v, float d, float beta,
                       float qk, float* out) {
  constexpr int64_t Dv = NV * V;
  vec kv[NV], qs[NV];
  for (int j = 0; j < NV; ++j) kv[j] = qs[j] = vec{};
  for (int64_t i = 0; i < Dk; ++i) {
    const float* row = s + i * Dv;
    for (int j = 0; j < NV; ++j) {
      const vec x = load(row + j * V);
      kv[j] += x * k[i];
      qs[j] += x * q[i];
    }
  }
  vec delta[NV];
  for (int j = 0; j < NV; ++j) {
    delta[j] = (load(v + j * V) - kv[j] * d) * beta;
    store(out + j * V, qs[j] * d + delta[j] * qk);
  }
  for (int64_t i = 0; i < Dk; ++i) {
    float* row = s + i * Dv;
    for (int j = 0; j < NV; ++j) store(row + j * V, load(row + j * V) * d + delta[j] * k[i]);
  }
}

// One head's step: state s [Dk, Dv] in place, out [Dv]. Row-major for the usual head widths, by
// column strips (each reduced over Dk, then updated while still in L1) for the others.
inline void delta_step_head(float* s, int64_t Dk, int64_t Dv, const float* q, const float* k, const float* v,
                            float d, float beta, float* out) {
  const float qk = dot(q, k, Dk);
  switch (Dv / V) {
    case 1: delta_head<1>(s, Dk, q, k, v, d, beta, qk, out); break;
    case 2: delta_head<2>(s, Dk, q, k, v, d, beta, qk, out); break;
    case 4: delta_head<4>(s, Dk, q, k, v, d, beta, qk, out); break;
    case 8: delta_head<8>(s, Dk, q, k, v, d, beta, qk, out); break;
    case 16: delta_head<16>(s, Dk, q, k, v, d, beta, qk, out); break;  // 128 columns of 8-float vectors
    default:
      for (int64_t c = 0; c < Dv; c += V) delta_block(s + c, Dk, Dv, q, k, v + c, d, beta, qk, out + c);
  }
}

inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

}  // namespace

//   state [BH, Dk, Dv]; q, k [BH, Dk] (normalised, q scaled); v [BH, Dv]; decay, beta [BH] -> out [BH, Dv]
at::Tensor gated_delta_step(at::Tensor state, at::Tensor q, at::Tensor k, at::Tensor v,
                               at::Tensor decay, at::Tensor beta) {
  for (auto* t : {&state, &q, &k, &v, &decay, &beta}) check(*t, "gated delta tensors");
  const int64_t BH = state.size(0), Dk = state.size(1), Dv = state.size(2);
  TORCH_CHECK(Dv % V == 0, "value head dim must be a multiple of ", V);
  auto out = at::empty({BH, Dv}, v.options());
  float* S = state.data_ptr<float>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *dp = decay.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, BH, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h)
      delta_step_head(S + h * Dk * Dv, Dk, Dv, qp + h * Dk, kp + h * Dk, vp + h * Dv, dp[h], bp[h], op + h * Dv);
  });
  return out;
}

// One DeltaNet decode token per row, from the input projections to the input of out_proj.
//   qkv [B, C] (C = 2 Hk Dk + Hv Dv, before the conv), z [B, Hv Dv], b, a [B, Hv];
//   window [B, K-1, C] and state [B, Hv, Dk, Dv] are updated in place; conv_w [C, K];
//   A_log, dt_bias [Hv]; norm_w [Dv] -> [B, Hv Dv] = gated_rms_norm(recurrence output, z).
at::Tensor gdn_decode(at::Tensor qkv, at::Tensor z, at::Tensor b_in, at::Tensor a_in,
                         at::Tensor window, at::Tensor conv_w, at::Tensor A_log, at::Tensor dt_bias,
                         at::Tensor state, at::Tensor norm_w, double eps, int64_t num_k_heads) {
  for (auto* t : {&qkv, &z, &b_in, &a_in, &window, &conv_w, &A_log, &dt_bias, &state, &norm_w})
    check(*t, "DeltaNet decode tensors");
  const int64_t B = qkv.size(0), C = qkv.size(1), Km1 = window.size(1);
  const int64_t Hv = state.size(1), Dk = state.size(2), Dv = state.size(3), Hk = num_k_heads;
  const int64_t Kd = Hk * Dk, Vd = Hv * Dv;
  TORCH_CHECK(Hk > 0 && C == 2 * Kd + Vd && window.size(0) == B && window.size(2) == C && conv_w.size(0) == C &&
                  conv_w.numel() == C * (Km1 + 1) && z.numel() == B * Vd && state.size(0) == B &&
                  Hv % Hk == 0 && Dv % V == 0 && norm_w.numel() == Dv && b_in.numel() == B * Hv &&
                  a_in.numel() == B * Hv && A_log.numel() == Hv && dt_bias.numel() == Hv,
              "DeltaNet decode shapes do not match");
  auto out = at::empty({B, Vd}, qkv.options());
  gdn_decode_into({B, C, Km1, Hk, Hv, Dk, Dv}, qkv.data_ptr<float>(), z.data_ptr<float>(), b_in.data_ptr<float>(),
                  a_in.data_ptr<float>(), window.data_ptr<float>(), conv_w.data_ptr<float>(),
                  A_log.data_ptr<float>(), dt_bias.data_ptr<float>(), state.data_ptr<float>(),
                  norm_w.data_ptr<float>(), float(eps), out.data_ptr<float>());
  return out;
}

namespace {

// Taps 0-3 of V consecutive channels of a 4-tap conv weight (p: their V x 4 floats, channel-major)
// -> t[j], tap j of each channel: two rounds of two-register shuffles (a 4 x V transpose).
inline void four_taps(const float* p, vec* t) {
  const vec r0 = load(p), r1 = load(p + V), r2 = load(p + 2 * V), r3 = load(p + 3 * V);
#if defined(__AVX512F__)  // V = 16: r0 holds channels 0-3, r1 4-7, ...; a: taps 0 and 1 of channels 0-7
  const vec a = __builtin_shufflevector(r0, r1, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
  const vec b = __builtin_shufflevector(r0, r1, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  const vec a2 = __builtin_shufflevector(r2, r3, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
  const vec b2 = __builtin_shufflevector(r2, r3, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  t[0] = __builtin_shufflevector(a, a2, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  t[1] = __builtin_shufflevector(a, a2, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  t[2] = __builtin_shufflevector(b, b2, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  t[3] = __builtin_shufflevector(b, b2, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else  // V = 8: r0 holds channels 0-1, r1 2-3, ...; a: taps 0 and 1 of channels 0-3
  const vec a = __builtin_shufflevector(r0, r1, 0, 1, 4, 5, 8, 9, 12, 13);
  const vec b = __builtin_shufflevector(r0, r1, 2, 3, 6, 7, 10, 11, 14, 15);
  const vec a2 = __builtin_shufflevector(r2, r3, 0, 1, 4, 5, 8, 9, 12, 13);
  const vec b2 = __builtin_shufflevector(r2, r3, 2, 3, 6, 7, 10, 11, 14, 15);
  t[0] = __builtin_shufflevector(a, a2, 0, 2, 4, 6, 8, 10, 12, 14);
  t[1] = __builtin_shufflevector(a, a2, 1, 3, 5, 7, 9, 11, 13, 15);
  t[2] = __builtin_shufflevector(b, b2, 0, 2, 4, 6, 8, 10, 12, 14);
  t[3] = __builtin_shufflevector(b, b2, 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

// The causal conv of channels [c0, c1) of one row and their window shift, then SiLU: x [C] the new
// token's projections, window [K-1, C] (in place), conv_w [C, K] -> y [c1 - c0]. The published
// kernel size (K = 4) runs V channels at a time, each channel's taps summed in the same order as
// the scalar loop, which takes other sizes and the tail (a layer's conv: 11.5 of 41 us scalar,
// one thread, the bench config).
inline void conv_channels(const float* x, float* window, const float* conv_w, int64_t C, int64_t Km1, int64_t c0,
                          int64_t c1, float* y) {
  int64_t c = c0;
  if (Km1 == 3)
    for (; c + V <= c1; c += V) {
      vec t[4];
      four_taps(conv_w + c * 4, t);
      const vec w0 = load(window + c), w1 = load(window + C + c), w2 = load(window + 2 * C + c), xc = load(x + c);
      vec acc = w0 * t[0];
      acc += w1 * t[1];
      acc += w2 * t[2];
      acc += xc * t[3];
      store(y + (c - c0), acc);
      store(window + c, w1), store(window + C + c, w2), store(window + 2 * C + c, xc);
    }
  for (; c < c1; ++c) {
    const float* wc = conv_w + c * (Km1 + 1);
    float acc = Km1 ? window[c] * wc[0] : x[c] * wc[0];
    for (int64_t j = 1; j < Km1; ++j) acc += window[j * C + c] * wc[j];
    if (Km1) acc += x[c] * wc[Km1];
    y[c - c0] = acc;
    for (int64_t j = 0; j + 1 < Km1; ++j) window[j * C + c] = window[(j + 1) * C + c];
    if (Km1) window[(Km1 - 1) * C + c] = x[c];
  }
  silu_mul(y, nullptr, y, c1 - c0);  // vectorised (vec.h)
}

}  // namespace

// One task of the token step: row r's key head j on row r's conv window (in place) and recurrent
// state S_r [Hv, Dk, Dv] (its value heads, in place): the conv of the key head's q and k channels and
// of its value heads' v channels (each channel's window shifted by exactly one task), the q / k unit
// norms, then per value head the gates, the recurrence and the gated RMSNorm.
static void gdn_task(const GdnShape& shape, int64_t r, int64_t j, const float* xp, const float* zp, const float* bp,
                     const float* ap, float* window, const float* wp, const float* A, const float* dtb, float* S_r,
                     const float* nw, float eps, float* op) {
  const int64_t C = shape.C, Km1 = shape.Km1, Hk = shape.Hk, Hv = shape.Hv, Dk = shape.Dk, Dv = shape.Dv;
  const int64_t Kd = Hk * Dk, Vd = Hv * Dv, rep = Hv / Hk;
  const float* x = xp + r * C;
  thread_local std::vector<float> scratch;  // this key head's q, k, v (after conv and SiLU) and silu(z)
  scratch.resize(2 * Dk + rep * Dv + Dv);
  float *q = scratch.data(), *k = q + Dk, *v = k + Dk, *zs = v + rep * Dv;
  conv_channels(x, window, wp, C, Km1, j * Dk, (j + 1) * Dk, q);
  conv_channels(x, window, wp, C, Km1, Kd + j * Dk, Kd + (j + 1) * Dk, k);
  conv_channels(x, window, wp, C, Km1, 2 * Kd + j * rep * Dv, 2 * Kd + (j + 1) * rep * Dv, v);
  l2norm(q, Dk, 1.f / std::sqrt(float(Dk)));  // q scaled by Dk^-1/2
  l2norm(k, Dk, 1.f);
  for (int64_t h = j * rep; h < (j + 1) * rep; ++h) {  // value head h reads key head h / rep
    const float decay = std::exp(-std::exp(A[h]) * softplus(ap[r * Hv + h] + dtb[h]));
    const float beta = sigmoid(bp[r * Hv + h]);
    float* o = op + r * Vd + h * Dv;
    delta_step_head(S_r + h * Dk * Dv, Dk, Dv, q, k, v + (h - j * rep) * Dv, decay, beta, o);
    const float inv = 1.f / std::sqrt(dot(o, o, Dv) / float(Dv) + float(eps));
    silu_mul(zp + r * Vd + h * Dv, nullptr, zs, Dv);
    for (int64_t i = 0; i < Dv; ++i) o[i] = nw[i] * (o[i] * inv) * zs[i];
  }
}

// One parallel region of independent tasks, one per (row, key head) (gdn_task). Before, three
// phases (conv, serial norms and gates, heads) each waited for all threads.
void gdn_decode_into(const GdnShape& shape, const float* xp, const float* zp, const float* bp, const float* ap,
                     float* win, const float* wp, const float* A, const float* dtb, float* S, const float* nw,
                     float eps, float* op) {
  const int64_t Hk = shape.Hk, state = shape.Hv * shape.Dk * shape.Dv, window = shape.Km1 * shape.C;
  parallel_tasks(shape.B * Hk, [&](int64_t t) {
    const int64_t r = t / Hk, j = t % Hk;
    gdn_task(shape, r, j, xp, zp, bp, ap, win + r * window, wp, A, dtb, S + r * state, nw, eps, op);
  });
}

// The token step of chained rows (a speculative verify: rows r whose prev[r] >= 0 continue the
// sequence of row prev[r] < r). Each chain steps the window and state of its cache row slot[r] in
// place, token after token, as gdn_decode_into would, and copies them after each of its tokens but
// the last into win_steps[r] / S_steps[r] ([rows, Km1, C] / [rows, Hv, Dk, Dv]): the states a
// rollback to that token needs (Cache.commit). One parallel region of (chain, key head) tasks; a
// task walks its chain, its value heads' state staying in cache between the tokens.
void gdn_verify_into(const GdnShape& shape, const float* xp, const float* zp, const float* bp, const float* ap,
                     float* win, const float* wp, const float* A, const float* dtb, float* S, const float* nw,
                     float eps, const int64_t* slot, const int64_t* prev, float* win_steps, float* S_steps,
                     float* op) {
  const int64_t B = shape.B, C = shape.C, Km1 = shape.Km1, Hk = shape.Hk, Hv = shape.Hv, Dk = shape.Dk,
                Dv = shape.Dv;
  const int64_t Kd = Hk * Dk, rep = Hv / Hk, state = Hv * Dk * Dv, window = Km1 * C;
  std::vector<std::vector<int64_t>> chains;  // each sequence's rows, in order
  std::vector<int64_t> chain_of(B);
  for (int64_t r = 0; r < B; ++r) {
    TORCH_CHECK(prev[r] < r, "verify: a row continues an earlier row (prev[r] < r)");
    if (prev[r] < 0) {
      chain_of[r] = int64_t(chains.size());
      chains.push_back({r});
    } else {
      chain_of[r] = chain_of[prev[r]];
      TORCH_CHECK(chains[chain_of[r]].back() == prev[r], "verify: row ", r, " continues row ", prev[r],
                  ", which another row continues already");
      chains[chain_of[r]].push_back(r);
    }
  }
  parallel_tasks(int64_t(chains.size()) * Hk, [&](int64_t t) {
    const std::vector<int64_t>& rows = chains[t / Hk];
    const int64_t j = t % Hk;
    float *w = win + slot[rows[0]] * window, *s = S + slot[rows[0]] * state;
    const int64_t spans[3][2] = {{j * Dk, Dk}, {Kd + j * Dk, Dk}, {2 * Kd + j * rep * Dv, rep * Dv}};
    for (size_t i = 0; i < rows.size(); ++i) {
      const int64_t r = rows[i];
      gdn_task(shape, r, j, xp, zp, bp, ap, w, wp, A, dtb, s, nw, eps, op);
      if (i + 1 == rows.size()) break;  // the last token's window and state are the cache's own
      for (int64_t k = 0; k < Km1; ++k)
        for (const auto& span : spans) std::copy_n(w + k * C + span[0], span[1], win_steps + r * window + k * C + span[0]);
      std::copy_n(s + j * rep * Dk * Dv, rep * Dk * Dv, S_steps + r * state + j * rep * Dk * Dv);
    }
  });
}
