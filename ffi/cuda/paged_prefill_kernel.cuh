// The modelopt_paged_prefill ops' kernel: prompt chunks attend over their sequences' pages
// of the paged KV cache (causal), on the tensor cores (FlashAttention-2 style).
//
// Why a kernel: the engine's prompt steps ran XLA's attention over each row's gathered pages --
// a dense [rows, pages * page, kv, d] copy of the keys and values, transposes for the einsums,
// float32 scores of [rows, heads, row width, pages * page] written and read back, and padding of
// every row to the step's widest. On the H200 that took about as long as the step's FP8 GEMMs
// (bench/RESULTS.md, the profile of workload (a)'s prompt steps). Here each CTA takes 64 query rows
// (consecutive tokens of one row, times the GQA heads of one kv head), streams that sequence's
// pages up to its last token through shared memory 64 keys at a time, and keeps the softmax state
// in registers; scores and P.V run as bf16 (or f16) m16n8k16 MMAs with float32 accumulation.
//
// Layout (the same pool as the decode kernel, modelopt_jax.kv_cache.PagedKVCache): keys/values
// [slots, kv_heads, d], slot = block_table[r, p // page] * page + p % page. Queries: q [T, heads, d]
// (float32, bf16 or f16) packed; row r's i-th query token is q[row_tokens[r, i]] (T marks padding)
// at positions[row_tokens[r, i]], and it attends over that row's positions 0 .. its own. Output:
// [T, heads, d] (float32, bf16 or f16) in the packed order, each row's tokens written where
// row_tokens puts them (the handler zeroes the buffer first: a packed token in no row -- step padding -- reads
// zeros, as on XLA's path; writing per row and scattering back cost the prompt steps a pass over the output, about
// 2 ms of a 2048-token step of Llama-3-8B on the H200). FP8 pages hold e4m3 codes, which bf16 holds exactly: the
// key scale multiplies the float32 scores, the value scale the output.
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
constexpr int kRows = kWarps * 16;  // query rows (token, head) per CTA: 16 per warp (one MMA's M)
constexpr int kKeys = 64;           // keys per shared-memory tile
constexpr int kPad = 8;             // elements of padding per smem row: conflict-free ldmatrix rows
constexpr float kFloor = -1e30f;    // running max's start: finite, so exp2(floor - floor) is 1, never NaN
constexpr float kLog2e = 1.4426950408889634f;

// The element types q and the output may have (the handler maps XLA's to these). q and the output
// in the compute dtype (bf16 or f16) spare a prompt step a float32 copy of q and a float32 output that
// was zeroed, written, read back and converted: on an H100 that overhead was 44-174 us per layer of
// an 8B model's prompt step, against 43-485 us of attention (bench/RESULTS.md, 2026-12-07).
enum class Io : int { kF32, kBF16, kF16 };

