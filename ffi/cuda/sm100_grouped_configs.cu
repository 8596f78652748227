// sm100a (Blackwell) grouped configurations and their table: the same op, problem table and epilogue
// on UMMA/TMEM pointer-array kernels. Compiled when nvcc supports sm_100a; cannot run on the H200
// (not tuned: the rows-per-expert split mirrors the dense sm100 table).
#include "fp8_grouped_gemm_kernel.cuh"

namespace modelopt_jax::cuda {

template <class ElementD>
using Sm100GroupedSwap = Fp8GroupedGemm<cutlass::arch::Sm100, Shape<_128, _32, _128>, Shape<_1, _1, _1>,
                                        cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmSm100,
                                        cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm, true, ElementD>;
template <class ElementD>
using Sm100Grouped128x128 = Fp8GroupedGemm<cutlass::arch::Sm100, Shape<_128, _128, _128>, Shape<_1, _1, _1>,
                                           cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmSm100,
                                           cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm, false, ElementD>;

namespace {
size_t SwapWorkspace(const GroupedLaunchArgs& p) { return GroupedConfig<Sm100GroupedSwap>::WorkspaceBytes(p); }
LaunchStatus RunSwap(const GroupedLaunchArgs& p, void* ws) { return GroupedConfig<Sm100GroupedSwap>::Run(p, ws); }
size_t WideWorkspace(const GroupedLaunchArgs& p) { return GroupedConfig<Sm100Grouped128x128>::WorkspaceBytes(p); }
LaunchStatus RunWide(const GroupedLaunchArgs& p, void* ws) { return GroupedConfig<Sm100Grouped128x128>::Run(p, ws); }
}  // namespace

const GroupedKernelConfig kSm100GroupedConfigs[] = {
    {"sm100 grouped swapab 128x32x128 1sm", SwapWorkspace, RunSwap},
    {"sm100 grouped 128x128x128 1sm", WideWorkspace, RunWide},
};
const int kNumSm100GroupedConfigs = sizeof(kSm100GroupedConfigs) / sizeof(kSm100GroupedConfigs[0]);

int ChooseSm100GroupedConfig(int m, int /*n*/, int /*k*/, int groups) {
  const int per_group = groups > 0 ? (m + groups - 1) / groups : m;
  return per_group <= 64 ? 0 : 1;
}

}  // namespace modelopt_jax::cuda
