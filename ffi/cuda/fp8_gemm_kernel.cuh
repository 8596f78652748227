// CUTLASS 3.x FP8 GEMM with ModelOpt's epilogues, for one tile configuration.
//
//   out[m, n] = out_type( row[m] * (col[n] * acc[m, n]) + bias[n] )      (vector epilogue)
//   out[m, n] = out_type( alpha * acc[m, n] )                            (scalar epilogue)
//
// A is the activation [M, K] row-major, B the weight exactly as stored [N, K] (K-major, i.e. a
// column-major K x N operand): no transpose ever. For small M the problem is swapped (compute
// D^T = W A^T, written column-major, which is D row-major): the weight then fills the wide M side
// of the tile and M (the tokens) the narrow N side, so a handful of tokens still gets full tiles.
// In swapped mode the per-token and per-channel broadcasts trade places.
// Missing vectors use CUTLASS's null_default (the handler passes alpha there), so one vector
// kernel serves per-token, per-channel, fused-shard and bias variants.
#ifndef MODELOPT_JAX_FFI_CUDA_FP8_GEMM_KERNEL_CUH_
#define MODELOPT_JAX_FFI_CUDA_FP8_GEMM_KERNEL_CUH_

#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "gemm_launch.h"

namespace modelopt_jax::cuda {

using namespace cute;

enum class Epi { kScalar, kVector };

template <class ArchTag, class TileShape, class ClusterShape, class MainloopSchedule, class EpilogueSchedule,
          bool kSwapAB, class TileScheduler, class ElementD, Epi kEpi>
struct Fp8Gemm {
  using ElementAB = cutlass::float_e4m3_t;
  static constexpr int kAlignAB = 16;                               // 16 FP8 values = 16 bytes
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  using LayoutA = cutlass::layout::RowMajor;                        // [rows, K], K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;                     // [K, cols], K contiguous
  using LayoutD = std::conditional_t<kSwapAB, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  static constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

  // Broadcast along the CUTLASS problem's N axis (RowBroadcast) or M axis (ColBroadcast).
  using AlongN = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, float, float, Stride<_0, _1, _0>>;
  using AlongM = cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, float, float, Stride<_1, _0, _0>>;
  using TokenScale = std::conditional_t<kSwapAB, AlongN, AlongM>;   // per output row m of D
  using ChannelVec = std::conditional_t<kSwapAB, AlongM, AlongN>;   // per output column n of D
  using ChannelTimesAcc = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>, ChannelVec,
      cutlass::epilogue::fusion::Sm90AccFetch>;
  using VectorEpilogue = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::homogeneous_multiply_add, ElementD, float, kRound>,
      TokenScale, ChannelTimesAcc, ChannelVec>;
  using ScalarEpilogue = cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementD, float, kRound>;
  using FusionOp = std::conditional_t<kEpi == Epi::kScalar, ScalarEpilogue, VectorEpilogue>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      ArchTag, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD, kAlignD,                                        // no C operand
      ElementD, LayoutD, kAlignD, EpilogueSchedule, FusionOp>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      ArchTag, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA, kAlignAB, ElementAB, LayoutB, kAlignAB, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue, TileScheduler>;  // void: persistent
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments MakeArguments(const LaunchArgs& p) {
    // CUTLASS problem (rows x cols x K): rows = tokens unless swapped.
    const int rows = kSwapAB ? p.n : p.m, cols = kSwapAB ? p.m : p.n, k = p.k;
    const void* a = kSwapAB ? p.b : p.a;
    const void* b = kSwapAB ? p.a : p.b;
    auto stride_a = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, make_shape(rows, k, 1));
    auto stride_b = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape(cols, k, 1));
    auto stride_d = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape(rows, cols, 1));
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {rows, cols, k, 1},
        {static_cast<const ElementAB*>(a), stride_a, static_cast<const ElementAB*>(b), stride_b},
        {{}, nullptr, stride_d, static_cast<ElementD*>(p.out), stride_d}};
    if constexpr (kEpi == Epi::kScalar) {
      args.epilogue.thread.alpha = p.alpha;
      args.epilogue.thread.beta = 0.0f;
    } else {
      // A missing vector reads its null_default (gemm_launch.h: MissingScaleValues).
      const MissingScales missing = MissingScaleValues(p);
      args.epilogue.thread = {
          {p.row_scale, missing.token, {}},                 // token scale [M]
          {{p.col_scale, missing.channel, {}}, {}, {}},     // channel scale [N] x acc
          {p.bias, 0.0f, {}},                               // bias [N]
          {}};
    }
    args.hw_info.device_id = p.device;
    args.hw_info.sm_count = p.sm_count;
    args.scheduler.max_swizzle_size = p.swizzle;
    using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
    args.scheduler.raster_order = p.raster == 1 ? Raster::AlongM : p.raster == 2 ? Raster::AlongN : Raster::Heuristic;
    return args;
  }

  static LaunchStatus Run(const LaunchArgs& p) {
    Gemm gemm;
    auto args = MakeArguments(p);
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return LaunchStatus::kCannotImplement;
    // The persistent (non stream-K) schedulers used here need no workspace; refuse rather than
    // hand CUTLASS a null pointer if a future configuration does.
    if (Gemm::get_workspace_size(args) > 0) return LaunchStatus::kWorkspace;
    if (gemm.initialize(args, nullptr, p.stream) != cutlass::Status::kSuccess) return LaunchStatus::kInitialize;
    if (gemm.run(p.stream) != cutlass::Status::kSuccess) return LaunchStatus::kRun;
    return LaunchStatus::kOk;
  }
};

// Runs tile configuration `Cfg` (a template over output type and epilogue) for one call.
template <template <class, Epi> class Cfg>
LaunchStatus RunConfig(const LaunchArgs& p) {
  const bool vector = p.row_scale || p.col_scale || p.bias;
  if (p.out_bf16) {
    return vector ? Cfg<cutlass::bfloat16_t, Epi::kVector>::Run(p) : Cfg<cutlass::bfloat16_t, Epi::kScalar>::Run(p);
  }
  return vector ? Cfg<cutlass::half_t, Epi::kVector>::Run(p) : Cfg<cutlass::half_t, Epi::kScalar>::Run(p);
}

}  // namespace modelopt_jax::cuda

#endif  // MODELOPT_JAX_FFI_CUDA_FP8_GEMM_KERNEL_CUH_
