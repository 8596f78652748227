// The modelopt_paged_prefill ops' kernel: prompt chunks attend over their sequences' pages
// of the paged KV cache (causal), on the tensor cores (FlashAttention-2 style).
//
// Why a kernel: the engine's prompt steps ran XLA's attention over each row's gathered pages --
// a dense [rows, pages * page, kv, d] copy of the keys and values, transposes for the einsums,
// float32 scores of [rows, heads, row width, pages * page] written and read back, and padding of
// every row to the step's widest. On the H200 that took about as long as the step's FP8 GEMMs
// (bench/RESULTS.md, the profile of workload (a)'s prompt steps). Here each CTA takes 64 or 128 query
// rows (consecutive tokens of one row, times the GQA heads of one kv head), streams that sequence's
// pages up to its last token through shared memory 64 keys at a time, and keeps the softmax state
// in registers; scores and P.V run as bf16 (or f16) m16n8k16 MMAs with float32 accumulation.
//
// Layout (the same pool as the decode kernel, modelopt_jax.kv_cache.PagedKVCache): keys/values
// [slots, kv_heads, d], slot = block_table[r, p // page] * page + p % page. Queries: q (float32, bf16 or f16)
// [T, heads, d] packed; row r's i-th query token is q[row_tokens[r, i]] (T marks padding) at
// positions[row_tokens[r, i]], and it attends over that row's positions 0 .. its own. Output:
// [T, heads, d] in the packed order, each row's tokens written where row_tokens puts them
// (the handler zeroes the buffer first: a packed token in no row -- step padding -- reads zeros, as
// on XLA's path; writing per row and scattering back cost the prompt steps a pass over the
// output, about 2 ms of a 2048-token step of Llama-3-8B on the H200). FP8 pages hold e4m3 codes,
// which bf16 holds exactly: the key scale multiplies the float32 scores, the value scale the output.
// The probabilities are rounded to the MMA type before P.V, as XLA's path rounds them to the
// compute dtype.
//
// The kernel and its launch; the handler (paged_prefill.cu) parses the call (paged_pool.h) and fills
// Params. Included by that one translation unit, hence the internal linkage.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

#include "attention_mma.cuh"

namespace modelopt_jax::cuda::prefill {
namespace {
using attention::CommitAsync;
using attention::CopyAsync16;
using attention::Mma;
using attention::LoadMatrices;
using attention::LoadMatricesTransposed;
using attention::WaitAllAsync;

constexpr int kWarps = 4;
constexpr int kMaxRows = kWarps * 16 * 2;  // query rows (token, head) per CTA at most: 16 per m-tile, MT <= 2
constexpr int kKeys = 64;           // keys per shared-memory tile
constexpr int kPad = 8;             // elements of padding per smem row: conflict-free ldmatrix rows
constexpr float kFloor = -1e30f;    // running max's start: finite, so exp2(floor - floor) is 1, never NaN
constexpr float kLog2e = 1.4426950408889634f;

// The element types q and the output may have (the handler maps XLA's to these). bf16 or f16 q and
// output in the compute dtype save the prompt step a float32 copy of q and a float32 output (written,
// zeroed first, read back and converted): about 2.7x the bytes of q and out in bf16.
enum class Io : int { kF32, kBF16, kF16 };

__device__ __forceinline__ float2 LoadPair(const void* base, size_t i, Io type) {  // elements i, i + 1 (i even)
  if (type == Io::kF32) return *reinterpret_cast<const float2*>(static_cast<const float*>(base) + i);
  if (type == Io::kBF16) return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(static_cast<const __nv_bfloat16*>(base) + i));
  return __half22float2(*reinterpret_cast<const __half2*>(static_cast<const __half*>(base) + i));
}

__device__ __forceinline__ void StorePair(void* base, size_t i, Io type, float a, float b) {  // rounded to nearest
  if (type == Io::kF32) {
    *reinterpret_cast<float2*>(static_cast<float*>(base) + i) = make_float2(a, b);
  } else if (type == Io::kBF16) {
    *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(base) + i) = __floats2bfloat162_rn(a, b);
  } else {
    *reinterpret_cast<__half2*>(static_cast<__half*>(base) + i) = __floats2half2_rn(a, b);
  }
}

