// CUTLASS 3.x grouped (pointer-array) FP8 GEMM for a sparse layer's experts, one tile configuration
// (sm90a warp-specialized or sm100a UMMA kernels; the epilogue visitor nodes serve both).
//
//   out[m, n] = out_type( row[m] * (col[g(m), n] * acc[m, n]) )     rows m of group g
//
// Group sizes live on the device (the router computed them), so the host never learns them: a
// one-block setup kernel scans them on XLA's stream and writes the per-group problem table
// (shapes, operand pointers, strides, scale pointers) into the workspace; CUTLASS's grouped
// persistent scheduler reads that table on the device (no host problem shapes), so any routing
// runs without recompiling and without a device-to-host copy. Empty groups get zero tiles.
// After the GEMM a tail kernel zeroes the rows past the sizes' sum. Sizes that are negative or
// sum past M cannot be reported from the device: the setup kernel then runs no group and the
// tail kernel fills the whole output with NaN, so the fault is loud, never a silently wrong row.
//
// As in the dense kernels (fp8_gemm_kernel.cuh), small groups swap the problem (compute
// out_g^T = W_g x_g^T, written column-major, which is out_g row-major): the expert's weight fills
// the wide tile side and the few tokens an expert gets at decode the narrow one.
#ifndef MODELOPT_JAX_FFI_CUDA_FP8_GROUPED_GEMM_KERNEL_CUH_
#define MODELOPT_JAX_FFI_CUDA_FP8_GROUPED_GEMM_KERNEL_CUH_

#include <cstdint>
#include <type_traits>

#include <cub/block/block_scan.cuh>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "grouped_launch.h"

