// y = x W^T for a few rows of x (decode batches): x [M, K], W [N, K] row-major float32 -> y [M, N].
//
// Decode reads every weight once per step, so these products are limited by memory bandwidth, not
// FLOPs, and MKL's GEMV/GEMM for such shapes uses one core (M = 1) or runs far below bandwidth
// (M = 2..8). Weight rows are split into blocks processed in parallel; each row is streamed from
// memory once and reused from L1 for all rows of x (groups of up to 8). Inner products use
// the compiler's vector extensions (AVX2 / AVX-512 / NEON with -march=native) and prefetch the
// weight stream ahead, which alone is worth ~30% of bandwidth here.
//
// grouped_linear does the same for routed experts: rows of x grouped by expert, each group
// multiplied by its own expert's matrix W[e] of a fused [E, N, K] tensor, in one parallel region.

#include <torch/extension.h>
#include <ATen/Parallel.h>

namespace {

constexpr int V = 16;  // floats per vector
typedef float vec __attribute__((vector_size(V * sizeof(float))));

typedef float half_vec __attribute__((vector_size(V / 2 * sizeof(float))));
typedef float quarter_vec __attribute__((vector_size(V / 4 * sizeof(float))));

inline float hsum(vec v) {  // tree reduction: 16 -> 8 -> 4 lanes, then scalar
  const half_vec h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const quarter_vec q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[1]) + (q[2] + q[3]);
}

constexpr int64_t PREFETCH = 2048;  // floats ahead of the current position (8 KiB)

inline vec load(const float* p) {
  vec v;
  __builtin_memcpy(&v, p, sizeof(vec));
  return v;
}

// y[r, n] = x[r] . w for r < R (R <= 8): one weight row streamed once (prefetched ahead), with
// independent accumulator chains per x row.
template <int R>
inline void dot_row(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
  constexpr int C = R == 1 ? 4 : R <= 4 ? 2 : 1;  // accumulator chains per x row (at most 8 in flight)
  vec a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = vec{};
  int64_t k = 0;
  for (; k + C * V <= K; k += C * V) {
    for (int c = 0; c < C; ++c) __builtin_prefetch(w + k + c * V + PREFETCH, 0, 3);  // every line
    for (int c = 0; c < C; ++c) {
      const vec wc = load(w + k + c * V);
      for (int r = 0; r < R; ++r) a[r][c] += load(x + r * ldx + k + c * V) * wc;
    }
  }
  for (int r = 0; r < R; ++r) {
    vec t = a[r][0];
    for (int c = 1; c < C; ++c) t += a[r][c];
    float s = hsum(t);
    for (int64_t j = k; j < K; ++j) s += x[r * ldx + j] * w[j];
    y[r * ldy] = s;
  }
}

// Rows [0, M) of x times weight rows [n0, n1) of W -> y[:, n0:n1]. Each weight row comes from memory
// once; groups of x rows after the first (M > 8) read it again from L1.
void block(const float* x, int64_t M, int64_t ldx, const float* W, int64_t K, int64_t n0, int64_t n1, float* y,
           int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* w = W + n * K;
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const float* xm = x + m0 * ldx;
      float* ym = y + m0 * ldy + n;
      switch (std::min<int64_t>(8, M - m0)) {
        case 1: dot_row<1>(xm, ldx, w, K, ym, ldy); break;
        case 2: dot_row<2>(xm, ldx, w, K, ym, ldy); break;
        case 3: dot_row<3>(xm, ldx, w, K, ym, ldy); break;
        case 4: dot_row<4>(xm, ldx, w, K, ym, ldy); break;
        case 5: dot_row<5>(xm, ldx, w, K, ym, ldy); break;
        case 6: dot_row<6>(xm, ldx, w, K, ym, ldy); break;
        case 7: dot_row<7>(xm, ldx, w, K, ym, ldy); break;
        default: dot_row<8>(xm, ldx, w, K, ym, ldy); break;
      }
    }
  }
}

// Weight rows per parallel task (~64 KiB of weights).
int64_t rows_per_task(int64_t K) { return std::max<int64_t>(4, 16384 / std::max<int64_t>(K, 1)); }

void check(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

}  // namespace

