// XLA FFI handler of the modelopt_fp8_gemm op on CUDA: validates the call (shared parser with the
// CPU handler), picks the architecture's kernel table by compute capability and a tile
// configuration by M (or the one the `tile` attribute names, for tuning; `swizzle` and `raster` set
// the persistent tile scheduler), and launches on XLA's stream. Every failure returns an
// ffi::Error; nothing aborts the process.
#include <cuda_runtime_api.h>

#include <string>

#include "../fp8_gemm_problem.h"
#include "device_info.h"
#include "gemm_launch.h"

namespace modelopt_jax::cuda {
namespace {

ffi::Error Fp8GemmCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                       ffi::RemainingArgs extra, ffi::Result<ffi::AnyBuffer> out, float alpha, bool has_row_scale,
                       bool has_col_scale, bool has_bias, bool has_out_init, int32_t tile, int32_t swizzle,
                       int32_t raster) {
  Fp8GemmProblem p;
  if (auto e = ParseFp8GemmProblem(a, b, extra, *out, alpha, has_row_scale, has_col_scale, has_bias, has_out_init,
                                   tile, swizzle, raster, &p);
      e.failure()) {
    return e;
  }
  if (p.out_type == OutType::kF32) return Invalid("the CUDA kernels write bfloat16 or float16, not float32");
  if (p.row_scale && p.col_scale && alpha != 1.0f) {
    return Invalid("alpha must be folded into the scale vectors when both row_scale and col_scale are given");
  }
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return ffi::Error::Internal("modelopt_fp8_gemm: cudaGetDevice failed");
  const DeviceInfo info = GetDeviceInfo(device);

  const KernelConfig* table = nullptr;
  int count = 0, chosen = -1;
  const int m = static_cast<int>(p.m), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
#ifdef MODELOPT_JAX_HAVE_SM90
  if (info.major == 9) table = kSm90Configs, count = kNumSm90Configs, chosen = ChooseSm90Config(m, n, k);
#endif
#ifdef MODELOPT_JAX_HAVE_SM100
  if (info.major == 10) table = kSm100Configs, count = kNumSm100Configs, chosen = ChooseSm100Config(m, n, k);
#endif
  if (table == nullptr) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "modelopt_fp8_gemm: no kernel compiled for compute capability " + std::to_string(info.major) +
                          "." + std::to_string(info.minor) + " (built for sm90a/sm100a)");
  }
  const int index = p.tile >= 0 ? p.tile : chosen;
  if (index >= count) {
    return Invalid("tile " + std::to_string(index) + " out of range (" + std::to_string(count) +
                   " compiled for compute capability " + std::to_string(info.major) + "." +
                   std::to_string(info.minor) + ")");
  }
  if (p.k % 16 != 0 || p.n % 8 != 0) {
    return Invalid("K (" + std::to_string(p.k) + ") must be a multiple of 16 and N (" + std::to_string(p.n) +
                   ") of 8 for the CUDA kernels, the rule by which backend 'auto' picks them "
                   "(modelopt_jax.ops.gemm._cutlass_qualifies); checkpoint loading pads N to a multiple of 16 "
                   "(quant.schemes.N_ALIGN) but never pads K");
  }

  LaunchArgs args;
  args.m = m, args.n = n, args.k = k;
  args.a = p.a, args.b = p.b, args.out = p.out;
  args.row_scale = p.row_scale, args.col_scale = p.col_scale, args.bias = p.bias;
  args.out_bf16 = p.out_type == OutType::kBF16;
  args.alpha = p.alpha;
  args.stream = stream, args.device = device, args.sm_count = info.sm_count;
  args.swizzle = p.swizzle, args.raster = p.raster;
  LaunchStatus status = table[index].run(args);
  if (status != LaunchStatus::kOk) {
    return ffi::Error::Internal(std::string("modelopt_fp8_gemm [") + table[index].name + "] M=" + std::to_string(m) +
                                " N=" + std::to_string(n) + " K=" + std::to_string(k) + ": " + StatusText(status));
  }
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return ffi::Error::Internal(std::string("modelopt_fp8_gemm [") + table[index].name + "]: " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace modelopt_jax::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(ModeloptFp8GemmCuda, modelopt_jax::cuda::Fp8GemmCuda,
                              modelopt_jax::BindFp8GemmOperands(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

// Names of the compiled configurations, for the tuning script: returns the count, and copies the
// name of configuration `index` (for compute capability `major`) into `buffer`.
extern "C" int ModeloptFp8GemmConfigName(int major, int index, char* buffer, int size) {
  const modelopt_jax::cuda::KernelConfig* table = nullptr;
  int count = 0;
#ifdef MODELOPT_JAX_HAVE_SM90
  if (major == 9) table = modelopt_jax::cuda::kSm90Configs, count = modelopt_jax::cuda::kNumSm90Configs;
#endif
#ifdef MODELOPT_JAX_HAVE_SM100
  if (major == 10) table = modelopt_jax::cuda::kSm100Configs, count = modelopt_jax::cuda::kNumSm100Configs;
#endif
  return modelopt_jax::cuda::CopyConfigName(table, count, index, buffer, size);
}
