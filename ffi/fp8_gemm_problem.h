// One FP8 GEMM call, decoded and validated from its XLA FFI operands.
//
//   out[m, n] = out_type( alpha * row_scale[m] * col_scale[n] * sum_k a[m, k] * b[n, k] + bias[n] )
//
// a: activation [M, K] float8_e4m3fn, row-major. b: weight as stored in the checkpoint [N, K]
// float8_e4m3fn (K-major, never transposed). row_scale [M], col_scale [N] and bias [N] are optional
// float32 buffers (announced by the has_* attributes, passed in that order after a and b); alpha is
// a compile-time attribute, and so are tile, swizzle and raster, the CUDA kernel choice (see
// Fp8GemmProblem; the CPU handler validates and ignores them). With has_out_init, one more operand
// follows: a buffer aliased to the output (tests pre-fill it with NaN to prove that the kernel
// writes every element). The CPU reference handler and the CUDA handler share this parser so that
// both accept and reject exactly the same calls with the same messages.
#ifndef MODELOPT_JAX_FFI_FP8_GEMM_PROBLEM_H_
#define MODELOPT_JAX_FFI_FP8_GEMM_PROBLEM_H_

#include <cstdint>
#include <string>
#include <utility>

#include "ffi_dims.h"
#include "xla/ffi/api/ffi.h"

namespace modelopt_jax {

namespace ffi = xla::ffi;

enum class OutType { kBF16, kF16, kF32 };

struct Fp8GemmProblem {
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  const void* b = nullptr;
  const float* row_scale = nullptr;
  const float* col_scale = nullptr;
  const float* bias = nullptr;
  void* out = nullptr;
  OutType out_type = OutType::kBF16;
  float alpha = 1.0f;
  // Kernel choice (CUDA), named like the options of CUTLASS's persistent tile scheduler
  // (example 54: max_swizzle_size, raster_order):
  int tile = -1;    // compiled tile configuration index; -1 = choose by M
  int swizzle = 1;  // tiles swizzled in groups of 1, 2, 4 or 8 (L2 reuse)
  int raster = 0;   // 0 heuristic, 1 along M, 2 along N
};

inline ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("modelopt_fp8_gemm: " + what);
}

// Decodes an optional float32 vector of `length` elements from `extra` at `*index`.
inline ffi::Error TakeVector(ffi::RemainingArgs extra, size_t* index, const char* name, int64_t length,
                             const float** out) {
  auto buffer = extra.get<ffi::AnyBuffer>(*index);
  if (buffer.has_error()) return Invalid(std::string(name) + " announced by has_" + name + " is missing");
  ++*index;
  auto dims = buffer->dimensions();
  if (buffer->element_type() != ffi::DataType::F32 || dims.size() != 1 || dims[0] != length) {
    return Invalid(std::string(name) + " must be float32 [" + std::to_string(length) + "], got " +
                   DimsToString(dims) + " of dtype code " + std::to_string(static_cast<int>(buffer->element_type())));
  }
  *out = static_cast<const float*>(buffer->untyped_data());
  return ffi::Error::Success();
}

inline ffi::Error ParseFp8GemmProblem(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::RemainingArgs extra,
                                      ffi::AnyBuffer out, float alpha, bool has_row_scale, bool has_col_scale,
                                      bool has_bias, bool has_out_init, int32_t tile, int32_t swizzle,
                                      int32_t raster, Fp8GemmProblem* p) {
  // The upper bound of tile depends on the device's kernel table; the CUDA handler checks it.
  if (tile < -1) return Invalid("tile must be -1 (choose by M) or a configuration index, got " + std::to_string(tile));
  if (swizzle != 1 && swizzle != 2 && swizzle != 4 && swizzle != 8) {
    return Invalid("swizzle must be 1, 2, 4 or 8, got " + std::to_string(swizzle));
  }
  if (raster < 0 || raster > 2) {
    return Invalid("raster must be 0 (heuristic), 1 (along M) or 2 (along N), got " + std::to_string(raster));
  }
  auto ad = a.dimensions(), bd = b.dimensions(), od = out.dimensions();
  if (a.element_type() != ffi::DataType::F8E4M3FN || b.element_type() != ffi::DataType::F8E4M3FN) {
    return Invalid("a and b must be float8_e4m3fn");
  }
  if (ad.size() != 2 || bd.size() != 2 || od.size() != 2) {
    return Invalid("a [M, K], b [N, K] and out [M, N] must be 2-D; got a " + DimsToString(ad) + ", b " +
                   DimsToString(bd) + ", out " + DimsToString(od));
  }
  p->m = ad[0];
  p->k = ad[1];
  p->n = bd[0];
  if (bd[1] != p->k) return Invalid("K mismatch: a " + DimsToString(ad) + " vs b " + DimsToString(bd));
  if (od[0] != p->m || od[1] != p->n) {
    return Invalid("out must be [" + std::to_string(p->m) + ", " + std::to_string(p->n) + "], got " + DimsToString(od));
  }
  switch (out.element_type()) {
    case ffi::DataType::BF16: p->out_type = OutType::kBF16; break;
    case ffi::DataType::F16: p->out_type = OutType::kF16; break;
    case ffi::DataType::F32: p->out_type = OutType::kF32; break;
    default: return Invalid("out dtype must be bfloat16, float16 or float32");
  }
  size_t index = 0;
  if (has_row_scale) {
    if (auto e = TakeVector(extra, &index, "row_scale", p->m, &p->row_scale); e.failure()) return e;
  }
  if (has_col_scale) {
    if (auto e = TakeVector(extra, &index, "col_scale", p->n, &p->col_scale); e.failure()) return e;
  }
  if (has_bias) {
    if (auto e = TakeVector(extra, &index, "bias", p->n, &p->bias); e.failure()) return e;
  }
  if (has_out_init) {
    auto init = extra.get<ffi::AnyBuffer>(index);
    if (init.has_error() || init->untyped_data() != out.untyped_data()) {
      return Invalid("out_init must be the last operand and aliased to the output");
    }
    ++index;
  }
  if (index != extra.size()) {
    return Invalid(std::to_string(extra.size() - index) + " unexpected extra operand(s)");
  }
  p->a = a.untyped_data();
  p->b = b.untyped_data();
  p->out = out.untyped_data();
  p->alpha = alpha;
  p->tile = tile;
  p->swizzle = swizzle;
  p->raster = raster;
  return ffi::Error::Success();
}

// The op's operands and attributes in order, appended to a handler's binding (which may start
// with platform context such as the CUDA stream), so both handlers declare exactly the same op.
template <typename Binding>
auto BindFp8GemmOperands(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // a [M, K] e4m3fn (bindings are rvalue-built)
      .template Arg<ffi::AnyBuffer>()            // b [N, K] e4m3fn
      .RemainingArgs()                           // row_scale, col_scale, bias, out_init (optional)
      .template Ret<ffi::AnyBuffer>()            // out [M, N]
      .template Attr<float>("alpha")
      .template Attr<bool>("has_row_scale")
      .template Attr<bool>("has_col_scale")
      .template Attr<bool>("has_bias")
      .template Attr<bool>("has_out_init")
      .template Attr<int32_t>("tile")
      .template Attr<int32_t>("swizzle")
      .template Attr<int32_t>("raster");
}

}  // namespace modelopt_jax

#endif  // MODELOPT_JAX_FFI_FP8_GEMM_PROBLEM_H_
