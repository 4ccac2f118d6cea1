// y = x W^T for a few rows of x (decode batches): x [M, K], W [N, K] row-major float32 -> y [M, N].
//
// Decode reads every weight once per step, so these products are limited by memory bandwidth, not
// FLOPs, and MKL's GEMV/GEMM for such shapes uses one core (M = 1) or runs far below bandwidth
// (M = 2..8). Weight rows are split into blocks processed in parallel; each row is streamed from
// memory once and reused from L1 for all rows of x (see vec.h).
//
// multi_linear runs several products of the same x in one parallel region (e.g. the q/k/v or the
// four DeltaNet input projections). grouped_linear does the same for routed experts: rows of x
// grouped by expert, each group multiplied by its own expert's matrix W[e] of a fused [E, N, K] tensor.

#include "vec.h"

using namespace qwen35;

at::Tensor small_m_linear(at::Tensor x, at::Tensor W) {
  check(x, "x");
  check(W, "weight");
  TORCH_CHECK(x.dim() == 2 && W.dim() == 2 && x.size(1) == W.size(1), "shapes must be x [M, K] and weight [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = W.size(0);
  TORCH_CHECK(M <= 8, "at most 8 rows of x");
  auto y = at::empty({M, N}, x.options());
  run_products({{x.data_ptr<float>(), M, K, W.data_ptr<float>(), N, K, y.data_ptr<float>()}});
  return y;
}

std::vector<at::Tensor> multi_linear(at::Tensor x, std::vector<at::Tensor> weights) {
  check(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(0) <= 8, "x must be [M, K] with M <= 8");
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<at::Tensor> ys;
  std::vector<Product> products;
  for (auto& W : weights) {
    check(W, "weight");
    TORCH_CHECK(W.dim() == 2 && W.size(1) == K, "every weight must be [N, K] with x's K");
    ys.push_back(at::empty({M, W.size(0)}, x.options()));
    products.push_back({x.data_ptr<float>(), M, K, W.data_ptr<float>(), W.size(0), K, ys.back().data_ptr<float>()});
  }
  run_products(products);
  return ys;
}

// x [R, K] rows grouped by expert; experts [G] the expert of each group; offsets [G + 1] row bounds;
// W [E, N, K] -> y [R, N] with y[rows of group g] = x[rows of g] W[experts[g]]^T.
at::Tensor grouped_linear(at::Tensor x, at::Tensor W, at::Tensor experts, at::Tensor offsets) {
  check(x, "x");
  check(W, "weight");
  TORCH_CHECK(W.dim() == 3 && x.dim() == 2 && x.size(1) == W.size(2), "bad grouped shapes");
  TORCH_CHECK(experts.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong, "ids must be int64");
  const int64_t R = x.size(0), K = x.size(1), N = W.size(1), G = experts.size(0);
  auto e = experts.contiguous();
  auto o = offsets.contiguous();
  const int64_t* ep = e.data_ptr<int64_t>();
  const int64_t* op = o.data_ptr<int64_t>();
  auto y = at::empty({R, N}, x.options());
  std::vector<Product> products;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t rows = op[g + 1] - op[g];
    TORCH_CHECK(ep[g] >= 0 && ep[g] < W.size(0) && rows <= 8, "expert id out of range or more than 8 rows");
    if (rows > 0)
      products.push_back({x.data_ptr<float>() + op[g] * K, rows, K, W.data_ptr<float>() + ep[g] * N * K, N, K,
                          y.data_ptr<float>() + op[g] * N});
  }
  run_products(products);
  return y;
}
