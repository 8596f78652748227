// sm90a grouped configurations for few rows per expert (decode, small batches): swap-AB, the
// expert's weight on the 64-wide tile side and its tokens on the narrow one (see
// fp8_grouped_gemm_kernel.cuh; the table and the choice are in sm90_grouped_configs.cu).
#include "fp8_grouped_gemm_kernel.cuh"

namespace modelopt_jax::cuda {

template <class ElementD>
using Sm90GroupedSwap16 = Fp8GroupedGemm<cutlass::arch::Sm90, Shape<_64, _16, _256>, Shape<_1, _1, _1>,
                                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
                                         cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong, true, ElementD>;
template <class ElementD>
using Sm90GroupedSwap64 = Fp8GroupedGemm<cutlass::arch::Sm90, Shape<_64, _64, _256>, Shape<_1, _1, _1>,
                                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
                                         cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong, true, ElementD>;

size_t Sm90GroupedSwap16Workspace(const GroupedLaunchArgs& p) { return GroupedConfig<Sm90GroupedSwap16>::WorkspaceBytes(p); }
LaunchStatus RunSm90GroupedSwap16(const GroupedLaunchArgs& p, void* ws) { return GroupedConfig<Sm90GroupedSwap16>::Run(p, ws); }
size_t Sm90GroupedSwap64Workspace(const GroupedLaunchArgs& p) { return GroupedConfig<Sm90GroupedSwap64>::WorkspaceBytes(p); }
LaunchStatus RunSm90GroupedSwap64(const GroupedLaunchArgs& p, void* ws) { return GroupedConfig<Sm90GroupedSwap64>::Run(p, ws); }

}  // namespace modelopt_jax::cuda