namespace modelopt_jax::cuda {

using namespace cute;

namespace grouped_detail {

constexpr int kSetupThreads = 256;

// Rounds `bytes` up to 256 so every table in the workspace starts aligned for any element type.
constexpr size_t Align(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Where each table lives in the workspace: offsets in bytes, computed the same way on the host
// (to size and point) and passed by value to the setup kernel.
template <class Problem, class StrideA, class StrideB, class StrideD, class ElementD>
struct Layout {
  size_t problems, ptr_a, ptr_b, ptr_d, stride_a, stride_b, stride_d, ptr_row, ptr_col, status, cutlass, total;

  explicit Layout(int groups) {
    size_t at = 0;
    auto take = [&](size_t bytes) { size_t here = at; at += Align(bytes); return here; };
    problems = take(sizeof(Problem) * groups);
    ptr_a = take(sizeof(void*) * groups);
    ptr_b = take(sizeof(void*) * groups);
    ptr_d = take(sizeof(void*) * groups);
    stride_a = take(sizeof(StrideA) * groups);
    stride_b = take(sizeof(StrideB) * groups);
    stride_d = take(sizeof(StrideD) * groups);
    ptr_row = take(sizeof(void*) * groups);
    ptr_col = take(sizeof(void*) * groups);
    status = take(2 * sizeof(int32_t));  // [rows in groups, invalid flag]
    cutlass = at;
    total = at;
  }
};

// One block: exclusive scan of the group sizes (each thread sums a run of consecutive groups, a
// block scan combines the runs), then each thread writes its groups' rows of the table.
template <bool kSwapAB, class Problem, class StrideA, class StrideB, class StrideD, class ElementD, class LayoutT>
__global__ void __launch_bounds__(kSetupThreads) SetupGroups(GroupedLaunchArgs p, char* ws, LayoutT layout,
                                                             StrideA stride_a, StrideB stride_b, StrideD stride_d) {
  using Scan = cub::BlockScan<long long, kSetupThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int any_negative;
  if (threadIdx.x == 0) any_negative = 0;
  __syncthreads();
  const int per_thread = (p.groups + kSetupThreads - 1) / kSetupThreads;
  const int first = threadIdx.x * per_thread;
  const int last = min(first + per_thread, p.groups);
  long long run = 0;
  for (int g = first; g < last; ++g) {
    const int size = p.group_sizes[g];
    if (size < 0) any_negative = 1;  // benign race: every writer stores 1
    run += size;
  }
  long long offset = 0, total = 0;
  Scan(scan_storage).ExclusiveSum(run, offset, total);
  __syncthreads();
  const bool invalid = any_negative != 0 || total > p.m;
  auto* problems = reinterpret_cast<Problem*>(ws + layout.problems);
  auto* ptr_a = reinterpret_cast<const cutlass::float_e4m3_t**>(ws + layout.ptr_a);
  auto* ptr_b = reinterpret_cast<const cutlass::float_e4m3_t**>(ws + layout.ptr_b);
  auto* ptr_d = reinterpret_cast<ElementD**>(ws + layout.ptr_d);
  auto* strides_a = reinterpret_cast<StrideA*>(ws + layout.stride_a);
  auto* strides_b = reinterpret_cast<StrideB*>(ws + layout.stride_b);
  auto* strides_d = reinterpret_cast<StrideD*>(ws + layout.stride_d);
  auto* ptr_row = reinterpret_cast<const float**>(ws + layout.ptr_row);
  auto* ptr_col = reinterpret_cast<const float**>(ws + layout.ptr_col);
  const auto* a = static_cast<const cutlass::float_e4m3_t*>(p.a);
  const auto* b = static_cast<const cutlass::float_e4m3_t*>(p.b);
  auto* out = static_cast<ElementD*>(p.out);
  for (int g = first; g < last; ++g) {
    const int rows = invalid ? 0 : max(p.group_sizes[g], 0);
    const auto* x = a + offset * p.k;        // this group's activation rows
    const auto* w = b + int64_t(g) * p.n * p.k;  // this group's weight
    if constexpr (kSwapAB) {
      problems[g] = make_shape(p.n, rows, p.k);
      ptr_a[g] = w, ptr_b[g] = x;
    } else {
      problems[g] = make_shape(rows, p.n, p.k);
      ptr_a[g] = x, ptr_b[g] = w;
    }
    ptr_d[g] = out + offset * p.n;
    strides_a[g] = stride_a, strides_b[g] = stride_b, strides_d[g] = stride_d;
    ptr_row[g] = p.row_scale ? p.row_scale + offset : nullptr;
    ptr_col[g] = p.col_scale + int64_t(g) * p.n;
    offset += rows;
  }
  if (threadIdx.x == 0) {
    auto* status = reinterpret_cast<int32_t*>(ws + layout.status);
    status[0] = invalid ? 0 : static_cast<int32_t>(total);
    status[1] = invalid ? 1 : 0;
  }
}

// Zeroes output rows [rows in groups, M), or writes NaN everywhere when the sizes were invalid.
template <class ElementD>
__global__ void FinishTail(ElementD* out, int64_t m, int64_t n, const int32_t* status) {
  const bool invalid = status[1] != 0;
  const int64_t start = invalid ? 0 : int64_t(status[0]) * n;
  const ElementD fill = invalid ? ElementD(NAN) : ElementD(0.0f);
  for (int64_t i = start + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < m * n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = fill;
  }
}

}  // namespace grouped_detail

template <class ArchTag, class TileShape, class ClusterShape, class MainloopSchedule, class EpilogueSchedule,
          bool kSwapAB, class ElementD>
struct Fp8GroupedGemm {
  using ElementAB = cutlass::float_e4m3_t;
  static constexpr int kAlignAB = 16;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  using LayoutA = cutlass::layout::RowMajor;     // [rows, K]
  using LayoutB = cutlass::layout::ColumnMajor;  // [K, cols], K contiguous
  using LayoutD = std::conditional_t<kSwapAB, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  static constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;

  // Per-group pointer arrays (float*: CUTLASS's array-of-pointers broadcasts): the token scale runs
  // along the output's rows, the channel scale along its columns; swapping trades their axes.
  using AlongN = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, float*, float, Stride<_0, _1, _0>>;
  using AlongM = cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, float*, float, Stride<_1, _0, _0>>;
  using TokenScale = std::conditional_t<kSwapAB, AlongN, AlongM>;
  using ChannelScale = std::conditional_t<kSwapAB, AlongM, AlongN>;
  using ChannelTimesAcc = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>, ChannelScale,
      cutlass::epilogue::fusion::Sm90AccFetch>;
  using FusionOp = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, ElementD, float, kRound>, TokenScale,
      ChannelTimesAcc>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      ArchTag, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlignD,  // no C operand
      ElementD, LayoutD*, kAlignD, EpilogueSchedule, FusionOp>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      ArchTag, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA*, kAlignAB, ElementAB, LayoutB*,
      kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Problem = typename ProblemShape::UnderlyingProblemShape;
  using TableLayout = grouped_detail::Layout<Problem, StrideA, StrideB, StrideD, ElementD>;