struct Params {
  const void* q;              // [T, H, D] of q_type
  const void* k;              // [slots, KV, D]
  const void* v;
  const int32_t* tables;      // [R, W]
  const int32_t* row_tokens;  // [R, Wq], T = padding
  const int32_t* positions;   // [T]
  void* out;                  // [T, H, D] of out_type
  Io q_type, out_type;
  float* lse;                 // [T, H] natural log of each (token, head)'s softmax denominator (scores
                              // scaled), -inf where it saw no key; null: not wanted
  int tokens, kv_heads, table_width, row_width, page, page_shift;  // page_shift: log2(page), or -1
  float score_scale;          // softmax scale x FP8 key scale x log2(e)
  float v_scale;              // FP8 value scale (1 otherwise)
};

// Shared memory of one CTA: two stages of (K, V) tiles in the MMA type, so the next tile's copies
// run while this one's MMAs do (the first version loaded and waited tile by tile: about 65 TFLOP/s
// of causal attention on the H200, bench/RESULTS.md), the two stages' pool slots, and where a warp
// takes MT > 1 m-tiles of 16 query rows, the CTA's queries in the MMA type (their A fragments
// would not fit in registers beside MT accumulators of [16, D]; ldmatrix reads them per k-step).
template <int D, int MT>
struct Stages {
  using Tile = __nv_bfloat16[kKeys][D + kPad];  // (f16 pages use the same bytes as __half)
  static constexpr int kTileBytes = sizeof(Tile);
  static constexpr int kSlotBytes = 2 * kKeys * (int)sizeof(int32_t);
  static constexpr int kQueryBytes = MT > 1 ? MT * kWarps * 16 * (D + kPad) * 2 : 0;
  static constexpr int kBytes = 2 * 2 * kTileBytes + kSlotBytes + kQueryBytes;
};

