// One grouped FP8 GEMM call (a sparse layer's experts), decoded and validated from its XLA FFI operands.
//
//   out[m, n] = out_type( row_scale[m] * col_scale[g(m), n] * sum_k a[m, k] * b[g(m), n, k] )
//
// a: activation rows [M, K] float8_e4m3fn, sorted by group: rows [offset_g, offset_g + sizes[g])
// belong to group g (offset_g = sizes[0] + ... + sizes[g-1]). b: every group's weight [G, N, K]
// float8_e4m3fn as the checkpoint stores each (K-major). group_sizes [G] int32, on the device: any
// sizes, empty groups included, without recompiling; rows past their sum are written as zeros.
// col_scale [G, N] float32: each group's output-channel factors (its input and weight scales folded
// in). row_scale [M] float32 is optional (per-token activation scales, announced by has_row_scale).
// The CPU handler and the CUDA handler (cuda/fp8_grouped_gemm_cuda.cu) share this parser, so both accept and reject the same calls.
#ifndef MODELOPT_JAX_FFI_FP8_GROUPED_GEMM_PROBLEM_H_
#define MODELOPT_JAX_FFI_FP8_GROUPED_GEMM_PROBLEM_H_

#include <cstdint>
#include <string>
#include <utility>

#include "fp8_gemm_problem.h"

namespace modelopt_jax {

struct Fp8GroupedGemmProblem {
  int64_t m = 0, n = 0, k = 0, groups = 0;
  const void* a = nullptr;
  const void* b = nullptr;
  const int32_t* group_sizes = nullptr;  // device (CUDA) or host (CPU) memory, [groups]
  const float* col_scale = nullptr;      // [groups, n]
  const float* row_scale = nullptr;      // [m] or null
  void* out = nullptr;
  OutType out_type = OutType::kBF16;
  int tile = -1;  // CUDA: compiled grouped configuration index; -1 = choose by rows per group
};

inline ffi::Error InvalidGrouped(const std::string& what) {
  return ffi::Error::InvalidArgument("modelopt_fp8_grouped_gemm: " + what);
}

inline ffi::Error ParseFp8GroupedGemmProblem(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer group_sizes,
                                             ffi::AnyBuffer col_scale, ffi::RemainingArgs extra, ffi::AnyBuffer out,
                                             bool has_row_scale, int32_t tile, Fp8GroupedGemmProblem* p) {
  // The upper bound of tile depends on the device's kernel table; the CUDA handler checks it.
  if (tile < -1) return InvalidGrouped("tile must be -1 (choose) or a configuration index, got " + std::to_string(tile));
  p->tile = tile;
  auto ad = a.dimensions(), bd = b.dimensions(), gd = group_sizes.dimensions(), cd = col_scale.dimensions(),
       od = out.dimensions();
  if (a.element_type() != ffi::DataType::F8E4M3FN || b.element_type() != ffi::DataType::F8E4M3FN) {
    return InvalidGrouped("a and b must be float8_e4m3fn");
  }
  if (ad.size() != 2 || bd.size() != 3 || od.size() != 2) {
    return InvalidGrouped("a [M, K], b [G, N, K] and out [M, N] expected; got a " + DimsToString(ad) + ", b " +
                          DimsToString(bd) + ", out " + DimsToString(od));
  }
  p->m = ad[0];
  p->k = ad[1];
  p->groups = bd[0];
  p->n = bd[1];
  if (bd[2] != p->k) return InvalidGrouped("K mismatch: a " + DimsToString(ad) + " vs b " + DimsToString(bd));
  if (od[0] != p->m || od[1] != p->n) {
    return InvalidGrouped("out must be [" + std::to_string(p->m) + ", " + std::to_string(p->n) + "], got " +
                          DimsToString(od));
  }
  if (group_sizes.element_type() != ffi::DataType::S32 || gd.size() != 1 || gd[0] != p->groups) {
    return InvalidGrouped("group_sizes must be int32 [" + std::to_string(p->groups) + "], got " + DimsToString(gd));
  }
  if (col_scale.element_type() != ffi::DataType::F32 || cd.size() != 2 || cd[0] != p->groups || cd[1] != p->n) {
    return InvalidGrouped("col_scale must be float32 [" + std::to_string(p->groups) + ", " + std::to_string(p->n) +
                          "], got " + DimsToString(cd));
  }
  switch (out.element_type()) {
    case ffi::DataType::BF16: p->out_type = OutType::kBF16; break;
    case ffi::DataType::F16: p->out_type = OutType::kF16; break;
    case ffi::DataType::F32: p->out_type = OutType::kF32; break;
    default: return InvalidGrouped("out dtype must be bfloat16, float16 or float32");
  }
  size_t index = 0;
  if (has_row_scale) {
    if (auto e = TakeVector(extra, &index, "row_scale", p->m, &p->row_scale); e.failure()) return e;
  }
  if (index != extra.size()) {
    return InvalidGrouped(std::to_string(extra.size() - index) + " unexpected extra operand(s)");
  }
  p->a = a.untyped_data();
  p->b = b.untyped_data();
  p->group_sizes = static_cast<const int32_t*>(group_sizes.untyped_data());
  p->col_scale = static_cast<const float*>(col_scale.untyped_data());
  p->out = out.untyped_data();
  return ffi::Error::Success();
}

template <typename Binding>
auto BindFp8GroupedGemmOperands(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // a [M, K] e4m3fn, rows sorted by group
      .template Arg<ffi::AnyBuffer>()            // b [G, N, K] e4m3fn
      .template Arg<ffi::AnyBuffer>()            // group_sizes [G] int32
      .template Arg<ffi::AnyBuffer>()            // col_scale [G, N] float32
      .RemainingArgs()                           // row_scale [M] (optional)
      .template Ret<ffi::AnyBuffer>()            // out [M, N]
      .template Attr<bool>("has_row_scale")
      .template Attr<int32_t>("tile");            // CUDA configuration (-1: by rows per group); CPU ignores it
}

}  // namespace modelopt_jax

#endif  // MODELOPT_JAX_FFI_FP8_GROUPED_GEMM_PROBLEM_H_
