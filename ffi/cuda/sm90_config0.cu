// sm90a tile configuration 0: swap-AB 64x16x256, cluster 1x1x1, warp-specialized (see fp8_gemm_kernel.cuh and sm90_configs.cu).
#include "fp8_gemm_kernel.cuh"

namespace modelopt_jax::cuda {

template <class ElementD, Epi kEpi>
using Sm90Config0 = Fp8Gemm<cutlass::arch::Sm90, Shape<_64, _16, _256>, Shape<_1, _1, _1>, cutlass::gemm::KernelTmaWarpSpecializedFP8FastAccum,
                            cutlass::epilogue::TmaWarpSpecialized, true, void, ElementD, kEpi>;

LaunchStatus RunSm90Config0(const LaunchArgs& p) { return RunConfig<Sm90Config0>(p); }

}  // namespace modelopt_jax::cuda
