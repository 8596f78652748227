// XLA FFI handler of the modelopt_paged_decode op: one query token per sequence attends over that
// sequence's pages of a paged KV cache, reading only the pages in use (FlashDecoding-style).
//
// Why a kernel: XLA's version gathers every row's block table into a dense [B, pages*page, kv, d]
// copy and then runs two einsums over it -- three passes over the KV bytes and padding to the
// longest row. Here each CTA streams its share of one (sequence, kv head)'s pages once, scores all
// the GQA query heads of that kv head against each key as it arrives (online softmax), and, when
// the context is split across CTAs for parallelism, a second small kernel merges the partials.
//
// Layout (the engine's pool, modelopt_jax.kv_cache.PagedKVCache): keys/values [slots, kv_heads, d],
// slot = block_table[t, p // page] * page + p % page (the engine expands its per-sequence tables to
// one row per token). FP8 pages hold e4m3 codes; a value is code * scale, exactly: the key scale is
// folded into q and the value scale into the output. (XLA's path rounds code * scale to the compute
// dtype first, a difference within that dtype's rounding.) q is float32 [T, heads, d]; the output
// float32 [T, heads, d]. Token t attends over positions 0 .. lengths[t] - 1 of its row.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "attention_mma.cuh"
#include "xla/ffi/api/ffi.h"

namespace modelopt_jax::cuda {
namespace {

namespace ffi = xla::ffi;

constexpr int kWarps = 4;
constexpr int kChunkPages = 256;  // page ids a CTA stages in shared memory at a time
constexpr float kFloor = -1e30f;  // running max's start: finite, so exp(floor - floor) is 1, never NaN
constexpr int kStagedKernel = 1, kMmaKernel = 2;  // the "variant" attribute (0 was a register kernel, removed)
constexpr int kBalancedKernel = 3;                 // PagedDecodeBalancedKernel: its own FFI op, no attribute

struct Params {
  const float* q;          // [T, H, D]
  const void* k;           // [slots, KV, D]
  const void* v;
  const int32_t* tables;   // [T, W]
  const int32_t* lengths;  // [T]
  float* out;              // [T, H, D]
  float* part_o;           // [T, KV, S, G, D]
  float* part_ml;          // [T, KV, S, G, 2]
  int kv_heads, table_width, page, page_shift, splits;  // page_shift: log2(page), or -1
  float q_scale, v_scale;  // softmax scale (x FP8 key scale); FP8 value scale (1 otherwise)
  int variant;             // kStagedKernel or kMmaKernel
  // The balanced kernel only: T, prefix[t] = kv_heads x the 64-key tiles of tokens before t
  // ([T + 1]), and the grid's CTAs (part_o [ctas, 2, G, D], part_ml [ctas, 2, G, 2]).
  int tokens;
  const int32_t* prefix;
  int ctas;
};

// How a lane loads and converts its slice of a key/value row: kElems elements in one load.
template <typename T, int kElems>
struct Row;
template <int kElems>
struct Row<__nv_bfloat16, kElems> {
  static_assert(kElems == 8);
  using Raw = uint4;
  static __device__ __forceinline__ void to_float(const Raw& r, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&r);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 x = __bfloat1622float2(h[i]);
      f[2 * i] = x.x, f[2 * i + 1] = x.y;
    }
  }
};
template <int kElems>
struct Row<__half, kElems> {
  static_assert(kElems == 8);
  using Raw = uint4;
  static __device__ __forceinline__ void to_float(const Raw& r, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(&r);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 x = __half22float2(h[i]);
      f[2 * i] = x.x, f[2 * i + 1] = x.y;
    }
  }
};
template <int kElems>
struct Row<__nv_fp8_e4m3, kElems> {
  static_assert(kElems == 8 || kElems == 16);
  using Raw = std::conditional_t<kElems == 16, uint4, uint2>;
  static __device__ __forceinline__ void to_float(const Raw& r, float* f) {
    const __nv_fp8x2_storage_t* c = reinterpret_cast<const __nv_fp8x2_storage_t*>(&r);
#pragma unroll
    for (int i = 0; i < kElems / 2; ++i) {
      __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(c[i], __NV_E4M3);  // exact: e4m3 is a subset of f16
      float2 x = __half22float2(*reinterpret_cast<__half2*>(&h));
      f[2 * i] = x.x, f[2 * i + 1] = x.y;
    }
  }
};

// FP8 rows: 16 codes per lane (one 16-byte load) while the registers allow it.
template <typename T, int G>
__host__ __device__ constexpr int ElemsPerLane() { return sizeof(T) == 1 && G <= 4 ? 16 : 8; }
template <int G>
__host__ __device__ constexpr int UnrollFor() { return G <= 4 ? 8 : 4; }

// The staged kernel (CUDA cores; it serves float32 compute, which the MMA kernel below would round
// to bf16). grid (splits, KV, T), kWarps warps. Lanes come in groups of kLanes (= D / kElems) that
// together hold one token's row; a warp covers 32 / kLanes tokens per load and issues kUnroll such
// loads of keys and values before using them; softmax state is rescaled once per kUnroll tokens.
// Each warp streams its K/V tiles through shared memory with cp.async, kStages tiles deep, so the
// bytes in flight do not sit in registers (a version that loaded into registers waited on each
// tile before computing: 2.3 TB/s of bf16 pages on the H200 at batch 64, against 2.4-2.8 staged).
// Each lane copies exactly the bytes it later reads back, so a lane's own cp.async.wait_group is
// the only synchronisation a tile needs.
constexpr int kStages = 3;

template <int kBytes>
__device__ __forceinline__ void CopyAsync(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(gmem), "n"(kBytes) : "memory");
  }
}
__device__ __forceinline__ void CommitAsync() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void WaitAsync() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory"); }

template <typename T, int D, int G>
struct Staging {
  static constexpr int kElems = ElemsPerLane<T, G>();
  static constexpr int kUnroll = UnrollFor<G>();
  static constexpr int kLanes = D / kElems;
  static constexpr int kTokensPerLoad = 32 / kLanes;
  static constexpr int kTile = kTokensPerLoad * kUnroll;              // tokens per warp tile
  static constexpr int kTileBytes = kTile * D * (int)sizeof(T);       // K (or V) bytes of a tile
  static constexpr int kGroups = kWarps * kTokensPerLoad;
  static constexpr int kPipeBytes = kWarps * kStages * 2 * kTileBytes;
  static constexpr int kMergeBytes = kGroups * G * D * (int)sizeof(float);
  static constexpr int kSmemBytes = kPipeBytes > kMergeBytes ? kPipeBytes : kMergeBytes;
};

