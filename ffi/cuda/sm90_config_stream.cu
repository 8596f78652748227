// sm90a weight-streaming configurations for a few token rows (see fp8_stream_gemm_kernel.cuh and
// sm90_configs.cu): 16-64 weight rows x 8 or 16 token rows per CTA, 4 or 8 warps.
#include "fp8_stream_gemm_kernel.cuh"

namespace modelopt_jax::cuda {

// Run<token rows, warps, 16-row tiles per warp, steps per warp pass, row groups of warps>
LaunchStatus RunSm90Stream16x8W4(const LaunchArgs& p) { return stream_gemm::Run<8, 4, 1, 4, 1>(p); }
LaunchStatus RunSm90Stream16x8W8(const LaunchArgs& p) { return stream_gemm::Run<8, 8, 1, 4, 1>(p); }
LaunchStatus RunSm90Stream16x16W8(const LaunchArgs& p) { return stream_gemm::Run<16, 8, 1, 4, 1>(p); }
LaunchStatus RunSm90Stream32x8W8(const LaunchArgs& p) { return stream_gemm::Run<8, 8, 1, 4, 2>(p); }
LaunchStatus RunSm90Stream64x8W8(const LaunchArgs& p) { return stream_gemm::Run<8, 8, 1, 4, 4>(p); }
LaunchStatus RunSm90Stream64x16W8(const LaunchArgs& p) { return stream_gemm::Run<16, 8, 1, 4, 4>(p); }

}  // namespace modelopt_jax::cuda