// Issues the copies of one (K, V) tile -- positions tile0 .. tile0 + kKeys - 1, pool slots in
// `slots` (-1: past the row's last position, zero-filled: their values must not be NaN, P is 0
// there). bf16/f16 pages: 16-byte cp.async straight into the tiles, waited for by the caller. FP8:
// 16 codes per load, converted to bf16 (exact) on the way in, done when this returns.
template <typename T, int D>
__device__ __forceinline__ void LoadTiles(const Params& p, const int32_t* slots, unsigned char* k_tile,
                                          unsigned char* v_tile, int kvh) {
  constexpr int kStride = (D + kPad) * 2;  // bytes per tile row
  const size_t row_stride = (size_t)p.kv_heads * D;
  const T* kpool = static_cast<const T*>(p.k);
  const T* vpool = static_cast<const T*>(p.v);
  if constexpr (sizeof(T) == 2) {
    constexpr int kChunks = D / 8;  // 16-byte pieces per key row
    for (int c = threadIdx.x; c < kKeys * kChunks; c += kWarps * 32) {
      const int key = c / kChunks, part = c % kChunks;
      const int slot = slots[key];
      const size_t offset = slot >= 0 ? (size_t)slot * row_stride + (size_t)kvh * D + part * 8 : 0;
      CopyAsync16(k_tile + key * kStride + part * 16, kpool + offset, slot >= 0);
      CopyAsync16(v_tile + key * kStride + part * 16, vpool + offset, slot >= 0);
    }
    CommitAsync();
  } else {
    constexpr int kChunks = D / 16;
    for (int c = threadIdx.x; c < 2 * kKeys * kChunks; c += kWarps * 32) {
      const int which = c / (kKeys * kChunks), key = c / kChunks % kKeys, part = c % kChunks;
      const int slot = slots[key];
      uint4 raw = make_uint4(0, 0, 0, 0);
      if (slot >= 0) {
        raw = *reinterpret_cast<const uint4*>((which ? vpool : kpool) + (size_t)slot * row_stride + (size_t)kvh * D +
                                              part * 16);
      }
      const __nv_fp8x2_storage_t* codes = reinterpret_cast<const __nv_fp8x2_storage_t*>(&raw);
      uint32_t packed[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) packed[i] = attention::Fragments<T>::Convert(codes[i]);  // exact: e4m3 in bf16
      uint4* dst = reinterpret_cast<uint4*>((which ? v_tile : k_tile) + key * kStride + part * 32);
      dst[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      dst[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
    }
  }
}

// Pool slots of positions tile0 .. tile0 + kKeys - 1 of the row (-1 at and past kv_len); threads
// 0 .. kKeys - 1 each write one.
__device__ __forceinline__ void TileSlots(const Params& p, const int32_t* table, int tile0, int kv_len,
                                          int32_t* slots) {
  if (threadIdx.x < kKeys) {
    const int pos = tile0 + threadIdx.x;
    int slot = -1;
    if (pos < kv_len) {
      const int pg = p.page_shift >= 0 ? pos >> p.page_shift : pos / p.page;
      slot = table[pg] * p.page + (pos - pg * p.page);
    }
    slots[threadIdx.x] = slot;
  }
}

// grid (ceil(Wq * G / (64 MT)), KV, R), kWarps warps. Query row j of the CTA is (token i, head g)
// with i * G + g = x * 64 MT + j, x = gridDim.x - 1 - blockIdx.x: a row's tiles are launched last
// token first, so the CTAs with the most keys (causal) start first and the grid's tail is short
// ones. Warp w owns rows 16 MT w .. 16 MT (w + 1) - 1, as MT m-tiles of 16. A lane holds, per MMA
// fragment, rows lane / 4 and lane / 4 + 8 of an m-tile and columns 2 (lane % 4) (+1, +8, +9).
// Per tile: wait for its copies, issue the next tile's (into the other stage), look up the slots
// of the one after, then the MMAs; B fragments come from shared memory by ldmatrix (transposed
// for V), each used for all MT m-tiles. MT = 2 halves the shared-memory reads per MMA (a warp's
// ldmatrix of a K or V tile is the same whatever its rows); MT = 1 keeps Q's A fragments in
// registers and a 64-row CTA, for the cascade attention's lines of at most 16 decode rows.
template <typename T, int D, int G, int MT>
__global__ void __launch_bounds__(kWarps * 32, MT == 1 ? 3 : 2) PagedPrefillKernel(Params p) {
  static_assert(MT == 1 || MT == 2, "one or two m-tiles per warp");
  using M = Mma<T>;
  using S = Stages<D, MT>;
  constexpr int kStride = (D + kPad) * 2;
  constexpr int kRows = kWarps * 16 * MT;  // query rows (token, head) of this CTA
  static_assert(D % 32 == 0, "ldmatrix.x4 loads two 16-column k-steps (K) or two 8-column n-tiles (V)");
  extern __shared__ __align__(16) unsigned char smem[];
  int32_t* sm_slots = reinterpret_cast<int32_t*>(smem + 4 * S::kTileBytes);  // [2][kKeys]
  unsigned char* sm_q = smem + 4 * S::kTileBytes + S::kSlotBytes;           // [kRows][D + kPad] (MT > 1)
  __shared__ int32_t sm_tok[kMaxRows], sm_pos[kMaxRows];
  __shared__ int32_t sm_kv_len, sm_min_pos;

  const int kvh = blockIdx.y, r = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gq = lane / 4, tq = lane % 4;  // MMA fragment row group and column pair
  const int H = p.kv_heads * G;
  const int row0 = (gridDim.x - 1 - blockIdx.x) * kRows;

  if (threadIdx.x == 0) sm_kv_len = 0, sm_min_pos = INT32_MAX;
  __syncthreads();
  for (int jj = threadIdx.x; jj < kRows; jj += kWarps * 32) {
    const int j = row0 + jj, i = j / G;
    int tok = -1, pos = -1;
    if (i < p.row_width) {
      const int t = p.row_tokens[(size_t)r * p.row_width + i];
      if (t >= 0 && t < p.tokens) tok = t, pos = p.positions[t];
    }
    sm_tok[jj] = tok, sm_pos[jj] = pos;
    if (pos >= 0) atomicMax(&sm_kv_len, pos + 1), atomicMin(&sm_min_pos, pos);
  }
  __syncthreads();
  const int kv_len = sm_kv_len, min_pos = sm_min_pos;
  if (kv_len == 0) return;  // no real token in this CTA's rows (the kernel zeroed the output)

  // Where the query of CTA row jj starts in q: q[token, kvh * G + (row0 + jj) % G, :] (-1: no real token).
  auto query = [&](int jj) -> int64_t {
    return sm_tok[jj] >= 0 ? ((int64_t)sm_tok[jj] * H + kvh * G + (row0 + jj) % G) * D : -1;
  };
  if constexpr (MT > 1) {  // stage the CTA's queries in the MMA type (rows without a token: zeros)
    for (int c = threadIdx.x; c < kRows * (D / 4); c += kWarps * 32) {
      const int jj = c / (D / 4), part = c % (D / 4);
      const int64_t q0 = query(jj);
      const float2 a = q0 >= 0 ? LoadPair(p.q, q0 + part * 4, p.q_type) : make_float2(0.f, 0.f);
      const float2 b = q0 >= 0 ? LoadPair(p.q, q0 + part * 4 + 2, p.q_type) : make_float2(0.f, 0.f);
      *reinterpret_cast<uint2*>(sm_q + jj * kStride + part * 8) = make_uint2(M::pack(a.x, a.y), M::pack(b.x, b.y));
    }
  }

  const int32_t* table = p.tables + (size_t)r * p.table_width;
  auto k_stage = [&](int s) { return smem + (2 * s) * S::kTileBytes; };
  auto v_stage = [&](int s) { return smem + (2 * s + 1) * S::kTileBytes; };
  TileSlots(p, table, 0, kv_len, sm_slots);
  __syncthreads();
  LoadTiles<T, D>(p, sm_slots, k_stage(0), v_stage(0), kvh);
  TileSlots(p, table, kKeys, kv_len, sm_slots + kKeys);

  // This lane's rows: m-tile i's are lo[i] and lo[i] + 8 of the CTA, at positions pos_lo / pos_hi.
  int lo[MT], pos_lo[MT], pos_hi[MT];
#pragma unroll
  for (int i = 0; i < MT; ++i) lo[i] = warp * 16 * MT + i * 16 + gq, pos_lo[i] = sm_pos[lo[i]], pos_hi[i] = sm_pos[lo[i] + 8];
  // MT = 1: Q as A fragments in registers (D / 16 k-steps of 4). MT > 1: read from sm_q per k-step,
  // lane l giving row l % 8 + 8 ((l / 8) % 2) of its m-tile at column 8 (l / 16) of the k-step.
  uint32_t qa[MT == 1 ? D / 16 : 1][4];
  if constexpr (MT == 1) {
    const int64_t q_lo = query(lo[0]), q_hi = query(lo[0] + 8);
    const float2 zero = make_float2(0.f, 0.f);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int c = kk * 16 + 2 * tq;
      const float2 a0 = q_lo >= 0 ? LoadPair(p.q, q_lo + c, p.q_type) : zero;
      const float2 a1 = q_hi >= 0 ? LoadPair(p.q, q_hi + c, p.q_type) : zero;
      const float2 a2 = q_lo >= 0 ? LoadPair(p.q, q_lo + c + 8, p.q_type) : zero;
      const float2 a3 = q_hi >= 0 ? LoadPair(p.q, q_hi + c + 8, p.q_type) : zero;
      qa[kk][0] = M::pack(a0.x, a0.y), qa[kk][1] = M::pack(a1.x, a1.y);
      qa[kk][2] = M::pack(a2.x, a2.y), qa[kk][3] = M::pack(a3.x, a3.y);
    }
  }
  const int q_lane = (warp * 16 * MT + lane % 8 + 8 * ((lane / 8) % 2)) * kStride + (lane / 16) * 16;

  float o[MT][D / 8][4];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[i][n][0] = o[i][n][1] = o[i][n][2] = o[i][n][3] = 0.f;
  }
  float m_lo[MT], m_hi[MT], l_lo[MT], l_hi[MT];  // l: this lane's partial row sums
#pragma unroll
  for (int i = 0; i < MT; ++i) m_lo[i] = m_hi[i] = kFloor, l_lo[i] = l_hi[i] = 0.f;

  // ldmatrix row addresses of this lane within a tile: K, matrix lane / 8 is d-columns
  // 8 (lane / 8) .. + 7 of keys lane % 8 (of an 8-key n-tile); V, matrix lane / 8 is keys
  // 8 ((lane / 8) % 2) + lane % 8 (of a 16-key k-step) and d-columns 8 (lane / 16) .. + 7.
  const int k_lane = (lane % 8) * kStride + (lane / 8) * 16;
  const int v_lane = ((lane / 8) % 2 * 8 + lane % 8) * kStride + (lane / 16) * 16;

  const int tiles = (kv_len + kKeys - 1) / kKeys;
  for (int t = 0; t < tiles; ++t) {
    const int stage = t & 1, tile0 = t * kKeys;
    if constexpr (sizeof(T) == 2) WaitAllAsync();  // this thread's copies of tile t have landed...
    __syncthreads();  // ...and everyone's (and sm_q's); tile t - 1's stage and tile t + 1's slots are free
    if (t + 1 < tiles) {
      LoadTiles<T, D>(p, sm_slots + (stage ^ 1) * kKeys, k_stage(stage ^ 1), v_stage(stage ^ 1), kvh);
      TileSlots(p, table, tile0 + 2 * kKeys, kv_len, sm_slots + stage * kKeys);
    }
    const unsigned char* ks = k_stage(stage);
    const unsigned char* vs = v_stage(stage);

    // S = Q K^T: kKeys / 8 n-tiles of 16 x 8 per m-tile; one ldmatrix.x4 gives two k-steps' B fragments.
    float s[MT][kKeys / 8][4];
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j) s[i][j][0] = s[i][j][1] = s[i][j][2] = s[i][j][3] = 0.f;
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; kk += 2) {
      uint32_t a[MT][2][4];
#pragma unroll
      for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if constexpr (MT == 1) {
#pragma unroll
            for (int e = 0; e < 4; ++e) a[i][h][e] = qa[kk + h][e];
          } else {
            LoadMatrices(a[i][h], sm_q + q_lane + i * 16 * kStride + (kk + h) * 32);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j) {
        uint32_t b[4];
        LoadMatrices(b, ks + j * 8 * kStride + kk * 32 + k_lane);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          M::run(s[i][j], a[i][0], b[0], b[1]);
          M::run(s[i][j], a[i][1], b[2], b[3]);
        }
      }
    }
    // Scale, mask (key position <= the row's; no mask below every row's position), online softmax.
    const bool unmasked = tile0 + kKeys - 1 <= min_pos;
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      float mx_lo = kFloor, mx_hi = kFloor;
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j) {
        float* sj = s[i][j];
        const int key = tile0 + j * 8 + 2 * tq;
        if (unmasked) {
          sj[0] *= p.score_scale, sj[1] *= p.score_scale, sj[2] *= p.score_scale, sj[3] *= p.score_scale;
        } else {
          sj[0] = key <= pos_lo[i] ? sj[0] * p.score_scale : -INFINITY;
          sj[1] = key + 1 <= pos_lo[i] ? sj[1] * p.score_scale : -INFINITY;
          sj[2] = key <= pos_hi[i] ? sj[2] * p.score_scale : -INFINITY;
          sj[3] = key + 1 <= pos_hi[i] ? sj[3] * p.score_scale : -INFINITY;
        }
        mx_lo = fmaxf(mx_lo, fmaxf(sj[0], sj[1]));
        mx_hi = fmaxf(mx_hi, fmaxf(sj[2], sj[3]));
      }
