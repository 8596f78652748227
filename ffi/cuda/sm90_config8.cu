// sm90a tile configuration 8: swap-AB 128x64x256, cluster 1x1x1, cooperative, stream-K (see
// fp8_gemm_kernel.cuh and sm90_configs.cu). At M <= 64 with N = 4096 (o_proj, down_proj) the
// data-parallel tiles number 64 for 132 SMs; stream-K hands each SM an equal share of the K
// iterations and fixes up split tiles through the workspace.
#include "fp8_gemm_kernel.cuh"

namespace modelopt_jax::cuda {

template <class ElementD, Epi kEpi>
using Sm90Config8 = Fp8Gemm<cutlass::arch::Sm90, Shape<_128, _64, _256>, Shape<_1, _1, _1>,
                            cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum,
                            cutlass::epilogue::TmaWarpSpecializedCooperative, true, cutlass::gemm::StreamKScheduler,
                            ElementD, kEpi>;

LaunchStatus RunSm90Config8(const LaunchArgs& p) { return RunConfig<Sm90Config8>(p); }

}  // namespace modelopt_jax::cuda
