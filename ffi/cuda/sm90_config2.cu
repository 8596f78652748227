// sm90a tile configuration 2: swap-AB 128x32x256, cluster 1x1x1, cooperative (see fp8_gemm_kernel.cuh and sm90_configs.cu).
#include "fp8_gemm_kernel.cuh"

namespace modelopt_jax::cuda {

template <class ElementD, Epi kEpi>
using Sm90Config2 = Fp8Gemm<cutlass::arch::Sm90, Shape<_128, _32, _256>, Shape<_1, _1, _1>, cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum,
                            cutlass::epilogue::TmaWarpSpecializedCooperative, true, void, ElementD, kEpi>;

LaunchStatus RunSm90Config2(const LaunchArgs& p) { return RunConfig<Sm90Config2>(p); }

}  // namespace modelopt_jax::cuda