template <typename T, int D, int G>
__global__ void __launch_bounds__(kWarps * 32, 2) PagedDecodeStagedKernel(Params p) {
  using S = Staging<T, D, G>;
  constexpr int kElems = S::kElems, kUnroll = S::kUnroll, kLanes = S::kLanes;
  constexpr int kTokensPerLoad = S::kTokensPerLoad, kTile = S::kTile, kGroups = S::kGroups;
  using R = Row<T, kElems>;
  using Raw = typename R::Raw;
  extern __shared__ __align__(16) unsigned char smem[];

  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane / kLanes, col = (lane % kLanes) * kElems;
  const int group = warp * kTokensPerLoad + sub;
  const int H = p.kv_heads * G;

  const int length = p.lengths[b];
  const int seq_pages = (length + p.page - 1) / p.page;
  const int per_split = (seq_pages + p.splits - 1) / p.splits;
  const int page_begin = split * per_split;
  const int page_end = min(seq_pages, page_begin + per_split);

  float q[G][kElems];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float* qg = p.q + ((size_t)b * H + kvh * G + g) * D + col;
#pragma unroll
    for (int i = 0; i < kElems; ++i) q[g][i] = qg[i] * p.q_scale;
  }
  float m[G], l[G], acc[G][kElems];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = kFloor, l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < kElems; ++i) acc[g][i] = 0.f;
  }

  const T* kbase = static_cast<const T*>(p.k) + (size_t)kvh * D + col;
  const T* vbase = static_cast<const T*>(p.v) + (size_t)kvh * D + col;
  const size_t row_stride = (size_t)p.kv_heads * D;
  const int32_t* table = p.tables + (size_t)b * p.table_width;
  // This warp's stages: [kStages][K, V][kTile * D] elements; a lane's slice of token u * kTokensPerLoad
  // + sub is element (u * kTokensPerLoad + sub) * D + col of its stage's K (or V) tile.
  unsigned char* pipe = smem + (size_t)warp * kStages * 2 * S::kTileBytes;
  const int lane_offset = (sub * D + col) * (int)sizeof(T);
  constexpr int kLoadBytes = kTokensPerLoad * D * (int)sizeof(T);  // one u's rows of the tile
  __shared__ int32_t sm_pages[kChunkPages];

  for (int chunk = page_begin; chunk < page_end; chunk += kChunkPages) {
    const int chunk_pages = min(kChunkPages, page_end - chunk);
    __syncthreads();
    for (int i = threadIdx.x; i < chunk_pages; i += kWarps * 32) sm_pages[i] = table[chunk + i];
    __syncthreads();
    const int tok_begin = chunk * p.page;
    const int tok_end = min(length, (chunk + chunk_pages) * p.page);
    const int first = tok_begin + warp * kTile;  // this warp's tiles start here, kWarps * kTile apart
    const int tiles = first < tok_end ? (tok_end - first + kWarps * kTile - 1) / (kWarps * kTile) : 0;

    auto issue = [&](int tile) {
      if (tile < tiles) {
        unsigned char* stage = pipe + (tile % kStages) * 2 * S::kTileBytes + lane_offset;
        const int base = first + tile * kWarps * kTile;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int t = base + u * kTokensPerLoad + sub;
          if (t < tok_end) {
            const int rel = t - tok_begin;
            const int pg = p.page_shift >= 0 ? rel >> p.page_shift : rel / p.page;
            const size_t slot = (size_t)sm_pages[pg] * p.page + (rel - pg * p.page);
            CopyAsync<sizeof(Raw)>(stage + u * kLoadBytes, kbase + slot * row_stride);
            CopyAsync<sizeof(Raw)>(stage + S::kTileBytes + u * kLoadBytes, vbase + slot * row_stride);
          }
        }
      }
      CommitAsync();  // an empty group past the last tile keeps the wait count uniform
    };

#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) issue(s);
    for (int tile = 0; tile < tiles; ++tile) {
      issue(tile + kStages - 1);
      WaitAsync<kStages - 1>();
      const unsigned char* stage = pipe + (tile % kStages) * 2 * S::kTileBytes + lane_offset;
      const int base = first + tile * kWarps * kTile;
      float s[kUnroll][G];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const bool valid = base + u * kTokensPerLoad + sub < tok_end;
        float kf[kElems];
        R::to_float(*reinterpret_cast<const Raw*>(stage + u * kLoadBytes), kf);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          float x = 0.f;
#pragma unroll
          for (int i = 0; i < kElems; ++i) x = fmaf(q[g][i], kf[i], x);
#pragma unroll
          for (int off = kLanes / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
          s[u][g] = valid ? x : -INFINITY;
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float mx = m[g];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) mx = fmaxf(mx, s[u][g]);
        const float corr = __expf(m[g] - mx);
        m[g] = mx;
        l[g] *= corr;
#pragma unroll
        for (int i = 0; i < kElems; ++i) acc[g][i] *= corr;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) s[u][g] = __expf(s[u][g] - mx), l[g] += s[u][g];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base + u * kTokensPerLoad + sub >= tok_end) continue;  // weight 0; its bytes were never copied
        float vf[kElems];
        R::to_float(*reinterpret_cast<const Raw*>(stage + S::kTileBytes + u * kLoadBytes), vf);
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
          for (int i = 0; i < kElems; ++i) acc[g][i] = fmaf(s[u][g], vf[i], acc[g][i]);
        }
      }
    }
    WaitAsync<0>();  // only empty groups remain; nothing may land after the pipeline is reused
  }

  // Merge the CTA's kGroups states -- each group's (m, l) and its lanes' slices of acc -- in the
  // drained pipeline's memory.
  __shared__ float sm_m[kGroups][G], sm_l[kGroups][G];
  float(*sm_acc)[G][D] = reinterpret_cast<float(*)[G][D]>(smem);
  __syncthreads();
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane % kLanes == 0) sm_m[group][g] = m[g], sm_l[group][g] = l[g];
#pragma unroll
    for (int i = 0; i < kElems; ++i) sm_acc[group][g][col + i] = acc[g][i];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * D; idx += kWarps * 32) {
    const int g = idx / D, d = idx % D;
    float mx = kFloor;
    for (int j = 0; j < kGroups; ++j) mx = fmaxf(mx, sm_m[j][g]);
    float lsum = 0.f, o = 0.f;
    for (int j = 0; j < kGroups; ++j) {
      const float c = __expf(sm_m[j][g] - mx);
      lsum += sm_l[j][g] * c;
      o += sm_acc[j][g][d] * c;
    }
    o *= p.v_scale;
    if (p.splits == 1) {
      p.out[((size_t)b * H + kvh * G + g) * D + d] = lsum > 0.f ? o / lsum : 0.f;
    } else {
      const size_t part = (((size_t)b * p.kv_heads + kvh) * p.splits + split) * G + g;
      p.part_o[part * D + d] = o;
      if (d == 0) p.part_ml[part * 2] = lsum > 0.f ? mx : -INFINITY, p.part_ml[part * 2 + 1] = lsum;
    }
  }
}

