// sm90a tile configuration 4: 64x128x128, cluster 2x1x1, ping-pong (see fp8_gemm_kernel.cuh and sm90_configs.cu).
#include "fp8_gemm_kernel.cuh"

namespace modelopt_jax::cuda {

template <class ElementD, Epi kEpi>
using Sm90Config4 = Fp8Gemm<cutlass::arch::Sm90, Shape<_64, _128, _128>, Shape<_2, _1, _1>, cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum,
                            cutlass::epilogue::TmaWarpSpecialized, false, void, ElementD, kEpi>;

LaunchStatus RunSm90Config4(const LaunchArgs& p) { return RunConfig<Sm90Config4>(p); }

}  // namespace modelopt_jax::cuda