#pragma unroll
      for (int off = 1; off < 4; off *= 2) {
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, off));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, off));
      }
      const float new_lo = fmaxf(m_lo[i], mx_lo), new_hi = fmaxf(m_hi[i], mx_hi);
      const float corr_lo = exp2f(m_lo[i] - new_lo), corr_hi = exp2f(m_hi[i] - new_hi);
      m_lo[i] = new_lo, m_hi[i] = new_hi;
      l_lo[i] *= corr_lo, l_hi[i] *= corr_hi;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[i][n][0] *= corr_lo, o[i][n][1] *= corr_lo, o[i][n][2] *= corr_hi, o[i][n][3] *= corr_hi;
      }
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j) {
        float* sj = s[i][j];
        sj[0] = exp2f(sj[0] - new_lo), sj[1] = exp2f(sj[1] - new_lo);
        sj[2] = exp2f(sj[2] - new_hi), sj[3] = exp2f(sj[3] - new_hi);
        l_lo[i] += sj[0] + sj[1], l_hi[i] += sj[2] + sj[3];
      }
    }
    // O += P V: the S accumulators are P's A fragments (two n-tiles make one 16-key k-step); one
    // transposed ldmatrix.x4 gives two n-tiles' B fragments.
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        pa[i][0] = M::pack(s[i][2 * kk][0], s[i][2 * kk][1]), pa[i][1] = M::pack(s[i][2 * kk][2], s[i][2 * kk][3]);
        pa[i][2] = M::pack(s[i][2 * kk + 1][0], s[i][2 * kk + 1][1]);
        pa[i][3] = M::pack(s[i][2 * kk + 1][2], s[i][2 * kk + 1][3]);
      }