// The MMA kernel: a token's G query heads are the rows of m16n8k16 tensor-core MMAs (rows G..15
// are zeros), so scoring a key and adding its value cost a share of two MMAs instead of G dot
// products, shuffle reductions and FMAs on the CUDA cores -- the instruction stream that holds the
// staged kernel near 2.4 TB/s on the H200 (about 50 warp instructions per (token, kv head) at G=4).
// All 128 threads stream 64-key tiles of K and V into shared memory with cp.async, kMmaStages deep
// (positions past the split's end are zero-filled: a value must not be NaN where P is 0); warp w
// scores keys 16w .. 16w + 15 of each tile and keeps its own online-softmax state, and the warps'
// states merge at the end as the other kernels merge theirs. Exponentials run in base 2 (the
// scores carry log2(e)); the split partials are written in natural units for MergeSplitsKernel.
// The MMAs take bf16 operands (f16 for f16 pages): the engine runs this kernel for bf16 compute.
constexpr int kMmaKeys = 64;
// (K, V) tile stages per CTA (MODELOPT_JAX_DECODE_STAGES overrides it at build time, for A/B runs of
// bench/attention.py). Two measured best on the H200 (2026-12-02, GPU us of one 8B layer): 64 x 1024
// bf16 83 / 82 / 132 for 2 / 3 / 4 stages, 256 x 1024 274 / 305 / 508 -- more stages cost
// resident CTAs (70 KB of shared memory per CTA at two) without reading faster.
#ifndef MODELOPT_JAX_DECODE_STAGES
#define MODELOPT_JAX_DECODE_STAGES 2
#endif
constexpr int kMmaStages = MODELOPT_JAX_DECODE_STAGES;
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

// The balanced kernel's view of a token's keys: its length, never past its block-table row (so a
// length the table cannot hold reads no page id beyond the row), and its 64-key tiles. The jax
// wrapper computes prefix from the same clamp (modelopt_jax.ops.attention.balanced_prefix).
__device__ __forceinline__ int BalancedLength(const Params& p, int t) {
  return max(0, min(p.lengths[t], p.table_width * p.page));
}
__device__ __forceinline__ int BalancedTiles(int length) { return (length + kMmaKeys - 1) / kMmaKeys; }

template <typename T, int D, int G>
struct MmaTiles {
  static constexpr int kRowBytes = D * (int)sizeof(T);
  static constexpr int kStride = kRowBytes + 16;  // padded rows: conflict-free fragment loads
  static constexpr int kTileBytes = kMmaKeys * kStride;
  static constexpr int kPipeBytes = kMmaStages * 2 * kTileBytes;  // kMmaStages stages of (K, V)
  static constexpr int kMergeBytes = kWarps * G * D * (int)sizeof(float);
  static constexpr int kSmemBytes = kPipeBytes > kMergeBytes ? kPipeBytes : kMergeBytes;
};

// One (token, kv head)'s online-softmax state in the MMA decode kernels, and the steps both of them
// take: load the token's G query rows, issue a 64-key tile's copies, fold a landed tile in, and merge
// the 4 warps' states into the result.
template <typename T, int D, int G>
struct MmaDecodeState {
  using M = attention::Mma<T>;
  using F = attention::Fragments<T>;
  using S = MmaTiles<T, D, G>;
  static_assert(G <= 8, "the heads of a token fill MMA rows 0..7");

  uint32_t qa[D / 16][2];
  float o[D / 8][2];
  float m, l;  // row gq's running max (base 2) and this lane's share of its sum

  // Q as A fragments: row gq's columns (c, c + 1) and (c + 8, c + 9) of each 16-column k-step;
  // rows 8..15 (a1, a3) are zeros. q_rows: the G query rows of this (token, kv head).
  __device__ __forceinline__ void Start(const float* q_rows, int gq, int tq) {
    const float* qg = gq < G ? q_rows + (size_t)gq * D : nullptr;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int c = kk * 16 + 2 * tq;
      const float2 x = qg ? *reinterpret_cast<const float2*>(qg + c) : make_float2(0.f, 0.f);
      const float2 y = qg ? *reinterpret_cast<const float2*>(qg + c + 8) : make_float2(0.f, 0.f);
      qa[kk][0] = M::pack(x.x, x.y), qa[kk][1] = M::pack(y.x, y.y);
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = 0.f;
    m = kFloor, l = 0.f;
  }

  // All 128 threads copy the keys and values at positions pos0 .. pos0 + 63 of one sequence (its
  // block-table row `table`) into `stage` ([K tile, V tile]); positions >= end are zero-filled (a
  // value must not be NaN where P is 0). k_head / v_head: the pools offset to this kv head's row.
  static __device__ __forceinline__ void Issue(unsigned char* stage, const unsigned char* k_head,
                                               const unsigned char* v_head, size_t slot_bytes,
                                               const int32_t* table, const Params& p, int pos0, int end) {
    constexpr int kChunks = S::kRowBytes / 16;
    for (int c = threadIdx.x; c < kMmaKeys * kChunks; c += kWarps * 32) {
      const int key = c / kChunks, part = c % kChunks;
      const int pos = pos0 + key;
      const bool valid = pos < end;
      size_t offset = part * 16;
      if (valid) {
        const int pg = p.page_shift >= 0 ? pos >> p.page_shift : pos / p.page;
        offset += ((size_t)table[pg] * p.page + (pos - pg * p.page)) * slot_bytes;
      }
      attention::CopyAsync16(stage + key * S::kStride + part * 16, k_head + offset, valid);
      attention::CopyAsync16(stage + S::kTileBytes + key * S::kStride + part * 16, v_head + offset, valid);
    }
  }

