// Weight-streaming grouped FP8 GEMM for a sparse layer's experts at decode: the same op as the
// CUTLASS grouped configurations (fp8_grouped_gemm_kernel.cuh),
//
//   out[m, n] = out_type( row[m] * (col[g(m), n] * sum_k a[m, k] * b[g(m), n, k]) )     rows m of group g
//
// with rows past the group sizes' sum written as zeros, and the whole output NaN when the sizes are
// invalid (a negative size, or a sum past M).
//
// Why a kernel of its own: at decode an expert gets a few token rows, so the GEMM is one pass over
// the weights of the experts the tokens touch. The CUTLASS pointer-array kernels spend a setup
// kernel, a persistent scheduler walking every group and a TMA pipeline per tile on that pass; they
// measured 0.45 TB/s for one token of a 128-expert layer. Here each CTA finds its expert itself
// (one block scan of the sizes, no setup kernel, no workspace) and streams a tile of that expert's
// weight rows through the dense streaming kernel's warp loop (fp8_stream_gemm_kernel.cuh: 16-byte
// L1-bypassing loads into mma.sync e4m3, float32 accumulation), so only the touched experts' bytes
// move, once.
//
// Grid: x = tiles of weight rows (N), y = slots. Slot j takes the j-th non-empty group in group
// order (there are at most min(G, M) of them); CTA y works on slots y, y + grid.y, ... until one has
// no group (grid.y is capped at a few CTAs per SM). A group with more token rows than a CTA holds is
// walked in tiles of kMTile rows (its weight tile is read again from L2). The CTAs of y = 0 also
// write the tail (zeros past the sum, or NaN everywhere) for their columns, so one launch does the
// whole op.
#ifndef MODELOPT_JAX_FFI_CUDA_FP8_GROUPED_STREAM_KERNEL_CUH_
#define MODELOPT_JAX_FFI_CUDA_FP8_GROUPED_STREAM_KERNEL_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <cub/block/block_scan.cuh>

#include "fp8_stream_gemm_kernel.cuh"
#include "grouped_launch.h"

namespace modelopt_jax::cuda::grouped_stream {

using stream_gemm::kTileRows;

struct Operands {
  const uint8_t* a;            // [M, K] e4m3fn, rows sorted by group
  const uint8_t* b;            // [G, N, K] e4m3fn
  const int32_t* group_sizes;  // [G]
  const float* col_scale;      // [G, N]
  const float* row_scale;      // [M] or null (1)
  void* out;                   // [M, N] of OutT
  int m, n, k, groups;
};

// What a scan of the group sizes tells a CTA (shared), and the group of the slot it works on.
struct Slot {
  int group;    // the slot's group (-1: fewer non-empty groups than this slot's index)
  int offset;   // its first row
  int rows;     // its rows
  int total;    // rows in groups (the tail starts here)
  int invalid;  // a negative size or a sum past M: the output is NaN
};

// The scan's running value: rows so far (64-bit: any int32 sizes add without overflow), non-empty
// groups so far, and whether a negative size was seen.
struct Counts {
  long long rows;
  int nonempty;
  int negative;
};

struct AddCounts {
  __device__ __forceinline__ Counts operator()(const Counts& x, const Counts& y) const {
    return Counts{x.rows + y.rows, x.nonempty + y.nonempty, x.negative | y.negative};
  }
};

// Each thread's run of consecutive groups and what the groups before it hold: one block scan per
// CTA, after which any slot's group is found by the one thread whose run holds it (NameSlot).
template <int kThreads>
struct GroupScan {
  int first, last;  // this thread's groups [first, last)
  Counts run;       // what they hold
  Counts before;    // what the groups before them hold

