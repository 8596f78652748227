// sm90a tile configuration 7: 256x128x128, cluster 2x1x1, cooperative (see fp8_gemm_kernel.cuh and sm90_configs.cu).
#include "fp8_gemm_kernel.cuh"

namespace modelopt_jax::cuda {

template <class ElementD, Epi kEpi>
using Sm90Config7 = Fp8Gemm<cutlass::arch::Sm90, Shape<_256, _128, _128>, Shape<_2, _1, _1>, cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum,
                            cutlass::epilogue::TmaWarpSpecializedCooperative, false, void, ElementD, kEpi>;

LaunchStatus RunSm90Config7(const LaunchArgs& p) { return RunConfig<Sm90Config7>(p); }

}  // namespace modelopt_jax::cuda