  // Warp w scores keys 16w .. 16w + 15 of the landed stage (positions pos0 + ..., masked from end
  // on) and folds them into its state. Exponentials run in base 2: `scale` carries log2(e).
  __device__ __forceinline__ void Consume(const unsigned char* ks, int warp, int gq, int tq, int pos0, int end,
                                          float scale) {
    const unsigned char* vs = ks + S::kTileBytes;
    const int key0 = warp * 16;
    float sc[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t a[4] = {qa[kk][0], 0u, qa[kk][1], 0u};
        const int row = key0 + j * 8 + gq, col = kk * 16 + 2 * tq;
        M::run(sc[j], a, F::KeyPair(ks, S::kStride, row, col), F::KeyPair(ks, S::kStride, row, col + 8));
      }
    }
    const int first = pos0 + key0 + 2 * tq;  // position of sc[0][0]
    float mx = kFloor;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        sc[j][e] = first + j * 8 + e < end ? sc[j][e] * scale : -INFINITY;
        mx = fmaxf(mx, sc[j][e]);
      }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float next = fmaxf(m, mx), corr = exp2f(m - next);
    m = next;
    l *= corr;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] *= corr, o[n][1] *= corr;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      sc[j][0] = exp2f(sc[j][0] - m), sc[j][1] = exp2f(sc[j][1] - m);
      l += sc[j][0] + sc[j][1];
    }
    // O += P V over the warp's 16 keys: one k-step; P's A fragment is the two score n-tiles.
    const uint32_t pa[4] = {M::pack(sc[0][0], sc[0][1]), 0u, M::pack(sc[1][0], sc[1][1]), 0u};
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      float c[4] = {o[n][0], o[n][1], 0.f, 0.f};
      const int row = key0 + 2 * tq, col = n * 8 + gq;
      M::run(c, pa, F::ValuePair(vs, S::kStride, row, col), F::ValuePair(vs, S::kStride, row + 8, col));
      o[n][0] = c[0], o[n][1] = c[1];
    }
  }

  // Merges the 4 warps' states (rows gq < G) through `scratch` (kWarps * G * D floats of shared
  // memory no thread touches from the caller's barrier before this call to the barrier that ends
  // it) and hands each (g, d) to write(g, d, o, max in natural units, sum), o not yet divided.
  template <typename Write>
  __device__ __forceinline__ void Finish(float* scratch, float (*sm_m)[G], float (*sm_l)[G], int warp, int gq,
                                         int tq, Write write) {
    static_assert(kWarps * G * D * sizeof(float) <= 2 * S::kTileBytes, "the merge fits in one (K, V) stage");
    float lsum_lane = l;
    lsum_lane += __shfl_xor_sync(0xffffffffu, lsum_lane, 1);
    lsum_lane += __shfl_xor_sync(0xffffffffu, lsum_lane, 2);
    if (gq < G) {
      if (tq == 0) sm_m[warp][gq] = m, sm_l[warp][gq] = lsum_lane;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        float* dst = scratch + ((size_t)warp * G + gq) * D + n * 8 + 2 * tq;
        dst[0] = o[n][0], dst[1] = o[n][1];
      }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * D; idx += kWarps * 32) {
      const int g = idx / D, d = idx % D;
      float mx = kFloor;
      for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sm_m[w][g]);
      float lsum = 0.f, acc = 0.f;
      for (int w = 0; w < kWarps; ++w) {
        const float c = exp2f(sm_m[w][g] - mx);
        lsum += sm_l[w][g] * c;
        acc += scratch[((size_t)w * G + g) * D + d] * c;
      }
      write(g, d, acc, mx * kLn2, lsum);
    }
    __syncthreads();
  }
};

// Writes one (g, d) of a merged state: the normalised output, or a partial (o, m, l) for a merge kernel.
__device__ __forceinline__ void WriteFinal(float* out, float v_scale, float acc, float lsum) {
  *out = lsum > 0.f ? acc * v_scale / lsum : 0.f;
}
__device__ __forceinline__ void WritePartial(float* part_o, float* part_ml, bool first_d, float v_scale, float acc,
                                             float mx, float lsum) {
  *part_o = acc * v_scale;
  if (first_d) part_ml[0] = lsum > 0.f ? mx : -INFINITY, part_ml[1] = lsum;
}

// The MMA kernel: a token's G query heads are the rows of m16n8k16 tensor-core MMAs (rows G..15
// are zeros), so scoring a key and adding its value cost a share of two MMAs instead of G dot
// products, shuffle reductions and FMAs on the CUDA cores -- the instruction stream that holds the
// staged kernel near 2.4 TB/s on the H200 (about 50 warp instructions per (token, kv head) at G=4).
// grid (splits, KV, T): all 128 threads stream 64-key tiles of K and V of their split into shared
// memory with cp.async, kMmaStages deep; warp w scores keys 16w .. 16w + 15 of each tile and keeps
// its own online-softmax state, and the warps' states merge at the end. The MMAs take bf16
// operands (f16 for f16 pages): the engine runs this kernel for bf16 compute.
template <typename T, int D, int G>
__global__ void __launch_bounds__(kWarps * 32) PagedDecodeMmaKernel(Params p) {
  using State = MmaDecodeState<T, D, G>;
  using S = MmaTiles<T, D, G>;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float sm_m[kWarps][G], sm_l[kWarps][G];

  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gq = lane / 4, tq = lane % 4;  // fragment row (= head, where < G) and column pair
  const int H = p.kv_heads * G;

  const int length = p.lengths[b];
  const int seq_pages = (length + p.page - 1) / p.page;
  const int per_split = (seq_pages + p.splits - 1) / p.splits;
  const int page_begin = split * per_split;
  const int page_end = min(seq_pages, page_begin + per_split);
  const int tok_begin = page_begin * p.page;
  const int tok_end = min(length, page_end * p.page);
  const int tiles = tok_end > tok_begin ? (tok_end - tok_begin + kMmaKeys - 1) / kMmaKeys : 0;

  State st;
  st.Start(p.q + ((size_t)b * H + kvh * G) * D, gq, tq);
  const float scale = p.q_scale * kLog2e;
  const unsigned char* k_head = static_cast<const unsigned char*>(p.k) + (size_t)kvh * S::kRowBytes;
  const unsigned char* v_head = static_cast<const unsigned char*>(p.v) + (size_t)kvh * S::kRowBytes;
  const size_t slot_bytes = (size_t)p.kv_heads * S::kRowBytes;
  const int32_t* table = p.tables + (size_t)b * p.table_width;
  auto issue = [&](int tile) {
    if (tile < tiles) {
      State::Issue(smem + (tile % kMmaStages) * 2 * S::kTileBytes, k_head, v_head, slot_bytes, table, p,
                   tok_begin + tile * kMmaKeys, tok_end);
    }
    attention::CommitAsync();  // an empty group past the last tile keeps the wait count uniform
  };

#pragma unroll
  for (int s = 0; s + 1 < kMmaStages; ++s) issue(s);
  for (int tile = 0; tile < tiles; ++tile) {
    issue(tile + kMmaStages - 1);
    attention::WaitAsync<kMmaStages - 1>();  // this thread's copies of `tile` have landed...
    __syncthreads();                          // ...and everyone's
    st.Consume(smem + (tile % kMmaStages) * 2 * S::kTileBytes, warp, gq, tq, tok_begin + tile * kMmaKeys, tok_end,
               scale);
    __syncthreads();  // the stage is read: the next issue may overwrite it
  }
  attention::WaitAsync<0>();  // only empty groups remain

  float* out = p.out + ((size_t)b * H + kvh * G) * D;
  const size_t part = (((size_t)b * p.kv_heads + kvh) * p.splits + split) * G;
  st.Finish(reinterpret_cast<float*>(smem), sm_m, sm_l, warp, gq, tq,
            [&](int g, int d, float acc, float mx, float lsum) {
              if (p.splits == 1) {
                WriteFinal(out + g * D + d, p.v_scale, acc, lsum);
              } else {
                WritePartial(p.part_o + (part + g) * D + d, p.part_ml + (part + g) * 2, d == 0, p.v_scale, acc, mx,
                             lsum);
              }
            });
}