__device__ __forceinline__ float2 LoadPair(const void* base, size_t i, Io type) {  // elements i, i + 1 (i even)
  if (type == Io::kF32) return *reinterpret_cast<const float2*>(static_cast<const float*>(base) + i);
  if (type == Io::kBF16) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(static_cast<const __nv_bfloat16*>(base) + i));
  }
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
// of causal attention on the H200, bench/RESULTS.md), and the two stages' pool slots.
template <int D>
struct Stages {
  using Tile = __nv_bfloat16[kKeys][D + kPad];  // (f16 pages use the same bytes as __half)
  static constexpr int kTileBytes = sizeof(Tile);
  static constexpr int kBytes = 2 * 2 * kTileBytes + 2 * kKeys * (int)sizeof(int32_t);
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

// grid (ceil(Wq * G / kRows), KV, R), kWarps warps. Query row j of the CTA is (token i, head g) with
// i * G + g = blockIdx.x * kRows + j; warp w owns rows 16w .. 16w + 15. A lane holds, per MMA
// fragment, rows lane / 4 and lane / 4 + 8 of its warp's 16 and columns 2 (lane % 4) (+1, +8, +9).
// Per tile: wait for its copies, issue the next tile's (into the other stage), look up the slots
// of the one after, then the MMAs; B fragments come from shared memory by ldmatrix (transposed
// for V).
template <typename T, int D, int G>
__global__ void __launch_bounds__(kWarps * 32, 3) PagedPrefillKernel(Params p) {
  using M = Mma<T>;
  using S = Stages<D>;
  constexpr int kStride = (D + kPad) * 2;
  static_assert(D % 32 == 0, "ldmatrix.x4 loads two 16-column k-steps (K) or two 8-column n-tiles (V)");
  extern __shared__ __align__(16) unsigned char smem[];
  int32_t* sm_slots = reinterpret_cast<int32_t*>(smem + 4 * S::kTileBytes);  // [2][kKeys]
  __shared__ int32_t sm_tok[kRows], sm_pos[kRows];
  __shared__ int32_t sm_kv_len, sm_min_pos;

  const int kvh = blockIdx.y, r = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gq = lane / 4, tq = lane % 4;  // MMA fragment row group and column pair
  const int H = p.kv_heads * G;
  const int row0 = blockIdx.x * kRows;

  if (threadIdx.x == 0) sm_kv_len = 0, sm_min_pos = INT32_MAX;
  __syncthreads();
  if (threadIdx.x < kRows) {
    const int j = row0 + threadIdx.x, i = j / G;
    int tok = -1, pos = -1;
    if (i < p.row_width) {
      const int t = p.row_tokens[(size_t)r * p.row_width + i];
      if (t >= 0 && t < p.tokens) tok = t, pos = p.positions[t];
    }
    sm_tok[threadIdx.x] = tok, sm_pos[threadIdx.x] = pos;
    if (pos >= 0) atomicMax(&sm_kv_len, pos + 1), atomicMin(&sm_min_pos, pos);
  }
  __syncthreads();
  const int kv_len = sm_kv_len, min_pos = sm_min_pos;
  if (kv_len == 0) return;  // no real token in this CTA's rows (the kernel zeroed the output)

  const int32_t* table = p.tables + (size_t)r * p.table_width;
  auto k_stage = [&](int s) { return smem + (2 * s) * S::kTileBytes; };
  auto v_stage = [&](int s) { return smem + (2 * s + 1) * S::kTileBytes; };
  TileSlots(p, table, 0, kv_len, sm_slots);
  __syncthreads();
  LoadTiles<T, D>(p, sm_slots, k_stage(0), v_stage(0), kvh);
  TileSlots(p, table, kKeys, kv_len, sm_slots + kKeys);

  // This lane's two rows: their positions, and Q as A fragments (D / 16 k-steps of 4 registers).
  const int lo = warp * 16 + gq, hi = lo + 8;
  const int pos_lo = sm_pos[lo], pos_hi = sm_pos[hi];
  uint32_t qa[D / 16][4];
  {
    // where the two rows' queries start in q (-1: no real token)
    const int64_t q_lo = sm_tok[lo] >= 0 ? ((int64_t)sm_tok[lo] * H + kvh * G + (row0 + lo) % G) * D : -1;
    const int64_t q_hi = sm_tok[hi] >= 0 ? ((int64_t)sm_tok[hi] * H + kvh * G + (row0 + hi) % G) * D : -1;
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

  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m_lo = kFloor, m_hi = kFloor, l_lo = 0.f, l_hi = 0.f;  // l: this lane's partial row sums

  // ldmatrix row addresses of this lane within a tile: K, matrix lane / 8 is d-columns
  // 8 (lane / 8) .. + 7 of keys lane % 8 (of an 8-key n-tile); V, matrix lane / 8 is keys
  // 8 ((lane / 8) % 2) + lane % 8 (of a 16-key k-step) and d-columns 8 (lane / 16) .. + 7.
  const int k_lane = (lane % 8) * kStride + (lane / 8) * 16;
  const int v_lane = ((lane / 8) % 2 * 8 + lane % 8) * kStride + (lane / 16) * 16;

  const int tiles = (kv_len + kKeys - 1) / kKeys;
  for (int t = 0; t < tiles; ++t) {
    const int stage = t & 1, tile0 = t * kKeys;
    if constexpr (sizeof(T) == 2) WaitAllAsync();  // this thread's copies of tile t have landed...
    __syncthreads();  // ...and everyone's; tile t - 1's stage and tile t + 1's slots are free to reuse
    if (t + 1 < tiles) {
      LoadTiles<T, D>(p, sm_slots + (stage ^ 1) * kKeys, k_stage(stage ^ 1), v_stage(stage ^ 1), kvh);
      TileSlots(p, table, tile0 + 2 * kKeys, kv_len, sm_slots + stage * kKeys);
    }
    const unsigned char* ks = k_stage(stage);
    const unsigned char* vs = v_stage(stage);

    // S = Q K^T: kKeys / 8 n-tiles of 16 x 8; one ldmatrix.x4 gives two k-steps' B fragments.
    float s[kKeys / 8][4];
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j) {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; kk += 2) {
        uint32_t b[4];
        LoadMatrices(b, ks + j * 8 * kStride + kk * 32 + k_lane);
        M::run(s[j], qa[kk], b[0], b[1]);
        M::run(s[j], qa[kk + 1], b[2], b[3]);
      }
    }
    // Scale, mask (key position <= the row's; no mask below every row's position), online softmax.
    float mx_lo = kFloor, mx_hi = kFloor;
    const bool unmasked = tile0 + kKeys - 1 <= min_pos;
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j) {
      const int key = tile0 + j * 8 + 2 * tq;
      if (unmasked) {
        s[j][0] *= p.score_scale, s[j][1] *= p.score_scale, s[j][2] *= p.score_scale, s[j][3] *= p.score_scale;
      } else {
        s[j][0] = key <= pos_lo ? s[j][0] * p.score_scale : -INFINITY;
        s[j][1] = key + 1 <= pos_lo ? s[j][1] * p.score_scale : -INFINITY;
        s[j][2] = key <= pos_hi ? s[j][2] * p.score_scale : -INFINITY;
        s[j][3] = key + 1 <= pos_hi ? s[j][3] * p.score_scale : -INFINITY;
      }
      mx_lo = fmaxf(mx_lo, fmaxf(s[j][0], s[j][1]));
      mx_hi = fmaxf(mx_hi, fmaxf(s[j][2], s[j][3]));
    }
#pragma unroll
    for (int off = 1; off < 4; off *= 2) {
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, off));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, off));
    }
    const float new_lo = fmaxf(m_lo, mx_lo), new_hi = fmaxf(m_hi, mx_hi);
    const float corr_lo = exp2f(m_lo - new_lo), corr_hi = exp2f(m_hi - new_hi);
    m_lo = new_lo, m_hi = new_hi;
    l_lo *= corr_lo, l_hi *= corr_hi;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] *= corr_lo, o[n][1] *= corr_lo, o[n][2] *= corr_hi, o[n][3] *= corr_hi;
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j) {
      s[j][0] = exp2f(s[j][0] - m_lo), s[j][1] = exp2f(s[j][1] - m_lo);
      s[j][2] = exp2f(s[j][2] - m_hi), s[j][3] = exp2f(s[j][3] - m_hi);
      l_lo += s[j][0] + s[j][1], l_hi += s[j][2] + s[j][3];
    }
    // O += P V: the S accumulators are P's A fragments (two n-tiles make one 16-key k-step); one
    // transposed ldmatrix.x4 gives two n-tiles' B fragments.
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const uint32_t pa[4] = {M::pack(s[2 * kk][0], s[2 * kk][1]), M::pack(s[2 * kk][2], s[2 * kk][3]),
                              M::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              M::pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int n = 0; n < D / 8; n += 2) {
        uint32_t b[4];
        LoadMatricesTransposed(b, vs + kk * 16 * kStride + n * 16 + v_lane);
        M::run(o[n], pa, b[0], b[1]);
        M::run(o[n + 1], pa, b[2], b[3]);
      }
    }
  }

