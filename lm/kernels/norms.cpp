// RMS norms for decode-sized inputs in one pass per row (torch's CPU rms_norm is several kernels).

#include "vec.h"

using namespace qwen35;

// x [R, D] (any row stride), w [D] -> [R, D] = x / rms(x) * (offset + w)
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps, double offset) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.device().is_cpu() && x.scalar_type() == at::kFloat,
              "x must be a float32 CPU [R, D] tensor with unit stride along D");
  check(w, "norm weight");
  const int64_t R = x.size(0), D = x.size(1), ldx = x.stride(0);
  TORCH_CHECK(w.numel() == D, "norm weight must have D elements");
  auto y = at::empty({R, D}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float off = float(offset);
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_norm_row(xp + r * ldx, wp, float(eps), off, D, yp + r * D);
  });
  return y;
}

// x, z [R, D] (any row strides), w [D] -> [R, D] = w * x / rms(x) * silu(z): the Gated DeltaNet output
// norm (lm/norm.py, GatedRMSNorm) in one pass per row instead of torch's five.
at::Tensor gated_rms_norm(at::Tensor x, at::Tensor z, at::Tensor w, double eps) {
  for (const auto* t : {&x, &z})
    TORCH_CHECK(t->dim() == 2 && t->stride(1) == 1 && t->device().is_cpu() && t->scalar_type() == at::kFloat,
                "x and z must be float32 CPU [R, D] tensors with unit stride along D");
  check(w, "norm weight");
  const int64_t R = x.size(0), D = x.size(1), ldx = x.stride(0), ldz = z.stride(0);
  TORCH_CHECK(z.size(0) == R && z.size(1) == D && w.numel() == D, "x, z and the norm weight must agree in shape");
  auto y = at::empty({R, D}, x.options());
  const float *xp = x.data_ptr<float>(), *zp = z.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      rms_norm_row(xp + r * ldx, wp, float(eps), 0.f, D, yp + r * D);
      silu_mul(zp + r * ldz, yp + r * D, yp + r * D, D);
    }
  });
  return y;
}