// The work-balanced MMA kernel. The unit of work is one 64-key tile of one (token, kv head); units
// are numbered token-major, then kv head, then tile (prefix[t] = kv_heads x the tiles of tokens
// before t), and CTA c of the grid's `ctas` takes units [c U / ctas, (c + 1) U / ctas) of the U in
// all -- an equal share whatever the lengths, with the grid sized to the CTAs the GPU holds at once,
// so no CTA waits for a second wave and none idles while others finish long rows (the per-sequence
// split of PagedDecodeMmaKernel left 116 of 512 CTAs to a second wave at 64 x 1024 on the H200).
// One cp.async pipeline runs through all of a CTA's units, across (token, kv head) boundaries; a
// state whose units all fall in this CTA is written out directly, one cut by a CTA boundary as a
// partial (slot 0: the CTA's first state, slot 1: its last) that MergeBalancedKernel combines.
struct UnitCursor {
  int t, h, j, tiles, length;  // token, kv head, tile of that (token, kv head), its tiles and keys

  __device__ __forceinline__ void Load(const Params& p, int token) {
    t = token;
    length = token < p.tokens ? BalancedLength(p, token) : 0;
    tiles = BalancedTiles(length);
  }
  // The unit `unit` (< prefix[tokens]): token t holds units prefix[t] .. prefix[t + 1] - 1. The
  // search runs over `staged`, a shared-memory copy of prefix[0 .. staged_count) (its first
  // entries, where all of prefix does not fit), then global memory: each step of it in global
  // memory is a dependent round trip before the CTA's first copy can issue.
  __device__ __forceinline__ void Seek(const Params& p, const int32_t* staged, int staged_count, int unit) {
    int lo = 0, hi = p.tokens;  // prefix[lo] <= unit < prefix[hi]
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if ((mid < staged_count ? staged[mid] : p.prefix[mid]) <= unit) lo = mid; else hi = mid;
    }
    Load(p, lo);
    const int offset = unit - (lo < staged_count ? staged[lo] : p.prefix[lo]);
    h = offset / tiles, j = offset % tiles;
  }
  __device__ __forceinline__ void Next(const Params& p) {
    if (++j < tiles) return;
    j = 0;
    if (++h < p.kv_heads) return;
    h = 0;
    do Load(p, t + 1); while (tiles == 0 && t < p.tokens);
  }
};

template <typename T, int D, int G>
__global__ void __launch_bounds__(kWarps * 32) PagedDecodeBalancedKernel(Params p) {
  using State = MmaDecodeState<T, D, G>;
  using S = MmaTiles<T, D, G>;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float sm_m[kWarps][G], sm_l[kWarps][G];

  const long long units = p.prefix[p.tokens];
  const int begin = (int)(blockIdx.x * units / p.ctas), end = (int)((blockIdx.x + 1) * units / p.ctas);
  if (begin >= end) return;
  const int n = end - begin;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gq = lane / 4, tq = lane % 4;
  const int H = p.kv_heads * G;
  const unsigned char* k_pool = static_cast<const unsigned char*>(p.k);
  const unsigned char* v_pool = static_cast<const unsigned char*>(p.v);
  const size_t slot_bytes = (size_t)p.kv_heads * S::kRowBytes;

  // prefix into shared memory (one coalesced pass) for the cursor's search: a CTA's start is
  // found without a chain of dependent global loads.
  constexpr int kStagedPrefix = 640;  // 2.5 KB: keeps three CTAs per SM at 70 KB of tiles each
  __shared__ int32_t sm_prefix[kStagedPrefix];
  const int staged = min(p.tokens + 1, kStagedPrefix);
  for (int i = threadIdx.x; i < staged; i += kWarps * 32) sm_prefix[i] = p.prefix[i];
  __syncthreads();
  UnitCursor fetch, work;  // the next unit to copy, and the unit being computed
  fetch.Seek(p, sm_prefix, staged, begin);
  work = fetch;
  auto issue = [&](int i) {
    if (i < n) {
      State::Issue(smem + (i % kMmaStages) * 2 * S::kTileBytes, k_pool + (size_t)fetch.h * S::kRowBytes,
                   v_pool + (size_t)fetch.h * S::kRowBytes, slot_bytes, p.tables + (size_t)fetch.t * p.table_width,
                   p, fetch.j * kMmaKeys, fetch.length);
      if (i + 1 < n) fetch.Next(p);
    }
    attention::CommitAsync();
  };

#pragma unroll
  for (int s = 0; s + 1 < kMmaStages; ++s) issue(s);
  State st;
  st.Start(p.q + ((size_t)work.t * H + work.h * G) * D, gq, tq);
  const float scale = p.q_scale * kLog2e;
  bool from_start = work.j == 0, first = true;
  for (int i = 0; i < n; ++i) {
    issue(i + kMmaStages - 1);
    attention::WaitAsync<kMmaStages - 1>();
    __syncthreads();
    unsigned char* stage = smem + (i % kMmaStages) * 2 * S::kTileBytes;
    st.Consume(stage, warp, gq, tq, work.j * kMmaKeys, work.length, scale);
    __syncthreads();  // the stage is read: free until the next iteration's issue
    const bool last_tile = work.j + 1 == work.tiles;
    if (!last_tile && i + 1 < n) {
      work.Next(p);
      continue;
    }
    const bool whole = from_start && last_tile;
    float* out = p.out + ((size_t)work.t * H + work.h * G) * D;
    const size_t part = ((size_t)blockIdx.x * 2 + (first ? 0 : 1)) * G;
    st.Finish(reinterpret_cast<float*>(stage), sm_m, sm_l, warp, gq, tq,
              [&](int g, int d, float acc, float mx, float lsum) {
                if (whole) {
                  WriteFinal(out + g * D + d, p.v_scale, acc, lsum);
                } else {
                  WritePartial(p.part_o + (part + g) * D + d, p.part_ml + (part + g) * 2, d == 0, p.v_scale, acc,
                               mx, lsum);
                }
              });
    first = false;
    if (i + 1 < n) {
      work.Next(p);  // the next (token, kv head) starts at its first tile
      st.Start(p.q + ((size_t)work.t * H + work.h * G) * D, gq, tq);
      from_start = true;
    }
  }
  attention::WaitAsync<0>();  // only empty groups remain
}

