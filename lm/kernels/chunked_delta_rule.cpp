// Prefill form of the gated delta rule (see lm/delta_rule.py, chunked_gated_delta_rule: the same
// maths), one (row, value head) per thread at a time: each head's chunk scan is a sequence of small
// matrix products, which run far better single-threaded side by side than split across threads.
//
// The kernel reads q, k, v where the layer left them ([B, T, H, D] rows of the conv's output) and
// does _prepare's work per chunk (q and k unit-norm, q scaled by Dk^-1/2, value head h reading key
// head h / rep), writes its output as [B, T, Hv, Dv], and runs a chunk's products in register
// tiles on per-thread buffers: no copies of q, k, v, no tensor or library call a step.
// Per chunk of c tokens (gamma: the cumulative log decay from the chunk's start):
//   A = I + strictly_lower(beta_i k_i.k_j e^(gamma_i - gamma_j))
//   A [U | W] = [v beta | k beta e^gamma]                 (forward substitution, row by row)
//   v_new = U - W S;   o = (q e^gamma) S + causal(q_i.k_j e^(gamma_i - gamma_j)) v_new
//   S <- e^(gamma_last) S + (k e^(gamma_last - gamma))^T v_new
// A short last chunk is computed as it is (padding with k = v = 0 and g = 0 changes nothing).

#include "kernels.h"
#include "vec.h"

#include <c10/core/GradMode.h>

#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <vector>

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

// The chunk's products, small enough (at most 64 x 128 x 128) to run on one thread from L1 / L2:
// C [M, N] = beta C + alpha A B (beta 0: C is not read), A's element (i, k) at A[i sa + k sk] (so A
// or its transpose), B [K, N] row-major. Tiles of 4 rows by NV vectors of C in registers, each B
// row's vectors loaded once per tile and each A element broadcast once.
constexpr int NV = V == 16 ? 4 : 2;  // 16 (AVX-512) or 8 (AVX2) accumulators of C

template <int MR, int NR>
inline void tile(int64_t K, float alpha, const float* A, int64_t sa, int64_t sk, const float* B, int64_t ldb,
                 float beta, float* C, int64_t ldc) {
  vec acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = vec{} + 0.f;
  for (int64_t k = 0; k < K; ++k) {
    vec b[NR];
    for (int j = 0; j < NR; ++j) b[j] = load(B + k * ldb + j * V);
    for (int r = 0; r < MR; ++r) {
      const float a = A[r * sa + k * sk];
      for (int j = 0; j < NR; ++j) acc[r][j] += a * b[j];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      float* c = C + r * ldc + j * V;
      store(c, beta == 0.f ? alpha * acc[r][j] : beta * load(c) + alpha * acc[r][j]);
    }
}

template <int MR>
inline void row_tiles(int64_t N, int64_t K, float alpha, const float* A, int64_t sa, int64_t sk, const float* B,
                      int64_t ldb, float beta, float* C, int64_t ldc) {
  int64_t j = 0;
  for (; j + NV * V <= N; j += NV * V) tile<MR, NV>(K, alpha, A, sa, sk, B + j, ldb, beta, C + j, ldc);
  for (; j + V <= N; j += V) tile<MR, 1>(K, alpha, A, sa, sk, B + j, ldb, beta, C + j, ldc);
  for (; j < N; ++j)  // columns past the last whole vector
    for (int r = 0; r < MR; ++r) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += A[r * sa + k * sk] * B[k * ldb + j];
      C[r * ldc + j] = beta == 0.f ? alpha * sum : beta * C[r * ldc + j] + alpha * sum;
    }
}

void mm(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t sa, int64_t sk, const float* B,
        int64_t ldb, float beta, float* C, int64_t ldc) {
  int64_t i = 0;
  for (; i + 4 <= M; i += 4) row_tiles<4>(N, K, alpha, A + i * sa, sa, sk, B, ldb, beta, C + i * ldc, ldc);
  for (; i < M; ++i) row_tiles<1>(N, K, alpha, A + i * sa, sa, sk, B, ldb, beta, C + i * ldc, ldc);
}

// C[i, j] = a_i . b_j for j <= i < c (rows of D floats): the lower triangle of A B^T.
void lower_dots(int64_t c, int64_t D, const float* a, const float* b, float* C, int64_t ldc) {
  for (int64_t i = 0; i < c; ++i)
    for (int64_t j = 0; j <= i; ++j) C[i * ldc + j] = dot(a + i * D, b + j * D, D);
}

