// y = x W^T for a few rows of x (decode batches): x [M, K] float32, W [N, K] row-major in any
// weight format (formats.h: float32, bf16, Q8_0, Q4_0 blocks) -> y [M, N] float32. With 5-8 rows and
// a panel copy of a float32 or bf16 W (see vec.h), through the panels.
//
// Decode reads every weight once per step, so these products are limited by memory bandwidth, not
// FLOPs, and MKL's GEMV/GEMM for such shapes uses one core (M = 1) or runs far below bandwidth
// (M = 2..8). Weight rows are split into blocks processed in parallel; each row is streamed from
// memory once and reused from L1 for all rows of x (see vec.h).
//
// multi_linear runs several products of the same x in one parallel region (e.g. the q/k/v or the
// four DeltaNet input projections). grouped_linear does the same for routed experts: rows of x
// grouped by expert, each group multiplied by its own expert's matrix W[e] of a fused [E, N, K] tensor.

#include <sys/mman.h>

#include "kernels.h"
#include "vec.h"

using namespace qwen35;

namespace {

// The product of x [M, K] and W [N, K] into y, with W's panel copy when `panels` is not empty.
Product product(const at::Tensor& x, const Weight& weight, const at::Tensor& panels, at::Tensor& y) {
  const at::Tensor& W = tensor_of(weight);
  TORCH_CHECK(W.dim() == 2, "every weight must be [N, K] (K in its format's row)");
  Product p{x.data_ptr<float>(), x.size(0), x.size(1), rows_of(weight, x.size(1)), W.size(0), x.size(1),
            y.data_ptr<float>()};
  if (panels.defined() && panels.numel()) {
    check_panels(p.W.fmt, W, panels, W.size(0));
    p.panels = panels.data_ptr();
  }
  return p;
}

}  // namespace

at::Tensor small_m_linear(at::Tensor x, Weight W, at::Tensor panels) {
  return multi_linear(x, {W}, {panels})[0];
}

std::vector<at::Tensor> multi_linear(at::Tensor x, std::vector<Weight> weights, std::vector<at::Tensor> panels) {
  check(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(0) <= 8, "x must be [M, K] with M <= 8");
  TORCH_CHECK(panels.empty() || panels.size() == weights.size(), "one panel copy (or empty tensor) per weight");
  std::vector<at::Tensor> ys;
  std::vector<Product> products;
  for (size_t i = 0; i < weights.size(); ++i) {
    ys.push_back(at::empty({x.size(0), tensor_of(weights[i]).size(0)}, x.options()));
    products.push_back(product(x, weights[i], panels.empty() ? at::Tensor() : panels[i], ys.back()));
  }
  run_products(products);
  return ys;
}

// x [R, K] rows grouped by expert; experts [G] the expert of each group; offsets [G + 1] row bounds;
// W [E, N, K] (any format) -> y [R, N] with y[rows of group g] = x[rows of g] W[experts[g]]^T.
at::Tensor grouped_linear(at::Tensor x, Weight experts_w, at::Tensor experts, at::Tensor offsets) {
  check(x, "x");
  const at::Tensor& W = tensor_of(experts_w);
  TORCH_CHECK(W.dim() == 3 && x.dim() == 2, "bad grouped shapes");
  const Rows weight = rows_of(experts_w, x.size(1), "expert weight");
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
      products.push_back({x.data_ptr<float>() + op[g] * K, rows, K, weight.from(ep[g] * N), N, K,
                          y.data_ptr<float>() + op[g] * N});
  }
  run_products(products);
  return y;
}

// y = x W^T for many rows of x (prefill) and a Q8_0 / Q4_0 weight W [N, row], with x rounded to Q8_0
// blocks and integer dot products: the decode products' int8 path (int8_dot.h, the same error and,
// row by row, the same bits), instead of converting W to float32 for a float32 GEMM. x's rows are
// quantized in parallel; then tasks of 32 weight rows each go over all of x (block_i8_rows).
at::Tensor int8_linear(at::Tensor x, Weight weight) {
  check(x, "x");
  const at::Tensor& W = tensor_of(weight);
  TORCH_CHECK(x.dim() == 2 && W.dim() == 2, "int8_linear: x must be [M, K] and W [N, row]");
  const int64_t M = x.size(0), K = x.size(1), N = W.size(0);
  const Rows w = rows_of(weight, K);
  TORCH_CHECK(int8_path(w), "int8_linear: W must be Q8_0 / Q4_0 with int8 activations on (AVX2 builds)");
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  QuantizedX xq;
  size_quantized_x(M, K, xq);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) { quantize_x_rows(xp, m0, m1, K, xq); });
  float* yp = y.data_ptr<float>();
  const int64_t rows = 4 * RG;
  parallel_tasks((N + rows - 1) / rows, [&](int64_t t) {
    const int64_t n0 = t * rows;
    block_i8_rows(xq, M, w, n0, std::min(N, n0 + rows), yp, N);
  });
  return y;
}

// Transparent huge pages for the whole 2 MiB pages inside a tensor's memory, before it is first written
// (madvise(MADV_HUGEPAGE); as lm/hugepages.py does for the weights). Where THP is in "madvise" mode,
// the float32 copies that prefill makes of compact weights otherwise fault in 4 KiB at a time.
inline void advise_huge_pages(const at::Tensor& t) {
  constexpr uintptr_t huge = 2 << 20;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr()), end = begin + t.nbytes();
  const uintptr_t first = (begin + huge - 1) / huge * huge, last = end / huge * huge;
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);  // advice: failure is harmless
}

// A weight of any format [..., N, row] with K inputs per row -> float32 [..., N, K] (formats.h),
// rows in parallel: how prefill products of compact weights get their float32 matrix.
at::Tensor dequantize(Weight weight, int64_t K) {
  const at::Tensor& w = tensor_of(weight);
  const Rows rows = rows_of(weight, K);
  auto sizes = w.sizes().vec();
  sizes.back() = K;
  auto out = at::empty(sizes, w.options().dtype(at::kFloat));
  advise_huge_pages(out);  // a fresh buffer, first written here: a fault per 2 MiB instead of per 4 KiB
  const int64_t unit = grouped(rows.fmt) ? RG : 1;  // Q8_0 / Q4_0 / BF16_G8: whole groups of rows
  const int64_t N = w.numel() == 0 ? 0 : out.numel() / K / unit;
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, rows_per_task(K) / unit), [&](int64_t n0, int64_t n1) {
    to_float(rows.from(n0 * unit), (n1 - n0) * unit, K, o + n0 * unit * K);
  });
  return out;
}