// grid (T, KV), D threads: the states that PagedDecodeBalancedKernel cut at CTA boundaries, merged
// as MergeSplitsKernel merges splits; a (token, kv head) one CTA finished was written already, and
// one with no keys gets zeros. A state may span hundreds of CTAs (one sequence over the whole GPU):
// the threads find their partials' slots side by side, D CTAs at a time, and each thread then folds
// them into its (g, d) outputs' running (max, sum, o).
__global__ void MergeBalancedKernel(Params p, int G, int D) {
  constexpr int kMaxG = 8;
  __shared__ int sm_slot[128];  // blockDim.x (= D) <= 128
  const int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
  const int tiles = BalancedTiles(BalancedLength(p, t));
  float* out = p.out + ((size_t)t * p.kv_heads + h) * G * D + d;
  if (tiles == 0) {
    for (int g = 0; g < G; ++g) out[g * D] = 0.f;
    return;
  }
  const long long units = p.prefix[p.tokens];
  const long long first_unit = p.prefix[t] + (long long)h * tiles, last_unit = first_unit + tiles - 1;
  auto cta_of = [&](long long u) { return (int)(((u + 1) * p.ctas - 1) / units); };  // max c: start(c) <= u
  auto start_of = [&](long long c) { return c * units / p.ctas; };
  const int c0 = cta_of(first_unit), c1 = cta_of(last_unit);
  if (c0 == c1) return;  // uniform across the block
  float mx[kMaxG], lsum[kMaxG], o[kMaxG];
  for (int g = 0; g < G; ++g) mx[g] = -INFINITY, lsum[g] = 0.f, o[g] = 0.f;
  for (int base = c0; base <= c1; base += blockDim.x) {
    // CTA c0 holds this state in slot 0 if it is c0's first, else in slot 1 (c0's last); the CTAs
    // after c0 start inside it (slot 0). CTAs with no units (only when units < ctas) hold nothing.
    const int c = base + d;
    int slot = -1;
    if (c <= c1 && start_of(c) < start_of(c + 1)) slot = c * 2 + (c == c0 && start_of(c0) != first_unit ? 1 : 0);
    __syncthreads();  // the previous chunk's slots are read
    sm_slot[d] = slot;
    __syncthreads();
    const int count = min((int)blockDim.x, c1 - base + 1);
    for (int i = 0; i < count; ++i) {
      if (sm_slot[i] < 0) continue;
      for (int g = 0; g < G; ++g) {
        const size_t part = (size_t)sm_slot[i] * G + g;
        const float m_part = p.part_ml[part * 2];
        if (m_part == -INFINITY) continue;
        const float next = fmaxf(mx[g], m_part);
        const float keep = __expf(mx[g] - next), add = __expf(m_part - next);  // exp(-inf) = 0 at the start
        lsum[g] = lsum[g] * keep + p.part_ml[part * 2 + 1] * add;
        o[g] = o[g] * keep + p.part_o[part * D + d] * add;
        mx[g] = next;
      }
    }
  }
  for (int g = 0; g < G; ++g) out[g * D] = lsum[g] > 0.f ? o[g] / lsum[g] : 0.f;
}

// grid (B, KV * G), D threads: out = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M).
__global__ void MergeSplitsKernel(Params p, int G, int D) {
  const int b = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
  const int kvh = head / G, g = head % G;
  const size_t first = (((size_t)b * p.kv_heads + kvh) * p.splits) * G + g;
  float mx = -INFINITY;
  for (int s = 0; s < p.splits; ++s) mx = fmaxf(mx, p.part_ml[(first + (size_t)s * G) * 2]);
  float lsum = 0.f, o = 0.f;
  if (mx > -INFINITY) {
    for (int s = 0; s < p.splits; ++s) {
      const size_t part = first + (size_t)s * G;
      const float c = __expf(p.part_ml[part * 2] - mx);
      lsum += p.part_ml[part * 2 + 1] * c;
      o += p.part_o[part * D + d] * c;
    }
  }
  p.out[((size_t)b * p.kv_heads * G + head) * D + d] = lsum > 0.f ? o / lsum : 0.f;
}

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("modelopt_paged_decode: " + what);
}

// The balanced kernel's grid: the CTAs the GPU holds at once (its occupancy on this device), at most
// the partial buffers' max_ctas.
template <typename T, int D, int G>
void LaunchBalanced(Params p, cudaStream_t stream) {
  constexpr int kSmem = MmaTiles<T, D, G>::kSmemBytes;
  auto* kernel = PagedDecodeBalancedKernel<T, D, G>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  int device = 0, sms = 0, per_sm = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kWarps * 32, kSmem);
  p.ctas = std::max(1, std::min(p.ctas, std::max(1, per_sm) * std::max(1, sms)));
  kernel<<<p.ctas, kWarps * 32, kSmem, stream>>>(p);
  MergeBalancedKernel<<<dim3(p.tokens, p.kv_heads), D, 0, stream>>>(p, G, D);
}

