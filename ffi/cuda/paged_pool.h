// The paged KV pool as the attention ops' handlers see it: their shared operands (q and the two
// pools) parsed and checked once, the errors they return, and the dispatch over what their kernels
// are compiled for (pool dtype x head_dim x query heads per kv head). The decode and the prefill
// handlers (paged_decode.cu, paged_prefill.cu) each used to spell all of this out; one parser means
// they accept and refuse the same pools with the same messages, as fp8_gemm_problem.h does for the
// GEMMs' CPU and CUDA handlers.
//
// Pool layout (modelopt_jax.kv_cache.PagedKVCache): keys and values [slots, kv_heads, head_dim] of
// one dtype (bf16, f16 or float8_e4m3fn codes), slot = block_table[row, p // page] * page + p % page.
// q is [tokens, heads, head_dim] (float32; the prefill handler also takes bf16 or f16), heads a multiple
// of kv_heads.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "../ffi_dims.h"
#include "xla/ffi/api/ffi.h"

namespace modelopt_jax::cuda::paged {

namespace ffi = xla::ffi;

using ::modelopt_jax::DimsToString;

// An op's errors, each prefixed with its target name, so a failing call says which op refused.
struct Op {
  const char* name;  // the FFI target, e.g. "modelopt_paged_decode"

  ffi::Error Invalid(const std::string& what) const {
    return ffi::Error::InvalidArgument(std::string(name) + ": " + what);
  }
  ffi::Error Cuda(cudaError_t err) const {
    return ffi::Error::Internal(std::string(name) + ": " + cudaGetErrorString(err));
  }
};

// What the handlers read from q and the pools.
struct Pool {
  int64_t tokens = 0;    // q's first dimension: decode rows (decode) or packed tokens (prefill)
  int64_t heads = 0;     // query heads
  int64_t kv_heads = 0;  // key/value heads of the pool
  int64_t head_dim = 0;  // of q, keys and values alike
  int64_t group = 0;     // query heads per kv head (heads / kv_heads)
  int64_t slots = 0;     // pool rows: pages x page
  int page = 0;          // tokens per page
  int page_shift = -1;   // log2(page) where page is a power of two (a shift instead of a division), else -1
  ffi::DataType dtype = ffi::DataType::INVALID;  // the pools' element type
  bool fp8 = false;      // dtype is float8_e4m3fn: the key and value scales apply

  // Softmax scale as the kernels apply it to raw scores: with FP8 pages the key scale folds in.
  float ScoreScale(float softmax_scale, float k_scale) const { return softmax_scale * (fp8 ? k_scale : 1.f); }
  // What multiplies the attention output: the value scale with FP8 pages, else 1.
  float ValueScale(float v_scale) const { return fp8 ? v_scale : 1.f; }
};

// Checks q [tokens, heads, head_dim] against the pools [slots, kv_heads, head_dim] and the page
// size; ``q_rows`` names q's first dimension in the messages ("batch", "tokens").
inline ffi::Error ParsePool(const Op& op, const char* q_rows, ffi::Span<const int64_t> qd, const ffi::AnyBuffer& k,
                            const ffi::AnyBuffer& v, int32_t page, Pool* pool) {
  const auto kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 3) {
    return op.Invalid(std::string("q must be [") + q_rows + ", heads, head_dim], got " + DimsToString(qd));
  }
  if (kd.size() != 3) return op.Invalid("k must be [slots, kv_heads, head_dim], got " + DimsToString(kd));
  if (vd.size() != 3 || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2]) {
    return op.Invalid("v must have k's shape " + DimsToString(kd) + ", got " + DimsToString(vd));
  }
  if (k.element_type() != v.element_type()) return op.Invalid("k and v must have one dtype");
  const auto dtype = k.element_type();
  if (dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16 && dtype != ffi::DataType::F8E4M3FN) {
    return op.Invalid("the pool must be bfloat16, float16 or float8_e4m3fn");
  }
  if (kd[2] != qd[2]) return op.Invalid("head_dim of q " + DimsToString(qd) + " and k " + DimsToString(kd) + " differ");
  if (kd[1] <= 0 || qd[1] % kd[1] != 0) {
    return op.Invalid("heads (" + std::to_string(qd[1]) + ") must be a multiple of kv_heads (" +
                      std::to_string(kd[1]) + ")");
  }
  if (page <= 0 || kd[0] % page != 0) {
    return op.Invalid("page_size " + std::to_string(page) + " must divide the pool's slots " + std::to_string(kd[0]));
  }
  pool->tokens = qd[0], pool->heads = qd[1], pool->head_dim = qd[2];
  pool->kv_heads = kd[1], pool->group = qd[1] / kd[1], pool->slots = kd[0];
  pool->page = page, pool->page_shift = (page & (page - 1)) == 0 ? __builtin_ctz(page) : -1;
  pool->dtype = dtype, pool->fp8 = dtype == ffi::DataType::F8E4M3FN;
  return ffi::Error::Success();
}

// The compile-time choices a kernel is instantiated for, passed to a launch callback as values.
template <typename T>
struct PoolType {
  using type = T;  // __nv_bfloat16, __half or __nv_fp8_e4m3
};
template <int N>
using Int = std::integral_constant<int, N>;

constexpr int kMaxGroup = 8;  // query heads per kv head the kernels are compiled for: 1 .. kMaxGroup

namespace detail {
template <typename Tag, int D, typename Launch, int... Gs>
bool DispatchGroup(int group, Launch& launch, std::integer_sequence<int, Gs...>) {
  return ((group == Gs + 1 ? (launch(Tag{}, Int<D>{}, Int<Gs + 1>{}), true) : false) || ...);
}

template <typename Tag, typename Launch>
bool DispatchHeadDim(int head_dim, int group, Launch& launch) {
  const auto groups = std::make_integer_sequence<int, kMaxGroup>{};
  switch (head_dim) {
    case 64: return DispatchGroup<Tag, 64>(group, launch, groups);
    case 128: return DispatchGroup<Tag, 128>(group, launch, groups);
  }
  return false;
}
}  // namespace detail

// Calls ``launch(PoolType<T>{}, Int<D>{}, Int<G>{})`` for the pool's dtype, head_dim and group, then
// reports a launch failure; a shape no kernel is compiled for is an InvalidArgument naming it.
template <typename Launch>
ffi::Error Dispatch(const Op& op, const Pool& pool, Launch&& launch) {
  const int d = static_cast<int>(pool.head_dim), g = static_cast<int>(pool.group);
  bool launched = false;
  switch (pool.dtype) {
    case ffi::DataType::BF16: launched = detail::DispatchHeadDim<PoolType<__nv_bfloat16>>(d, g, launch); break;
    case ffi::DataType::F16: launched = detail::DispatchHeadDim<PoolType<__half>>(d, g, launch); break;
    case ffi::DataType::F8E4M3FN: launched = detail::DispatchHeadDim<PoolType<__nv_fp8_e4m3>>(d, g, launch); break;
    default: return op.Invalid("the pool must be bfloat16, float16 or float8_e4m3fn");
  }
  if (!launched) {
    return op.Invalid("compiled for head_dim 64 or 128 and 1.." + std::to_string(kMaxGroup) +
                      " query heads per kv head; got head_dim " + std::to_string(pool.head_dim) + ", " +
                      std::to_string(pool.group) + " per kv head");
  }
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return op.Cuda(err);
  return ffi::Error::Success();
}

}  // namespace modelopt_jax::cuda::paged