#pragma unroll
  for (int off = 1; off < 4; off *= 2) {
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, off);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, off);
  }
  const float inv_lo = l_lo > 0.f ? p.v_scale / l_lo : 0.f, inv_hi = l_hi > 0.f ? p.v_scale / l_hi : 0.f;
  // Each (token, head) of the tile that is a real token goes to its packed place.
  const int tok_lo = sm_tok[lo], tok_hi = sm_tok[hi];
  const size_t out_lo = ((size_t)tok_lo * H + kvh * G + (row0 + lo) % G) * D;
  const size_t out_hi = ((size_t)tok_hi * H + kvh * G + (row0 + hi) % G) * D;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const int c = n * 8 + 2 * tq;
    if (tok_lo >= 0) StorePair(p.out, out_lo + c, p.out_type, o[n][0] * inv_lo, o[n][1] * inv_lo);
    if (tok_hi >= 0) StorePair(p.out, out_hi + c, p.out_type, o[n][2] * inv_hi, o[n][3] * inv_hi);
  }
  if (p.lse != nullptr && tq == 0) {  // m is in base 2 (the scores carry log2(e)); l is the whole row's sum
    constexpr float kLn2 = 0.6931471805599453f;
    if (tok_lo >= 0) {
      p.lse[(size_t)tok_lo * H + kvh * G + (row0 + lo) % G] = l_lo > 0.f ? (m_lo + log2f(l_lo)) * kLn2 : -INFINITY;
    }
    if (tok_hi >= 0) {
      p.lse[(size_t)tok_hi * H + kvh * G + (row0 + hi) % G] = l_hi > 0.f ? (m_hi + log2f(l_hi)) * kLn2 : -INFINITY;
    }
  }
}

template <typename T, int D, int G>
void Launch(const Params& p, int rows, cudaStream_t stream) {
  constexpr int kSmem = Stages<D>::kBytes;
  // Above 48 KB a kernel must opt in to dynamic shared memory. The opt-in belongs to the current
  // device's copy of the kernel, so it is made on every launch (cheap and idempotent), not once
  // per process: with tensor parallelism each device launches its own.
  cudaFuncSetAttribute(PagedPrefillKernel<T, D, G>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  dim3 grid((p.row_width * G + kRows - 1) / kRows, p.kv_heads, rows);
  PagedPrefillKernel<T, D, G><<<grid, kWarps * 32, kSmem, stream>>>(p);
}

}  // namespace
}  // namespace modelopt_jax::cuda::prefill