template <typename T, int D, int G>
void Launch(const Params& p, int batch, cudaStream_t stream) {
  if (p.variant == kBalancedKernel) return LaunchBalanced<T, D, G>(p, stream);
  dim3 grid(p.splits, p.kv_heads, batch);
  if (p.variant == kMmaKernel) {
    constexpr int kSmem = MmaTiles<T, D, G>::kSmemBytes;
    cudaFuncSetAttribute(PagedDecodeMmaKernel<T, D, G>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    PagedDecodeMmaKernel<T, D, G><<<grid, kWarps * 32, kSmem, stream>>>(p);
  } else {
    constexpr int kSmem = Staging<T, D, G>::kSmemBytes;
    // Above 48 KB a kernel must opt in to dynamic shared memory (once per instantiation is enough;
    // the call is cheap and idempotent, so it is made per launch rather than guarded by a flag).
    cudaFuncSetAttribute(PagedDecodeStagedKernel<T, D, G>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    PagedDecodeStagedKernel<T, D, G><<<grid, kWarps * 32, kSmem, stream>>>(p);
  }
  if (p.splits > 1) MergeSplitsKernel<<<dim3(batch, p.kv_heads * G), D, 0, stream>>>(p, G, D);
}

template <typename T, int D>
bool DispatchG(int g, const Params& p, int batch, cudaStream_t stream) {
  switch (g) {
    case 1: Launch<T, D, 1>(p, batch, stream); return true;
    case 2: Launch<T, D, 2>(p, batch, stream); return true;
    case 3: Launch<T, D, 3>(p, batch, stream); return true;
    case 4: Launch<T, D, 4>(p, batch, stream); return true;
    case 5: Launch<T, D, 5>(p, batch, stream); return true;
    case 6: Launch<T, D, 6>(p, batch, stream); return true;
    case 7: Launch<T, D, 7>(p, batch, stream); return true;
    case 8: Launch<T, D, 8>(p, batch, stream); return true;
  }
  return false;
}

template <typename T>
bool DispatchD(int d, int g, const Params& p, int batch, cudaStream_t stream) {
  switch (d) {
    case 64: return DispatchG<T, 64>(g, p, batch, stream);
    case 128: return DispatchG<T, 128>(g, p, batch, stream);
  }
  return false;
}

std::string Dims(ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// Checks what both decode ops share (q, the pools, tables, lengths, out) and fills p's common fields.
ffi::Error CheckCommon(ffi::Buffer<ffi::F32>& q, ffi::AnyBuffer& k, ffi::AnyBuffer& v, ffi::Buffer<ffi::S32>& tables,
                       ffi::Buffer<ffi::S32>& lengths, ffi::Result<ffi::Buffer<ffi::F32>>& out, float k_scale,
                       float v_scale, float softmax_scale, int32_t page, Params& p) {
  const auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  if (qd.size() != 3) return Invalid("q must be [batch, heads, head_dim], got " + Dims(qd));
  if (kd.size() != 3) return Invalid("k must be [slots, kv_heads, head_dim], got " + Dims(kd));
  if (v.dimensions().size() != 3 || v.dimensions()[0] != kd[0] || v.dimensions()[1] != kd[1] ||
      v.dimensions()[2] != kd[2]) {
    return Invalid("v must have k's shape " + Dims(kd) + ", got " + Dims(v.dimensions()));
  }
  if (k.element_type() != v.element_type()) return Invalid("k and v must have one dtype");
  const int64_t batch = qd[0], heads = qd[1], d = qd[2], kv_heads = kd[1];
  if (kd[2] != d) return Invalid("head_dim of q " + Dims(qd) + " and k " + Dims(kd) + " differ");
  if (kv_heads <= 0 || heads % kv_heads != 0) {
    return Invalid("heads (" + std::to_string(heads) + ") must be a multiple of kv_heads (" +
                   std::to_string(kv_heads) + ")");
  }
  if (page <= 0 || kd[0] % page != 0) {
    return Invalid("page_size " + std::to_string(page) + " must divide the pool's slots " + std::to_string(kd[0]));
  }
  if (td.size() != 2 || td[0] != batch) return Invalid("block_tables must be [" + std::to_string(batch) +
                                                       ", pages], got " + Dims(td));
  if (lengths.dimensions().size() != 1 || lengths.dimensions()[0] != batch) {
    return Invalid("lengths must be [" + std::to_string(batch) + "], got " + Dims(lengths.dimensions()));
  }
  const auto od = out->dimensions();
  if (od.size() != 3 || od[0] != batch || od[1] != heads || od[2] != d) return Invalid("out must have q's shape");
  if (batch > 65535) return Invalid("batch " + std::to_string(batch) + " exceeds 65535");
  p = Params{};
  p.q = q.typed_data(), p.k = k.untyped_data(), p.v = v.untyped_data();
  p.tables = tables.typed_data(), p.lengths = lengths.typed_data(), p.out = out->typed_data();
  p.kv_heads = static_cast<int>(kv_heads), p.table_width = static_cast<int>(td[1]), p.page = page;
  p.tokens = static_cast<int>(batch);
  const bool fp8 = k.element_type() == ffi::DataType::F8E4M3FN;
  p.q_scale = softmax_scale * (fp8 ? k_scale : 1.f);
  p.v_scale = fp8 ? v_scale : 1.f;
  p.page_shift = (page & (page - 1)) == 0 ? __builtin_ctz(page) : -1;
  return ffi::Error::Success();
}

// Launches the kernel p.variant names for the pool's dtype, head_dim d and group g.
ffi::Error Dispatch(const Params& p, ffi::DataType pool, int64_t d, int64_t g, cudaStream_t stream) {
  bool launched = false;
  switch (pool) {
    case ffi::DataType::BF16: launched = DispatchD<__nv_bfloat16>(d, g, p, p.tokens, stream); break;
    case ffi::DataType::F16: launched = DispatchD<__half>(d, g, p, p.tokens, stream); break;
    case ffi::DataType::F8E4M3FN: launched = DispatchD<__nv_fp8_e4m3>(d, g, p, p.tokens, stream); break;
    default: return Invalid("the pool must be bfloat16, float16 or float8_e4m3fn");
  }
  if (!launched) {
    return Invalid("compiled for head_dim 64 or 128 and 1..8 query heads per kv head; got head_dim " +
                   std::to_string(d) + ", " + std::to_string(g) + " per kv head");
  }
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return ffi::Error::Internal(std::string("modelopt_paged_decode: ") + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

ffi::Error PagedDecodeCuda(cudaStream_t stream, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lengths,
                           ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Result<ffi::Buffer<ffi::F32>> part_o,
                           ffi::Result<ffi::Buffer<ffi::F32>> part_ml, float k_scale, float v_scale,
                           float softmax_scale, int32_t page, int32_t variant) {
  Params p;
  if (ffi::Error e = CheckCommon(q, k, v, tables, lengths, out, k_scale, v_scale, softmax_scale, page, p);
      e.failure()) {
    return e;
  }
  const int64_t batch = q.dimensions()[0], d = q.dimensions()[2], g = q.dimensions()[1] / p.kv_heads;
  const auto pd = part_o->dimensions(), md = part_ml->dimensions();
  if (pd.size() != 5 || pd[0] != batch || pd[1] != p.kv_heads || pd[3] != g || pd[4] != d || pd[2] < 1) {
    return Invalid("partial_o must be [batch, kv_heads, splits, group, head_dim], got " + Dims(pd));
  }
  if (md.size() != 5 || md[0] != batch || md[1] != p.kv_heads || md[2] != pd[2] || md[3] != g || md[4] != 2) {
    return Invalid("partial_ml must be [batch, kv_heads, splits, group, 2], got " + Dims(md));
  }
  if (variant != kStagedKernel && variant != kMmaKernel) {
    return Invalid("variant must be 1 (staged) or 2 (mma), got " + std::to_string(variant));
  }
  if (batch == 0) return ffi::Error::Success();
  p.part_o = part_o->typed_data(), p.part_ml = part_ml->typed_data();
  p.splits = static_cast<int>(pd[2]);
  p.variant = variant;
  return Dispatch(p, k.element_type(), d, g, stream);
}

// The work-balanced kernel (bf16 compute, tensor cores): prefix [T + 1] int32 from the jax wrapper;
// partial_o [max_ctas, 2, group, head_dim] and partial_ml [max_ctas, 2, group, 2] its scratch.
ffi::Error PagedDecodeBalancedCuda(cudaStream_t stream, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                   ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lengths,
                                   ffi::Buffer<ffi::S32> prefix, ffi::Result<ffi::Buffer<ffi::F32>> out,
                                   ffi::Result<ffi::Buffer<ffi::F32>> part_o,
                                   ffi::Result<ffi::Buffer<ffi::F32>> part_ml, float k_scale, float v_scale,
                                   float softmax_scale, int32_t page) {
  Params p;
  if (ffi::Error e = CheckCommon(q, k, v, tables, lengths, out, k_scale, v_scale, softmax_scale, page, p);
      e.failure()) {
    return e;
  }
  const int64_t batch = q.dimensions()[0], d = q.dimensions()[2], g = q.dimensions()[1] / p.kv_heads;
  if (prefix.dimensions().size() != 1 || prefix.dimensions()[0] != batch + 1) {
    return Invalid("prefix must be [" + std::to_string(batch + 1) + "], got " + Dims(prefix.dimensions()));
  }
  const auto pd = part_o->dimensions(), md = part_ml->dimensions();
  if (pd.size() != 4 || pd[0] < 1 || pd[0] > (1 << 20) || pd[1] != 2 || pd[2] != g || pd[3] != d) {
    return Invalid("partial_o must be [max_ctas, 2, group, head_dim], got " + Dims(pd));
  }
  if (md.size() != 4 || md[0] != pd[0] || md[1] != 2 || md[2] != g || md[3] != 2) {
    return Invalid("partial_ml must be [max_ctas, 2, group, 2], got " + Dims(md));
  }
  if (k.element_type() != ffi::DataType::BF16 && k.element_type() != ffi::DataType::F16 &&
      k.element_type() != ffi::DataType::F8E4M3FN) {
    return Invalid("the pool must be bfloat16, float16 or float8_e4m3fn");
  }
  if (batch == 0) return ffi::Error::Success();
  p.prefix = prefix.typed_data();
  p.part_o = part_o->typed_data(), p.part_ml = part_ml->typed_data();
  p.ctas = static_cast<int>(pd[0]);
  p.splits = 1;
  p.variant = kBalancedKernel;
  return Dispatch(p, k.element_type(), d, g, stream);
}

// Tests' variant: one more operand, aliased to the output, that they fill with NaN first, so an
// element the kernel fails to write shows.
ffi::Error PagedDecodeCudaPoisoned(cudaStream_t stream, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                   ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lengths,
                                   ffi::Buffer<ffi::F32> /*out_init, aliased to out*/,
                                   ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Result<ffi::Buffer<ffi::F32>> part_o,
                                   ffi::Result<ffi::Buffer<ffi::F32>> part_ml, float k_scale, float v_scale,
                                   float softmax_scale, int32_t page, int32_t variant) {
  return PagedDecodeCuda(stream, q, k, v, tables, lengths, out, part_o, part_ml, k_scale, v_scale, softmax_scale,
                         page, variant);
}

ffi::Error PagedDecodeBalancedCudaPoisoned(cudaStream_t stream, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                                           ffi::AnyBuffer v, ffi::Buffer<ffi::S32> tables,
                                           ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> prefix,
                                           ffi::Buffer<ffi::F32> /*out_init, aliased to out*/,
                                           ffi::Result<ffi::Buffer<ffi::F32>> out,
                                           ffi::Result<ffi::Buffer<ffi::F32>> part_o,
                                           ffi::Result<ffi::Buffer<ffi::F32>> part_ml, float k_scale, float v_scale,
                                           float softmax_scale, int32_t page) {
  return PagedDecodeBalancedCuda(stream, q, k, v, tables, lengths, prefix, out, part_o, part_ml, k_scale, v_scale,
                                 softmax_scale, page);
}

template <typename Binding>
auto BindBalancedResultsAndAttrs(Binding b) {
  return std::move(b).template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<float>("k_scale")
      .template Attr<float>("v_scale")
      .template Attr<float>("softmax_scale")
      .template Attr<int32_t>("page_size");
}

template <typename Binding>
auto BindResultsAndAttrs(Binding b) {
  return std::move(b).template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<float>("k_scale")
      .template Attr<float>("v_scale")
      .template Attr<float>("softmax_scale")
      .template Attr<int32_t>("page_size")
      .template Attr<int32_t>("variant");
}

auto BindOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::Buffer<ffi::F32>>()   // q [T, H, D]
      .Arg<ffi::AnyBuffer>()          // key pool [slots, KV, D]
      .Arg<ffi::AnyBuffer>()          // value pool
      .Arg<ffi::Buffer<ffi::S32>>()   // block tables [T, W]
      .Arg<ffi::Buffer<ffi::S32>>();  // lengths [T] (position + 1)
}

}  // namespace
}  // namespace modelopt_jax::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(ModeloptPagedDecodeCuda, modelopt_jax::cuda::PagedDecodeCuda,
                              modelopt_jax::cuda::BindResultsAndAttrs(modelopt_jax::cuda::BindOperands()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(ModeloptPagedDecodeCudaPoisoned, modelopt_jax::cuda::PagedDecodeCudaPoisoned,
                              modelopt_jax::cuda::BindResultsAndAttrs(
                                  modelopt_jax::cuda::BindOperands().Arg<xla::ffi::Buffer<xla::ffi::F32>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(ModeloptPagedDecodeBalancedCuda, modelopt_jax::cuda::PagedDecodeBalancedCuda,
                              modelopt_jax::cuda::BindBalancedResultsAndAttrs(
                                  modelopt_jax::cuda::BindOperands().Arg<xla::ffi::Buffer<xla::ffi::S32>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(ModeloptPagedDecodeBalancedCudaPoisoned,
                              modelopt_jax::cuda::PagedDecodeBalancedCudaPoisoned,
                              modelopt_jax::cuda::BindBalancedResultsAndAttrs(
                                  modelopt_jax::cuda::BindOperands()
                                      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // prefix [T + 1]
                                      .Arg<xla::ffi::Buffer<xla::ffi::F32>>()),  // out_init
                              {xla::ffi::Traits::kCmdBufferCompatible});