torch::Tensor small_m_linear(torch::Tensor x, torch::Tensor W) {
  check(x, "x");
  check(W, "weight");
  TORCH_CHECK(x.dim() == 2 && W.dim() == 2 && x.size(1) == W.size(1), "shapes must be x [M, K] and weight [N, K]");
  TORCH_CHECK(W.is_contiguous(), "weight must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = W.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = W.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t step = rows_per_task(K), ldx = x.stride(0);
  at::parallel_for(0, (N + step - 1) / step, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      block(xp, M, ldx, wp, K, t * step, std::min(N, (t + 1) * step), yp, N);
  });
  return y;
}

// x [R, K] rows grouped by expert; experts [G] the expert of each group; offsets [G + 1] row bounds;
// W [E, N, K] -> y [R, N] with y[rows of group g] = x[rows of g] W[experts[g]]^T.
torch::Tensor grouped_linear(torch::Tensor x, torch::Tensor W, torch::Tensor experts, torch::Tensor offsets) {
  check(x, "x");
  check(W, "weight");
  TORCH_CHECK(W.is_contiguous() && W.dim() == 3 && x.dim() == 2 && x.size(1) == W.size(2), "bad grouped shapes");
  TORCH_CHECK(experts.scalar_type() == torch::kLong && offsets.scalar_type() == torch::kLong, "ids must be int64");
  const int64_t R = x.size(0), K = x.size(1), N = W.size(1), G = experts.size(0);
  auto e = experts.contiguous();
  auto o = offsets.contiguous();
  const int64_t* ep = e.data_ptr<int64_t>();
  const int64_t* op = o.data_ptr<int64_t>();
  auto y = torch::empty({R, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = W.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t step = rows_per_task(K), blocks = (N + step - 1) / step, ldx = x.stride(0);
  at::parallel_for(0, G * blocks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t / blocks, b = t % blocks, r0 = op[g], rows = op[g + 1] - op[g];
      if (rows == 0) continue;
      block(xp + r0 * ldx, rows, ldx, wp + ep[g] * N * K, K, b * step, std::min(N, (b + 1) * step), yp + r0 * N, N);
    }
  });
  return y;
}

// One gated-delta-rule decode step for every (row, value head), updating the float32 state in place
// with one read and one write of it (the reference form needs five passes):
//   state [BH, Dk, Dv]; q, k [BH, Dk] (normalised, q scaled); v [BH, Dv]; decay, beta [BH] -> out [BH, Dv]
//   kv = S^T k, qs = S^T q (old state); delta = beta (v - decay kv); out = decay qs + (q.k) delta;
//   S <- decay S + k delta^T.
// Each block of V value columns is reduced over Dk, then updated while it is still in L1.
torch::Tensor gated_delta_step(torch::Tensor state, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                               torch::Tensor decay, torch::Tensor beta) {
  for (auto* t : {&state, &q, &k, &v, &decay, &beta}) check(*t, "gated delta tensors");
  TORCH_CHECK(state.is_contiguous() && q.is_contiguous() && k.is_contiguous() && v.is_contiguous() &&
                  decay.is_contiguous() && beta.is_contiguous(), "gated delta tensors must be contiguous");
  const int64_t BH = state.size(0), Dk = state.size(1), Dv = state.size(2);
  TORCH_CHECK(Dv % V == 0, "value head dim must be a multiple of ", V);
  auto out = torch::empty({BH, Dv}, v.options());
  float* S = state.data_ptr<float>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *dp = decay.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = Dv / V;
  at::parallel_for(0, BH * blocks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t h = t / blocks, c = (t % blocks) * V;
      float* s = S + h * Dk * Dv + c;
      const float *qh = qp + h * Dk, *kh = kp + h * Dk;
      vec kv{}, qs{};
      float qk = 0.f;
      for (int64_t i = 0; i < Dk; ++i) {
        const vec row = load(s + i * Dv);
        kv += row * kh[i];
        qs += row * qh[i];
        qk += qh[i] * kh[i];
      }
      const float d = dp[h], b = bp[h];
      const vec delta = (load(vp + h * Dv + c) - kv * d) * b;
      const vec o = qs * d + delta * qk;
      __builtin_memcpy(op + h * Dv + c, &o, sizeof(vec));
      for (int64_t i = 0; i < Dk; ++i) {
        const vec row = load(s + i * Dv) * d + delta * kh[i];
        __builtin_memcpy(s + i * Dv, &row, sizeof(vec));
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gated_delta_step", &gated_delta_step, "in-place gated delta rule decode step (float32, CPU)");
  m.def("small_m_linear", &small_m_linear, "y = x W^T for few rows of x (float32, CPU)");
  m.def("grouped_linear", &grouped_linear, "per-expert y = x W[e]^T over rows grouped by expert");
}
