// The modelopt_paged_decode ops' kernels: one query token per sequence attends over that
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
//
// The kernels and their launch; the handler (paged_decode.cu) parses the call (paged_pool.h) and fills
// Params. Included by that one translation unit, hence the internal linkage.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

#include "attention_mma.cuh"

namespace modelopt_jax::cuda::decode {
namespace {

constexpr int kWarps = 4;
constexpr int kChunkPages = 256;  // page ids a CTA stages in shared memory at a time
constexpr float kFloor = -1e30f;  // running max's start: finite, so exp(floor - floor) is 1, never NaN
constexpr int kStagedKernel = 1, kMmaKernel = 2;  // the "variant" attribute (0 was a register kernel, removed)

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
  // The fused write (modelopt_paged_decode_write): token t's stored key/value rows [KV, D] in the
  // pool's dtype, and the slot they go to; null for the plain op. ``num_slots`` bounds the slot.
  const unsigned char* new_k;
  const unsigned char* new_v;
  const int32_t* slots;
  int64_t num_slots;
};

// The fused write: the CTA whose split holds token b's last position (the one this step appends)
// stores the token's key and value rows for kv head kvh into the pool before its copies read that
// slot, so the step needs no scatter per pool and layer. Only that CTA reads the slot in this
// launch, and its own threads see the stores after a barrier (cp.async reads through L2, where
// they land). Each token must be the only one of the launch that writes to or reads this slot:
// the engine's decode steps (one token per sequence, pages owned by one sequence). A slot outside
// the pool is not written. ``WritesNewToken`` is uniform over the CTA, so the callers' barriers are.
__device__ __forceinline__ bool WritesNewToken(const Params& p, int split, int per_split, int seq_pages) {
  return p.new_k != nullptr && seq_pages > 0 && (seq_pages - 1) / per_split == split;
}

template <typename T, int D>
__device__ __forceinline__ void StoreNewToken(const Params& p, int b, int kvh) {
  const int64_t slot = p.slots[b];
  if (slot < 0 || slot >= p.num_slots) return;
  constexpr int kRowBytes = D * (int)sizeof(T), kChunks = kRowBytes / 16;
  static_assert(kRowBytes % 16 == 0 && 2 * kChunks <= kWarps * 32, "a row is whole 16-byte chunks, one per thread");
  if (threadIdx.x < 2 * kChunks) {
    const bool value = threadIdx.x >= kChunks;
    const size_t part = (threadIdx.x % kChunks) * 16;
    const unsigned char* src = (value ? p.new_v : p.new_k) + ((size_t)b * p.kv_heads + kvh) * kRowBytes + part;
    unsigned char* dst = static_cast<unsigned char*>(const_cast<void*>(value ? p.v : p.k)) +
                         ((size_t)slot * p.kv_heads + kvh) * kRowBytes + part;
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  }
}

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
  if (WritesNewToken(p, split, per_split, seq_pages)) {
    StoreNewToken<T, D>(p, b, kvh);
    __syncthreads();  // before any copy reads the slot
  }

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
      // the (max, sum) pair still goes out: it is the log-sum-exp cascade attention merges by
      const size_t part = ((size_t)b * p.kv_heads + kvh) * G + g;
      if (d == 0) p.part_ml[part * 2] = lsum > 0.f ? mx : -INFINITY, p.part_ml[part * 2 + 1] = lsum;
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

template <typename T, int D, int G>
struct MmaTiles {
  static constexpr int kRowBytes = D * (int)sizeof(T);
  static constexpr int kStride = kRowBytes + 16;  // padded rows: conflict-free fragment loads
  static constexpr int kTileBytes = kMmaKeys * kStride;
  static constexpr int kPipeBytes = kMmaStages * 2 * kTileBytes;  // kMmaStages stages of (K, V)
  static constexpr int kMergeBytes = kWarps * G * D * (int)sizeof(float);
  static constexpr int kSmemBytes = kPipeBytes > kMergeBytes ? kPipeBytes : kMergeBytes;
};

template <typename T, int D, int G>
__global__ void __launch_bounds__(kWarps * 32) PagedDecodeMmaKernel(Params p) {
  using M = attention::Mma<T>;
  using F = attention::Fragments<T>;
  using S = MmaTiles<T, D, G>;
  static_assert(G <= 8, "the heads of a token fill MMA rows 0..7");
  extern __shared__ __align__(16) unsigned char smem[];

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
  // The fused write, as late as it can be: the tile holding the new position is issued by the
  // prologue (tiles 0 .. kMmaStages - 2: store, then a barrier first), at the top of iteration 0
  // (tile kMmaStages - 1: store after the prologue, then a barrier), or later, after iteration 0's
  // barriers (store after the prologue; no barrier of its own). A CTA thus stores while its first
  // tiles are in flight instead of waiting on the slot and row loads before issuing any copy.
  const bool writes = WritesNewToken(p, split, per_split, seq_pages);
  const int new_tile = writes ? (length - 1 - tok_begin) / kMmaKeys : -1;
  if (writes && new_tile < kMmaStages - 1) {
    StoreNewToken<T, D>(p, b, kvh);
    __syncthreads();
  }

  // Q as A fragments: row gq's columns (c, c + 1) and (c + 8, c + 9) of each 16-column k-step;
  // rows 8..15 (a1, a3) are zeros.
  uint32_t qa[D / 16][2];
  const float* qg = gq < G ? p.q + ((size_t)b * H + kvh * G + gq) * D : nullptr;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int c = kk * 16 + 2 * tq;
    const float2 x = qg ? *reinterpret_cast<const float2*>(qg + c) : make_float2(0.f, 0.f);
    const float2 y = qg ? *reinterpret_cast<const float2*>(qg + c + 8) : make_float2(0.f, 0.f);
    qa[kk][0] = M::pack(x.x, x.y), qa[kk][1] = M::pack(y.x, y.y);
  }
  const float scale = p.q_scale * kLog2e;
  float o[D / 8][2];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = 0.f;
  float m = kFloor, l = 0.f;  // row gq's running max (base 2) and this lane's share of its sum

