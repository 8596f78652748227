// sm90a tile configuration 3: swap-AB 64x64x256, cluster 1x1x1, ping-pong (see fp8_gemm_kernel.cuh and sm90_configs.cu).
#include "fp8_gemm_kernel.cuh"

namespace modelopt_jax::cuda {

template <class ElementD, Epi kEpi>
using Sm90Config3 = Fp8Gemm<cutlass::arch::Sm90, Shape<_64, _64, _256>, Shape<_1, _1, _1>, cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum,
                            cutlass::epilogue::TmaWarpSpecialized, true, void, ElementD, kEpi>;

LaunchStatus RunSm90Config3(const LaunchArgs& p) { return RunConfig<Sm90Config3>(p); }

}  // namespace modelopt_jax::cuda
