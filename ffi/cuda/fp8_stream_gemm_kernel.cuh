// Weight-streaming FP8 GEMM for a few token rows (decode steps), the same op as the CUTLASS table:
//
//   out[m, n] = out_type( row_scale[m] * (col_scale[n] * sum_k a[m, k] * b[n, k]) + bias[n] )
//
// with alpha riding on a missing scale by the table's one rule (gemm_launch.h: MissingScaleValues).
//
// Why a kernel of its own: at M <= 16 the GEMM is one pass over the weight, and the CUTLASS
// configurations spend each CTA's life filling and draining a TMA pipeline around a handful of
// wgmma tiles, which holds them at 2-3.5 TB/s on 8B-sized layers. Here every warp streams its own
// slice of K straight from global memory into registers (16-byte loads, several steps in flight,
// L1 bypassed) and feeds `mma.sync` m16n8k32 e4m3 tensor-core instructions: 16 weight rows as the
// mma's M, up to 8 token rows as its N, accumulated in float32 (no FP8 fast accumulation). On sm_90
// ptxas expands each such mma into fp16 conversions of both operands and two HMMA.16816, so the
// conversions, not the tensor cores, are its arithmetic cost (bench/RESULTS.md, 2026-12-06).
//
// K order inside a step is permuted, identically for both operands (a dot product does not care):
// lane (g, q) loads 16 contiguous bytes of weight rows g and g + 8 and of token row g at byte
// 16 q of the step, and hands bytes 0-7 to the first mma of the step and bytes 8-15 to the second,
// in the register slots where the mma expects K = 4q..4q+3 and 16+4q..16+4q+3. A CTA holds kMTile
// token rows and 16-64 weight rows (tiles of 16 per warp, groups of warps side by side); the warps
// of a group split K and add their float32 partial sums in shared memory before the epilogue.
#ifndef MODELOPT_JAX_FFI_CUDA_FP8_STREAM_GEMM_KERNEL_CUH_
#define MODELOPT_JAX_FFI_CUDA_FP8_STREAM_GEMM_KERNEL_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "gemm_launch.h"