  // Every thread calls it; fills slot.total / slot.invalid.
  __device__ __forceinline__ void Run(const Operands& op, Slot& slot) {
    using Scan = cub::BlockScan<Counts, kThreads>;
    __shared__ typename Scan::TempStorage storage;
    const int per_thread = (op.groups + kThreads - 1) / kThreads;
    first = threadIdx.x * per_thread;
    last = min(first + per_thread, op.groups);
    run = Counts{0, 0, 0};
    for (int g = first; g < last; ++g) {
      const int size = op.group_sizes[g];
      run.rows += size;
      run.nonempty += size > 0;
      run.negative |= size < 0;
    }
    Counts all;
    Scan(storage).ExclusiveScan(run, before, Counts{0, 0, 0}, AddCounts(), all);
    if (threadIdx.x == 0) {
      slot.invalid = all.negative != 0 || all.rows > op.m;
      slot.total = slot.invalid ? 0 : static_cast<int>(all.rows);
    }
  }

  // Every thread calls it (after Run and a barrier, or after the previous slot's last barrier); on
  // return slot.group / offset / rows name the j-th non-empty group (group -1: there is none).
  __device__ __forceinline__ void NameSlot(const Operands& op, int j, Slot& slot) {
    if (threadIdx.x == 0) slot.group = -1;
    __syncthreads();
    if (before.nonempty <= j && j < before.nonempty + run.nonempty) {
      int index = before.nonempty;
      long long offset = before.rows;
      for (int g = first; g < last; ++g) {
        const int size = op.group_sizes[g];
        if (size > 0 && index++ == j) {
          slot.group = g;
          slot.offset = static_cast<int>(offset);
          slot.rows = size;
        }
        offset += size;
      }
    }
    __syncthreads();
  }
};

template <int kMTile, int kWarps, int kRowTiles, int kUnroll, int kRowWarps, class OutT>
__global__ void __launch_bounds__(kWarps * 32) GroupedStreamGemm(const Operands op) {
  constexpr int kSub = kMTile / 8;
  static_assert(kWarps % kRowWarps == 0, "every row group has the same number of K slices");
  constexpr int kKWarps = kWarps / kRowWarps;
  constexpr int kWarpRows = kTileRows * kRowTiles;
  constexpr int kRows = kWarpRows * kRowWarps;  // weight rows (output columns) per CTA
  constexpr int kThreads = kWarps * 32;
  __shared__ stream_gemm::Partials<kKWarps, kRowWarps, kRowTiles, kSub> partial;
  __shared__ Slot slot;

  GroupScan<kThreads> scan;
  scan.Run(op, slot);
  __syncthreads();
  const int col0 = blockIdx.x * kRows;
  const int cols = min(kRows, op.n - col0);
  OutT* out = static_cast<OutT*>(op.out);

  if (blockIdx.y == 0) {  // the tail of this CTA's columns
    const int first_row = slot.invalid ? 0 : slot.total;
    const OutT fill = stream_gemm::Convert<OutT>(slot.invalid ? NAN : 0.0f);
    for (long long o = threadIdx.x; o < static_cast<long long>(op.m - first_row) * cols; o += kThreads) {
      const int row = first_row + static_cast<int>(o / cols), col = col0 + static_cast<int>(o % cols);
      out[static_cast<size_t>(row) * op.n + col] = fill;
    }
  }
  if (slot.invalid) return;

  const int warp = threadIdx.x >> 5;
  const int row_warp = warp % kRowWarps, k_warp = warp / kRowWarps;
  const int n0 = col0 + row_warp * kWarpRows;  // this warp's first weight row within an expert
  const bool rows_in = n0 < op.n;  // else it streams (and masks) the expert's first rows
  for (int j = blockIdx.y;; j += gridDim.y) {  // this CTA's slots
    scan.NameSlot(op, j, slot);
    if (slot.group < 0) return;
    const uint8_t* w = op.b + (static_cast<size_t>(slot.group) * op.n + (rows_in ? n0 : 0)) * op.k;
    const float* col_scale = op.col_scale + static_cast<size_t>(slot.group) * op.n;
    for (int start = 0; start < slot.rows; start += kMTile) {
      const int row0 = slot.offset + start;
      float acc[kRowTiles][kSub][4];
      stream_gemm::StreamSlices<kMTile, kRowTiles, kUnroll, kKWarps>(
          w, rows_in ? op.n - n0 : 0, op.a + static_cast<size_t>(row0) * op.k, slot.rows - start, op.k, k_warp, acc);
      partial.Store(k_warp, row_warp, acc);
      __syncthreads();
      // Consecutive threads take consecutive columns, so the stores of one token row are contiguous.
      const int rows = min(kMTile, slot.rows - start);
      for (int o = threadIdx.x; o < kRows * kMTile; o += kThreads) {
        const int r = o % kRows, c = o / kRows;
        if (c >= rows || r >= cols) continue;
        const int row = row0 + c, col = col0 + r;
        const float token = op.row_scale ? op.row_scale[row] : 1.0f;
        out[static_cast<size_t>(row) * op.n + col] =
            stream_gemm::Convert<OutT>(token * (col_scale[col] * partial.Sum(r, c)));
      }
      __syncthreads();  // the partial sums and the slot are overwritten next
    }
  }
}

// One configuration: token rows per pass, warps per CTA, 16-row weight tiles per warp, steps per
// warp pass, and row groups of warps (see fp8_stream_gemm_kernel.cuh). It needs no workspace.
template <int kMTile, int kWarps, int kRowTiles, int kUnroll, int kRowWarps>
struct Config {
  static size_t WorkspaceBytes(const GroupedLaunchArgs&) { return 0; }

