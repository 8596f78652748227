// sm90a grouped configurations for many rows per expert (prefill chunks): the tokens on the tile's
// M side (see fp8_grouped_gemm_kernel.cuh; the table and the choice are in sm90_grouped_configs.cu).
#include "fp8_grouped_gemm_kernel.cuh"

namespace modelopt_jax::cuda {

template <class ElementD>
using Sm90Grouped128x128 = Fp8GroupedGemm<cutlass::arch::Sm90, Shape<_128, _128, _128>, Shape<_1, _1, _1>,
                                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
                                          cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong, false, ElementD>;
template <class ElementD>
using Sm90Grouped128x256 = Fp8GroupedGemm<cutlass::arch::Sm90, Shape<_128, _256, _128>, Shape<_1, _1, _1>,
                                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
                                          cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, false, ElementD>;

size_t Sm90Grouped128x128Workspace(const GroupedLaunchArgs& p) { return GroupedConfig<Sm90Grouped128x128>::WorkspaceBytes(p); }
LaunchStatus RunSm90Grouped128x128(const GroupedLaunchArgs& p, void* ws) { return GroupedConfig<Sm90Grouped128x128>::Run(p, ws); }
size_t Sm90Grouped128x256Workspace(const GroupedLaunchArgs& p) { return GroupedConfig<Sm90Grouped128x256>::WorkspaceBytes(p); }
LaunchStatus RunSm90Grouped128x256(const GroupedLaunchArgs& p, void* ws) { return GroupedConfig<Sm90Grouped128x256>::Run(p, ws); }

}  // namespace modelopt_jax::cuda
