// sm100a (Blackwell) configurations and their table: the same op and epilogues on UMMA/TMEM
// kernels. Compiled when nvcc supports sm_100a; cannot run on the H200 (not tuned, see README).
#include "fp8_gemm_kernel.cuh"

namespace modelopt_jax::cuda {

template <class ElementD, Epi kEpi>
using Sm100Config0 = Fp8Gemm<cutlass::arch::Sm100, Shape<_128, _32, _128>, Shape<_1, _1, _1>,
                             cutlass::gemm::KernelTmaWarpSpecialized1SmSm100,
                             cutlass::epilogue::TmaWarpSpecialized1Sm, true, void, ElementD, kEpi>;
template <class ElementD, Epi kEpi>
using Sm100Config1 = Fp8Gemm<cutlass::arch::Sm100, Shape<_128, _128, _128>, Shape<_1, _1, _1>,
                             cutlass::gemm::KernelTmaWarpSpecialized1SmSm100,
                             cutlass::epilogue::TmaWarpSpecialized1Sm, false, void, ElementD, kEpi>;

LaunchStatus RunSm100Config0(const LaunchArgs& p) { return RunConfig<Sm100Config0>(p); }
LaunchStatus RunSm100Config1(const LaunchArgs& p) { return RunConfig<Sm100Config1>(p); }

const KernelConfig kSm100Configs[] = {
    {"sm100 swapab 128x32x128 1sm", RunSm100Config0},
    {"sm100 128x128x128 1sm", RunSm100Config1},
};
const int kNumSm100Configs = sizeof(kSm100Configs) / sizeof(kSm100Configs[0]);

int ChooseSm100Config(int m, int /*n*/, int /*k*/) { return m <= 64 ? 0 : 1; }

}  // namespace modelopt_jax::cuda