  static LaunchStatus Run(const GroupedLaunchArgs& p, void* /*workspace*/) {
    constexpr int kRows = kTileRows * kRowTiles * kRowWarps;
    if (p.k % 16 != 0 || p.n % 8 != 0) return LaunchStatus::kCannotImplement;
    if ((reinterpret_cast<uintptr_t>(p.a) | reinterpret_cast<uintptr_t>(p.b)) % 16 != 0) {
      return LaunchStatus::kCannotImplement;
    }
    // Slots: at most one per group that can be non-empty (min(G, M)), and no more than keep about
    // kCtasPerSm CTAs per SM in all: a CTA walks slots y, y + grid.y, ... (the non-empty groups are
    // device data, so a grid sized for every possible group would mostly start CTAs that only scan).
    constexpr int kCtasPerSm = 8;
    const int col_tiles = (p.n + kRows - 1) / kRows;
    const long long most = std::max<long long>(1, static_cast<long long>(kCtasPerSm) * std::max(p.sm_count, 1) /
                                                      col_tiles);
    const int slots = static_cast<int>(std::min<long long>({p.groups, p.m, most, 65535}));
    const dim3 grid(col_tiles, slots);
    if (slots < 1 || col_tiles > INT32_MAX) return LaunchStatus::kCannotImplement;
    const Operands op{static_cast<const uint8_t*>(p.a), static_cast<const uint8_t*>(p.b), p.group_sizes,
                      p.col_scale, p.row_scale, p.out, p.m, p.n, p.k, p.groups};
    if (p.out_bf16) {
      GroupedStreamGemm<kMTile, kWarps, kRowTiles, kUnroll, kRowWarps, __nv_bfloat16>
          <<<grid, kWarps * 32, 0, p.stream>>>(op);
    } else {
      GroupedStreamGemm<kMTile, kWarps, kRowTiles, kUnroll, kRowWarps, __half><<<grid, kWarps * 32, 0, p.stream>>>(op);
    }
    return cudaGetLastError() == cudaSuccess ? LaunchStatus::kOk : LaunchStatus::kRun;
  }
};

}  // namespace modelopt_jax::cuda::grouped_stream

#endif  // MODELOPT_JAX_FFI_CUDA_FP8_GROUPED_STREAM_KERNEL_CUH_