// y[i] = exp(x[i]) for i < n: vexp (vec.h) a vector at a time (arguments below -87.3 give
// e^-87.3 ~ 1e-38 instead of 0 or a denormal, a difference below the flush of FlushDenormals' terms).
void exp_row(const float* x, int64_t n, float* y) {
  int64_t i = 0;
  for (; i + V <= n; i += V) store(y + i, vexp(load(x + i)));
  for (; i < n; ++i) y[i] = std::exp(x[i]);
}

// Forward substitution of the unit lower-triangular system I + A (A strictly lower, [c, C]): row i
// of X [c, n] (ld ldx, holding the right-hand sides) becomes rhs_i - sum_{j < i} A_ij X_j. Columns
// in blocks of 4 vectors kept in registers across j.
void substitute(int64_t c, int64_t n, const float* A, int64_t lda, float* X, int64_t ldx) {
  int64_t d0 = 0;
  for (; d0 + 4 * V <= n; d0 += 4 * V)
    for (int64_t i = 1; i < c; ++i) {
      float* xi = X + i * ldx + d0;
      vec acc[4] = {load(xi), load(xi + V), load(xi + 2 * V), load(xi + 3 * V)};
      for (int64_t j = 0; j < i; ++j) {
        const float a = A[i * lda + j];
        const float* xj = X + j * ldx + d0;
        for (int u = 0; u < 4; ++u) acc[u] -= a * load(xj + u * V);
      }
      for (int u = 0; u < 4; ++u) store(xi + u * V, acc[u]);
    }
  for (int64_t i = 1; i < c; ++i)  // the columns left
    for (int64_t j = 0; j < i; ++j)
      for (int64_t d = d0; d < n; ++d) X[i * ldx + d] -= A[i * lda + j] * X[j * ldx + d];
}

// The cache lines of `rows` rows of `bytes` each, `stride` floats apart, prefetched (the next chunk's
// q, k, v: rows of the conv's output, far apart).
void prefetch_rows(const float* p, int64_t rows, int64_t stride, int64_t bytes) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(p + r * stride) + b);
}

// One thread's scratch for a head's scan, sized for chunks of C tokens.
struct Scratch {
  std::vector<float> q, k, x, a, qk, decay, gamma, e, s, vnew;
  void size(int64_t C, int64_t Dk, int64_t Dv) {
    q.resize(C * Dk), k.resize(C * Dk), x.resize(C * (Dv + Dk)), a.resize(C * C), qk.resize(C * C);
    decay.resize(C * C), gamma.resize(C), e.resize(2 * C);
    s.resize(Dk * Dv), vnew.resize(C * Dv);
  }
};

}  // namespace