namespace modelopt_jax::cuda::stream_gemm {

constexpr int kTileRows = 16;  // weight rows (output features) per row tile: the mma's M
constexpr int kStepK = 64;     // K per warp per step: two m16n8k32 mmas

__device__ __forceinline__ void MmaE4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A weight load: read once per call, so it skips L1; L2 fetches the 256 bytes around it, which the
// same or the next warp reads next.
__device__ __forceinline__ uint4 LoadWeight(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// A token-row load: every CTA of the grid reads the same rows, so they stay cached.
__device__ __forceinline__ uint4 LoadToken(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

template <class OutT>
__device__ __forceinline__ OutT Convert(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 Convert<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half Convert<__half>(float v) { return __float2half_rn(v); }

struct Operands {
  const uint8_t* a;        // [M, K] e4m3fn, row-major
  const uint8_t* b;        // [N, K] e4m3fn, row-major
  const float* row_scale;  // [M] or null
  const float* col_scale;  // [N] or null
  const float* bias;       // [N] or null
  void* out;               // [M, N] of OutT
  MissingScales missing;   // what a null row_scale / col_scale stands for (alpha folded in)
  int m, n, k;
};

// One warp's share of a CTA tile: its partial sums over its K slices (k_warp of kKWarps: passes of
// kUnroll steps of 64 K, kKWarps passes apart) for kRowTiles tiles of 16 weight rows starting at `w`
// (the first `w_rows` of them real) and kMTile token rows starting at `x` (the first `x_rows` real).
// Rows past the real ones read as zeros: their loads re-read row 0 of `w` or `x`, which must be in
// bounds even where no row is real. Both operands are row-major with `k` bytes per row.
template <int kMTile, int kRowTiles, int kUnroll, int kKWarps>
__device__ __forceinline__ void StreamSlices(const uint8_t* w, int w_rows, const uint8_t* x, int x_rows, int k,
                                             int k_warp, float (&acc)[kRowTiles][kMTile / 8][4]) {
  static_assert(kMTile == 8 || kMTile == 16, "token rows per CTA: one or two mma column blocks");
  constexpr int kSub = kMTile / 8;
  constexpr int kChunkK = kStepK * kUnroll;  // contiguous bytes of each weight row per warp pass
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, q = lane & 3;

  // Weight row 8 h + g (h = 2 t for row tile t's upper half, 2 t + 1 for its lower) is this lane's
  // w_row[h]; token row 8 s + g its x_row[s].
  bool w_ok[2 * kRowTiles];
  const uint8_t* w_row[2 * kRowTiles];
#pragma unroll
  for (int h = 0; h < 2 * kRowTiles; ++h) {
    const int row = 8 * h + g;
    w_ok[h] = row < w_rows;
    w_row[h] = w + static_cast<size_t>(w_ok[h] ? row : 0) * k + 16 * q;
  }
  bool x_ok[kSub];
  const uint8_t* x_row[kSub];
#pragma unroll
  for (int s = 0; s < kSub; ++s) {
    const int row = 8 * s + g;
    x_ok[s] = row < x_rows;
    x_row[s] = x + static_cast<size_t>(x_ok[s] ? row : 0) * k + 16 * q;
  }

#pragma unroll
  for (int t = 0; t < kRowTiles; ++t) {
#pragma unroll
    for (int s = 0; s < kSub; ++s) acc[t][s][0] = acc[t][s][1] = acc[t][s][2] = acc[t][s][3] = 0.0f;
  }

  // One warp pass: kUnroll steps of every weight row and token row of the lane. Loads are
  // unconditional (a piece past K re-reads the row's first piece; rows past the real ones read the
  // first row) and masked to zeros when used, so they are straight-line code; the next pass's loads
  // are issued before this pass's mmas (registers double-buffered), so a warp always has a pass in flight.
  auto piece_in_k = [&](int k0, int u) { return k0 + u * kStepK + 16 * q < k; };  // K % 16 == 0
  struct Pass {
    uint4 w[kUnroll][2 * kRowTiles];
    uint4 x[kUnroll][kSub];
  };
  auto load = [&](int k0, Pass& pass) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int kk = piece_in_k(k0, u) ? k0 + u * kStepK : -16 * q;
#pragma unroll
      for (int h = 0; h < 2 * kRowTiles; ++h) pass.w[u][h] = LoadWeight(w_row[h] + kk);
#pragma unroll
      for (int s = 0; s < kSub; ++s) pass.x[u][s] = LoadToken(x_row[s] + kk);
    }
  };
  const uint4 zero = make_uint4(0, 0, 0, 0);
  constexpr int kStride = kKWarps * kChunkK;
  Pass cur;
  load(k_warp * kChunkK, cur);
  for (int k0 = k_warp * kChunkK; k0 < k; k0 += kStride) {
    Pass next;
    load(k0 + kStride < k ? k0 + kStride : k0, next);  // the last pass re-reads its own (cached) bytes
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const bool in = piece_in_k(k0, u);  // a 16-byte piece is wholly in or out
#pragma unroll
      for (int t = 0; t < kRowTiles; ++t) {
        const uint4 lo = in && w_ok[2 * t] ? cur.w[u][2 * t] : zero;
        const uint4 hi = in && w_ok[2 * t + 1] ? cur.w[u][2 * t + 1] : zero;
#pragma unroll
        for (int s = 0; s < kSub; ++s) {
          const uint4 xs = in && x_ok[s] ? cur.x[u][s] : zero;
          MmaE4m3(acc[t][s], lo.x, hi.x, lo.y, hi.y, xs.x, xs.y);
          MmaE4m3(acc[t][s], lo.z, hi.z, lo.w, hi.w, xs.z, xs.w);
        }
      }
    }
    cur = next;
  }
}

// A CTA's float32 partial sums in shared memory: kKWarps K slices of kRowWarps row groups, each a
// warp's kRowTiles x kSub m16n8 accumulator fragments.
template <int kKWarps, int kRowWarps, int kRowTiles, int kSub>
struct Partials {
  static constexpr int kWarpRows = kTileRows * kRowTiles;  // weight rows per warp
  float v[kKWarps][kRowWarps][kRowTiles][kSub][32][4];

  __device__ __forceinline__ void Store(int k_warp, int row_warp, const float (&acc)[kRowTiles][kSub][4]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < kRowTiles; ++t) {
#pragma unroll
      for (int s = 0; s < kSub; ++s) {
#pragma unroll
        for (int i = 0; i < 4; ++i) v[k_warp][row_warp][t][s][lane][i] = acc[t][s][i];
      }
    }
  }

  // The sum over K of (token c, weight row r) of the CTA. It sits in row group r / kWarpRows, that
  // warp's row tile (r % kWarpRows) / 16, column block c / 8, lane (r % 8) * 4 + (c % 8) / 2,
  // accumulator ((r % 16) / 8) * 2 + c % 2 (the m16n8 D fragment), once per K slice.
  __device__ __forceinline__ float Sum(int r, int c) const {
    const int rw = r / kWarpRows, t = (r % kWarpRows) / kTileRows, s = c / 8, cc = c % 8;
    const int src_lane = (r % 8) * 4 + cc / 2, src_acc = ((r % kTileRows) / 8) * 2 + cc % 2;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kKWarps; ++w) sum += v[w][rw][t][s][src_lane][src_acc];
    return sum;
  }
};