  const unsigned char* kbase = static_cast<const unsigned char*>(p.k) + (size_t)kvh * S::kRowBytes;
  const unsigned char* vbase = static_cast<const unsigned char*>(p.v) + (size_t)kvh * S::kRowBytes;
  const size_t slot_bytes = (size_t)p.kv_heads * S::kRowBytes;
  const int32_t* table = p.tables + (size_t)b * p.table_width;

  auto issue = [&](int tile) {
    if (tile < tiles) {
      unsigned char* stage = smem + (tile % kMmaStages) * 2 * S::kTileBytes;
      constexpr int kChunks = S::kRowBytes / 16;
      for (int c = threadIdx.x; c < kMmaKeys * kChunks; c += kWarps * 32) {
        const int key = c / kChunks, part = c % kChunks;
        const int pos = tok_begin + tile * kMmaKeys + key;
        const bool valid = pos < tok_end;
        size_t offset = part * 16;
        if (valid) {
          const int pg = p.page_shift >= 0 ? pos >> p.page_shift : pos / p.page;
          offset += ((size_t)table[pg] * p.page + (pos - pg * p.page)) * slot_bytes;
        }
        attention::CopyAsync16(stage + key * S::kStride + part * 16, kbase + offset, valid);
        attention::CopyAsync16(stage + S::kTileBytes + key * S::kStride + part * 16, vbase + offset, valid);
      }
    }
    attention::CommitAsync();  // an empty group past the last tile keeps the wait count uniform
  };

#pragma unroll
  for (int s = 0; s + 1 < kMmaStages; ++s) issue(s);
  if (writes && new_tile >= kMmaStages - 1) {
    StoreNewToken<T, D>(p, b, kvh);
    if (new_tile == kMmaStages - 1) __syncthreads();
  }
  for (int tile = 0; tile < tiles; ++tile) {
    issue(tile + kMmaStages - 1);
    attention::WaitAsync<kMmaStages - 1>();  // this thread's copies of `tile` have landed...
    __syncthreads();                          // ...and everyone's
    const unsigned char* ks = smem + (tile % kMmaStages) * 2 * S::kTileBytes;
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
    const int first = tok_begin + tile * kMmaKeys + key0 + 2 * tq;  // position of sc[0][0]
    float mx = kFloor;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        sc[j][e] = first + j * 8 + e < tok_end ? sc[j][e] * scale : -INFINITY;
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
    __syncthreads();  // the stage is read: the next issue may overwrite it
  }
  attention::WaitAsync<0>();  // only empty groups remain