#pragma unroll
      for (int n = 0; n < D / 8; n += 2) {
        uint32_t b[4];
        LoadMatricesTransposed(b, vs + kk * 16 * kStride + n * 16 + v_lane);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          M::run(o[i][n], pa[i], b[0], b[1]);
          M::run(o[i][n + 1], pa[i], b[2], b[3]);
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int off = 1; off < 4; off *= 2) {
      l_lo[i] += __shfl_xor_sync(0xffffffffu, l_lo[i], off);
      l_hi[i] += __shfl_xor_sync(0xffffffffu, l_hi[i], off);
    }
    const float inv_lo = l_lo[i] > 0.f ? p.v_scale / l_lo[i] : 0.f;
    const float inv_hi = l_hi[i] > 0.f ? p.v_scale / l_hi[i] : 0.f;
    // Each (token, head) of the tile that is a real token goes to its packed place.
    const int hi = lo[i] + 8, tok_lo = sm_tok[lo[i]], tok_hi = sm_tok[hi];
    const size_t at_lo = ((size_t)tok_lo * H + kvh * G + (row0 + lo[i]) % G);
    const size_t at_hi = ((size_t)tok_hi * H + kvh * G + (row0 + hi) % G);
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int c = n * 8 + 2 * tq;
      if (tok_lo >= 0) StorePair(p.out, at_lo * D + c, p.out_type, o[i][n][0] * inv_lo, o[i][n][1] * inv_lo);
      if (tok_hi >= 0) StorePair(p.out, at_hi * D + c, p.out_type, o[i][n][2] * inv_hi, o[i][n][3] * inv_hi);
    }
    if (p.lse != nullptr && tq == 0) {  // m is in base 2 (the scores carry log2(e)); l is the whole row's sum
      constexpr float kLn2 = 0.6931471805599453f;
      if (tok_lo >= 0) p.lse[at_lo] = l_lo[i] > 0.f ? (m_lo[i] + log2f(l_lo[i])) * kLn2 : -INFINITY;
      if (tok_hi >= 0) p.lse[at_hi] = l_hi[i] > 0.f ? (m_hi[i] + log2f(l_hi[i])) * kLn2 : -INFINITY;
    }
  }
}

// MT: m-tiles of 16 query rows per warp (see the kernel); the prompt steps' plain op takes 2, the
// cascade attention's log-sum-exp op 1.
template <typename T, int D, int G, int MT>
void Launch(const Params& p, int rows, cudaStream_t stream) {
  constexpr int kSmem = Stages<D, MT>::kBytes;
  // Above 48 KB a kernel must opt in to dynamic shared memory. The opt-in belongs to the current
  // device's copy of the kernel, so it is made on every launch (cheap and idempotent), not once
  // per process: with tensor parallelism each device launches its own.
  cudaFuncSetAttribute(PagedPrefillKernel<T, D, G, MT>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  constexpr int kRows = kWarps * 16 * MT;
  dim3 grid((p.row_width * G + kRows - 1) / kRows, p.kv_heads, rows);
  PagedPrefillKernel<T, D, G, MT><<<grid, kWarps * 32, kSmem, stream>>>(p);
}

}  // namespace
}  // namespace modelopt_jax::cuda::prefill
