// sm90a weight-streaming configurations for a few token rows (see fp8_stream_gemm_kernel.cuh and
// sm90_configs.cu): 8 or 16 token rows per CTA, 4 or 8 warps splitting K.
#include "fp8_stream_gemm_kernel.cuh"

namespace modelopt_jax::cuda {

LaunchStatus RunSm90Stream8W4(const LaunchArgs& p) { return stream_gemm::Run<8, 4>(p); }
LaunchStatus RunSm90Stream8W8(const LaunchArgs& p) { return stream_gemm::Run<8, 8>(p); }
LaunchStatus RunSm90Stream16W4(const LaunchArgs& p) { return stream_gemm::Run<16, 4>(p); }
LaunchStatus RunSm90Stream16W8(const LaunchArgs& p) { return stream_gemm::Run<16, 8>(p); }

}  // namespace modelopt_jax::cuda