  // Merge the 4 warps' states (rows gq < G) in the drained pipeline's memory.
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  __shared__ float sm_m[kWarps][G], sm_l[kWarps][G];
  float* sm_o = reinterpret_cast<float*>(smem);  // [kWarps][G][D]
  __syncthreads();
  if (gq < G) {
    if (tq == 0) sm_m[warp][gq] = m, sm_l[warp][gq] = l;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      float* dst = sm_o + ((size_t)warp * G + gq) * D + n * 8 + 2 * tq;
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
      acc += sm_o[((size_t)w * G + g) * D + d] * c;
    }
    acc *= p.v_scale;
    if (p.splits == 1) {
      p.out[((size_t)b * H + kvh * G + g) * D + d] = lsum > 0.f ? acc / lsum : 0.f;
      // the (max, sum) pair still goes out (natural units): cascade attention merges by it
      const size_t part = ((size_t)b * p.kv_heads + kvh) * G + g;
      if (d == 0) p.part_ml[part * 2] = lsum > 0.f ? mx * kLn2 : -INFINITY, p.part_ml[part * 2 + 1] = lsum;
    } else {
      const size_t part = (((size_t)b * p.kv_heads + kvh) * p.splits + split) * G + g;
      p.part_o[part * D + d] = acc;
      if (d == 0) p.part_ml[part * 2] = lsum > 0.f ? mx * kLn2 : -INFINITY, p.part_ml[part * 2 + 1] = lsum;
    }
  }
}

// grid (B, KV * G), D threads: out = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M).
// One pass in batches of kMergeBatch splits: a batch's loads are independent and issued together,
// then folded into a running (max, sum, output) rescaled to the batch's max. (Two passes of one
// dependent load per split cost a batch-1 step 5.5 us per layer at 9-17 splits: L2 round trips in a row.)
constexpr int kMergeBatch = 8;

__global__ void MergeSplitsKernel(Params p, int G, int D) {
  const int b = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
  const int kvh = head / G, g = head % G;
  const size_t first = (((size_t)b * p.kv_heads + kvh) * p.splits) * G + g;
  float mx = -INFINITY, lsum = 0.f, o = 0.f;
  for (int s0 = 0; s0 < p.splits; s0 += kMergeBatch) {
    float m[kMergeBatch], l[kMergeBatch], v[kMergeBatch];
#pragma unroll
    for (int i = 0; i < kMergeBatch; ++i) {
      const bool in = s0 + i < p.splits;
      const size_t part = first + (size_t)(in ? s0 + i : 0) * G;
      m[i] = in ? p.part_ml[part * 2] : -INFINITY;
      l[i] = in ? p.part_ml[part * 2 + 1] : 0.f;
      v[i] = in ? p.part_o[part * D + d] : 0.f;
    }
    float top = mx;
#pragma unroll
    for (int i = 0; i < kMergeBatch; ++i) top = fmaxf(top, m[i]);
    if (top == -INFINITY) continue;  // every split so far is empty
    const float rescale = __expf(mx - top);  // 0 while mx is still -inf
    lsum *= rescale;
    o *= rescale;
#pragma unroll
    for (int i = 0; i < kMergeBatch; ++i) {
      const float c = __expf(m[i] - top);
      lsum += l[i] * c;
      o += v[i] * c;
    }
    mx = top;
  }
  p.out[((size_t)b * p.kv_heads * G + head) * D + d] = lsum > 0.f ? o / lsum : 0.f;
}

template <typename T, int D, int G>
void Launch(const Params& p, int batch, cudaStream_t stream) {
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

}  // namespace
}  // namespace modelopt_jax::cuda::decode