  // CUTLASS arguments pointing into the workspace at `ws` (null while only sizing it).
  static typename Gemm::Arguments MakeArguments(const GroupedLaunchArgs& p, char* ws) {
    const TableLayout t(p.groups);
    auto at = [&](size_t offset) { return ws ? ws + offset : nullptr; };
    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {p.groups, reinterpret_cast<Problem*>(at(t.problems)), nullptr};
    args.mainloop = {reinterpret_cast<const ElementAB**>(at(t.ptr_a)), reinterpret_cast<StrideA*>(at(t.stride_a)),
                     reinterpret_cast<const ElementAB**>(at(t.ptr_b)), reinterpret_cast<StrideB*>(at(t.stride_b))};
    auto* strides_d = reinterpret_cast<StrideD*>(at(t.stride_d));
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = strides_d;  // no C operand: never read
    args.epilogue.ptr_D = reinterpret_cast<ElementD**>(at(t.ptr_d));
    args.epilogue.dD = strides_d;
    auto* rows = p.row_scale ? reinterpret_cast<const float* const*>(at(t.ptr_row)) : nullptr;
    args.epilogue.thread = {
        {rows, 1.0f, {}},  // token scale (null: 1)
        {{reinterpret_cast<const float* const*>(at(t.ptr_col)), 1.0f, {}}, {}, {}},  // channel scale x acc
        {}};
    args.hw_info.device_id = p.device;
    args.hw_info.sm_count = p.sm_count;
    return args;
  }

  static size_t WorkspaceBytes(const GroupedLaunchArgs& p) {
    return TableLayout(p.groups).total + Gemm::get_workspace_size(MakeArguments(p, nullptr));
  }

  static LaunchStatus Run(const GroupedLaunchArgs& p, void* workspace) {
    char* ws = static_cast<char*>(workspace);
    const TableLayout t(p.groups);
    const int rows = kSwapAB ? p.n : p.m, cols = kSwapAB ? p.m : p.n;  // strides do not depend on the rows
    const auto stride_a = cutlass::make_cute_packed_stride(StrideA{}, make_shape(rows, p.k, 1));
    const auto stride_b = cutlass::make_cute_packed_stride(StrideB{}, make_shape(cols, p.k, 1));
    const auto stride_d = cutlass::make_cute_packed_stride(StrideD{}, make_shape(rows, cols, 1));
    grouped_detail::SetupGroups<kSwapAB, Problem, StrideA, StrideB, StrideD, ElementD>
        <<<1, grouped_detail::kSetupThreads, 0, p.stream>>>(p, ws, t, stride_a, stride_b, stride_d);
    if (cudaGetLastError() != cudaSuccess) return LaunchStatus::kRun;
    Gemm gemm;
    auto args = MakeArguments(p, ws);
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return LaunchStatus::kCannotImplement;
    if (gemm.initialize(args, ws + t.cutlass, p.stream) != cutlass::Status::kSuccess) return LaunchStatus::kInitialize;
    if (gemm.run(p.stream) != cutlass::Status::kSuccess) return LaunchStatus::kRun;
    const int64_t elements = int64_t(p.m) * p.n;
    const int blocks = static_cast<int>(std::min<int64_t>((elements + 255) / 256, 4 * int64_t(p.sm_count)));
    grouped_detail::FinishTail<ElementD><<<std::max(blocks, 1), 256, 0, p.stream>>>(
        static_cast<ElementD*>(p.out), p.m, p.n, reinterpret_cast<const int32_t*>(ws + t.status));
    return cudaGetLastError() == cudaSuccess ? LaunchStatus::kOk : LaunchStatus::kRun;
  }
};

// Runs configuration `Cfg` (a template over the output type) for one call.
template <template <class> class Cfg>
struct GroupedConfig {
  static size_t WorkspaceBytes(const GroupedLaunchArgs& p) {
    return p.out_bf16 ? Cfg<cutlass::bfloat16_t>::WorkspaceBytes(p) : Cfg<cutlass::half_t>::WorkspaceBytes(p);
  }
  static LaunchStatus Run(const GroupedLaunchArgs& p, void* ws) {
    return p.out_bf16 ? Cfg<cutlass::bfloat16_t>::Run(p, ws) : Cfg<cutlass::half_t>::Run(p, ws);
  }
};

}  // namespace modelopt_jax::cuda

#endif  // MODELOPT_JAX_FFI_CUDA_FP8_GROUPED_GEMM_KERNEL_CUH_