// kRowTiles tiles of 16 weight rows per warp and kRowWarps groups of warps side by side along the
// rows (more weight rows per token-row load: every CTA reads the token rows; the warps of one K
// slice in different row groups read the same token bytes, the first from L2, the rest from L1);
// the kWarps / kRowWarps warps of a row group split K; kUnroll steps of 64 K per warp pass.
template <int kMTile, int kWarps, int kRowTiles, int kUnroll, int kRowWarps, class OutT>
__global__ void __launch_bounds__(kWarps * 32) StreamGemm(const Operands op) {
  constexpr int kSub = kMTile / 8;
  static_assert(kWarps % kRowWarps == 0, "every row group has the same number of K slices");
  constexpr int kKWarps = kWarps / kRowWarps;          // warps splitting K within a row group
  constexpr int kWarpRows = kTileRows * kRowTiles;     // weight rows per warp
  constexpr int kRows = kWarpRows * kRowWarps;         // weight rows per CTA
  __shared__ Partials<kKWarps, kRowWarps, kRowTiles, kSub> partial;

  const int warp = threadIdx.x >> 5;
  const int row_warp = warp % kRowWarps, k_warp = warp / kRowWarps;
  const int n0 = blockIdx.y * kRows + row_warp * kWarpRows, m0 = blockIdx.x * kMTile;  // this warp's rows
  // A warp whose rows all lie past N streams (and masks) the weight's first rows: loads stay in bounds.
  const bool rows_in = n0 < op.n;
  float acc[kRowTiles][kSub][4];
  StreamSlices<kMTile, kRowTiles, kUnroll, kKWarps>(op.b + static_cast<size_t>(rows_in ? n0 : 0) * op.k,
                                                    rows_in ? op.n - n0 : 0, op.a + static_cast<size_t>(m0) * op.k,
                                                    op.m - m0, op.k, k_warp, acc);
  partial.Store(k_warp, row_warp, acc);
  __syncthreads();

  // Consecutive threads take consecutive weight rows, so the stores of one token row are contiguous.
  OutT* out = static_cast<OutT*>(op.out);
  for (int o = threadIdx.x; o < kRows * kMTile; o += kWarps * 32) {
    const int r = o % kRows, c = o / kRows;
    const int row = m0 + c, col = blockIdx.y * kRows + r;
    if (row >= op.m || col >= op.n) continue;
    const float token = op.row_scale ? op.row_scale[row] : op.missing.token;
    const float channel = op.col_scale ? op.col_scale[col] : op.missing.channel;
    float v = token * (channel * partial.Sum(r, c));
    if (op.bias) v += op.bias[col];
    out[static_cast<size_t>(row) * op.n + col] = Convert<OutT>(v);
  }
}

// One configuration: token rows per CTA, warps per CTA, 16-row weight tiles per warp, steps per
// warp pass, and row groups of warps (see StreamGemm).
template <int kMTile, int kWarps, int kRowTiles, int kUnroll, int kRowWarps = 1>
LaunchStatus Run(const LaunchArgs& p) {
  constexpr int kRows = kTileRows * kRowTiles * kRowWarps;
  if (p.k % 16 != 0 || p.n % 8 != 0) return LaunchStatus::kCannotImplement;
  if ((reinterpret_cast<uintptr_t>(p.a) | reinterpret_cast<uintptr_t>(p.b)) % 16 != 0) {
    return LaunchStatus::kCannotImplement;
  }
  // Token-row tiles vary fastest, so the CTAs that read the same weight rows run side by side and
  // all but the first find them in L2.
  const dim3 grid((p.m + kMTile - 1) / kMTile, (p.n + kRows - 1) / kRows);
  if (grid.y > 65535) return LaunchStatus::kCannotImplement;
  const Operands op{static_cast<const uint8_t*>(p.a), static_cast<const uint8_t*>(p.b), p.row_scale, p.col_scale,
                    p.bias, p.out, MissingScaleValues(p), p.m, p.n, p.k};
  if (p.out_bf16) {
    StreamGemm<kMTile, kWarps, kRowTiles, kUnroll, kRowWarps, __nv_bfloat16><<<grid, kWarps * 32, 0, p.stream>>>(op);
  } else {
    StreamGemm<kMTile, kWarps, kRowTiles, kUnroll, kRowWarps, __half><<<grid, kWarps * 32, 0, p.stream>>>(op);
  }
  return cudaGetLastError() == cudaSuccess ? LaunchStatus::kOk : LaunchStatus::kRun;
}

}  // namespace modelopt_jax::cuda::stream_gemm

#endif  // MODELOPT_JAX_FFI_CUDA_FP8_STREAM_GEMM_KERNEL_CUH_