// q, k [B, T, Hk, Dk], v [B, T, Hv, Dv] (rows contiguous in D, any other strides), g, beta [B, T, Hv],
// state [B, Hv, Dk, Dv] (not modified) -> (out [B, T, Hv, Dv], new state [B, Hv, Dk, Dv]).
std::vector<at::Tensor> chunked_delta_rule(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g, at::Tensor beta,
                                           at::Tensor state, int64_t chunk) {
  for (auto* t : {&q, &k, &v, &g, &beta, &state})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat, "delta rule tensors must be float32 CPU tensors");
  const int64_t B = q.size(0), T = q.size(1), Hk = q.size(2), Dk = q.size(3), Hv = v.size(2), Dv = v.size(3);
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 && v.size(0) == B && v.size(1) == T &&
                  Hv % Hk == 0 && g.dim() == 3 && g.size(0) == B && g.size(1) == T && g.size(2) == Hv &&
                  beta.sizes() == g.sizes() && state.dim() == 4 && state.size(0) == B && state.size(1) == Hv &&
                  state.size(2) == Dk && state.size(3) == Dv,
              "delta rule shapes do not match");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "delta rule: q, k, v rows must be contiguous");
  const int64_t rep = Hv / Hk, C = chunk, XW = Dv + Dk;
  auto out = at::empty({B, T, Hv, Dv}, v.options());
  auto st = state.contiguous();
  auto new_state = at::empty_like(st);
  const float scale = 1.f / std::sqrt(float(Dk));
  std::atomic<int64_t> next{0};
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const WorkerModes modes(inference);
    const FlushDenormals flush;  // strongly decaying heads make denormal decays (exp of -100s): 4-8x slower
    thread_local Scratch w;
    w.size(C, Dk, Dv);
    float *Q = w.q.data(), *K = w.k.data(), *X = w.x.data(), *A = w.a.data(), *QK = w.qk.data(), *G = w.gamma.data();
    float *E = w.decay.data(), *EG = w.e.data(), *ET = w.e.data() + C;  // e^(G_i - G_j), e^G_i, e^(G_last - G_i)
    float *S = w.s.data(), *VN = w.vnew.data();
    for (int64_t task = next++; task < B * Hv; task = next++) {
      const int64_t b = task / Hv, h = task % Hv, hk = h / rep;
      const float* qh = q.data_ptr<float>() + b * q.stride(0) + hk * q.stride(2);
      const float* kh = k.data_ptr<float>() + b * k.stride(0) + hk * k.stride(2);
      const float* vh = v.data_ptr<float>() + b * v.stride(0) + h * v.stride(2);
      const float* gh = g.data_ptr<float>() + b * g.stride(0) + h * g.stride(2);
      const float* bh = beta.data_ptr<float>() + b * beta.stride(0) + h * beta.stride(2);
      float* oh = out.data_ptr<float>() + (b * T * Hv + h) * Dv;
      std::copy_n(st.data_ptr<float>() + task * Dk * Dv, Dk * Dv, S);
      for (int64_t t0 = 0; t0 < T; t0 += C) {
        const int64_t c = std::min(C, T - t0);
        float gamma = 0.f;
        for (int64_t i = 0; i < c; ++i) {
          const int64_t t = t0 + i;
          float *qi = Q + i * Dk, *ki = K + i * Dk;
          std::copy_n(qh + t * q.stride(1), Dk, qi);
          std::copy_n(kh + t * k.stride(1), Dk, ki);
          l2norm(qi, Dk, scale);  // as lm.delta_rule._prepare
          l2norm(ki, Dk, 1.f);
          G[i] = gamma += gh[t * g.stride(1)];
        }
        lower_dots(c, Dk, K, K, A, C);   // k_i . k_j
        lower_dots(c, Dk, Q, K, QK, C);  // q_i . k_j
        for (int64_t i = 0; i < c; ++i) {
          for (int64_t j = 0; j <= i; ++j) E[i * C + j] = G[i] - G[j];
          exp_row(E + i * C, i + 1, E + i * C);
          ET[i] = G[c - 1] - G[i];
        }
        exp_row(G, c, EG);
        exp_row(ET, c, ET);
        if (t0 + C < T) {
          const int64_t next_rows = std::min(C, T - t0 - C);
          prefetch_rows(qh + (t0 + C) * q.stride(1), next_rows, q.stride(1), Dk * 4);
          prefetch_rows(kh + (t0 + C) * k.stride(1), next_rows, k.stride(1), Dk * 4);
          prefetch_rows(vh + (t0 + C) * v.stride(1), next_rows, v.stride(1), Dv * 4);
        }
        // [U | W]: right-hand sides [v beta | k beta e^gamma], then forward substitution
        for (int64_t i = 0; i < c; ++i) {
          const float bi = bh[(t0 + i) * beta.stride(1)];
          const float* vi = vh + (t0 + i) * v.stride(1);
          float* xi = X + i * XW;
          for (int64_t d = 0; d < Dv; ++d) xi[d] = vi[d] * bi;
          for (int64_t d = 0; d < Dk; ++d) xi[Dv + d] = K[i * Dk + d] * bi * EG[i];
          for (int64_t j = 0; j < i; ++j) A[i * C + j] *= bi * E[i * C + j];
          for (int64_t j = 0; j <= i; ++j) QK[i * C + j] *= E[i * C + j];  // causal, decayed
          for (int64_t j = i + 1; j < c; ++j) QK[i * C + j] = 0.f;
        }
        substitute(c, XW, A, C, X, XW);
        for (int64_t i = 0; i < c; ++i) std::copy_n(X + i * XW, Dv, VN + i * Dv);
        mm(c, Dv, Dk, -1.f, X + Dv, XW, 1, S, Dv, 1.f, VN, Dv);  // v_new = U - W S
        for (int64_t i = 0; i < c; ++i)
          for (int64_t d = 0; d < Dk; ++d) Q[i * Dk + d] *= EG[i];
        float* O = oh + t0 * Hv * Dv;  // the chunk's output rows, Hv * Dv apart
        mm(c, Dv, Dk, 1.f, Q, Dk, 1, S, Dv, 0.f, O, Hv * Dv);  // (q e^gamma) S
        mm(c, Dv, c, 1.f, QK, C, 1, VN, Dv, 1.f, O, Hv * Dv);  // + intra v_new
        for (int64_t i = 0; i < c; ++i)
          for (int64_t d = 0; d < Dk; ++d) K[i * Dk + d] *= ET[i];
        mm(Dk, Dv, c, 1.f, K, 1, Dk, VN, Dv, EG[c - 1], S, Dv);  // S e^last + k_to_end^T v_new
      }
      std::copy_n(S, Dk * Dv, new_state.data_ptr<float>() + task * Dk * Dv);
    }
  });
  return {out, new_state};
}
