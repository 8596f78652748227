// XLA FFI handlers of the modelopt_paged_decode ops: one query token per sequence attends over that
// sequence's pages of the paged KV cache (the kernels and their design: paged_decode_kernel.cuh).
//   modelopt_paged_decode           q, pools, block tables, lengths -> out, split partials
//   modelopt_paged_decode_write     the same, and this step's keys/values written into their slots
//                                   by the kernel (the pools come back as results, aliased)
//   modelopt_paged_decode_poisoned  tests: the output aliased to a NaN-filled operand
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <utility>

#include "paged_decode_kernel.cuh"
#include "paged_pool.h"
#include "xla/ffi/api/ffi.h"

namespace modelopt_jax::cuda::decode {
namespace {

namespace ffi = xla::ffi;
using paged::DimsToString;

constexpr paged::Op kOp{"modelopt_paged_decode"};

// The fused write's operands (modelopt_paged_decode_write): this step's stored rows, their slots,
// and the pools as results (aliased to the pool operands, so XLA updates them in place).
struct NewTokens {
  ffi::AnyBuffer k, v;
  ffi::Buffer<ffi::S32> slots;
  ffi::AnyBuffer k_pool, v_pool;  // the results
};

ffi::Error Decode(cudaStream_t stream, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                  ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lengths, ffi::Result<ffi::Buffer<ffi::F32>> out,
                  ffi::Result<ffi::Buffer<ffi::F32>> part_o, ffi::Result<ffi::Buffer<ffi::F32>> part_ml, float k_scale,
                  float v_scale, float softmax_scale, int32_t page, int32_t variant, const NewTokens* write) {
  paged::Pool pool;
  if (auto err = paged::ParsePool(kOp, "batch", q.dimensions(), k, v, page, &pool); err.failure()) return err;
  const int64_t batch = pool.tokens, heads = pool.heads, d = pool.head_dim, kv_heads = pool.kv_heads, g = pool.group;
  const auto td = tables.dimensions();
  if (td.size() != 2 || td[0] != batch) {
    return kOp.Invalid("block_tables must be [" + std::to_string(batch) + ", pages], got " + DimsToString(td));
  }
  if (lengths.dimensions().size() != 1 || lengths.dimensions()[0] != batch) {
    return kOp.Invalid("lengths must be [" + std::to_string(batch) + "], got " + DimsToString(lengths.dimensions()));
  }
  const auto od = out->dimensions(), pd = part_o->dimensions(), md = part_ml->dimensions();
  if (od.size() != 3 || od[0] != batch || od[1] != heads || od[2] != d) return kOp.Invalid("out must have q's shape");
  if (pd.size() != 5 || pd[0] != batch || pd[1] != kv_heads || pd[3] != g || pd[4] != d || pd[2] < 1) {
    return kOp.Invalid("partial_o must be [batch, kv_heads, splits, group, head_dim], got " + DimsToString(pd));
  }
  if (md.size() != 5 || md[0] != batch || md[1] != kv_heads || md[2] != pd[2] || md[3] != g || md[4] != 2) {
    return kOp.Invalid("partial_ml must be [batch, kv_heads, splits, group, 2], got " + DimsToString(md));
  }
  if (batch > 65535) return kOp.Invalid("batch " + std::to_string(batch) + " exceeds 65535");
  if (variant != kStagedKernel && variant != kMmaKernel) {
    return kOp.Invalid("variant must be 1 (staged) or 2 (mma), got " + std::to_string(variant));
  }
  if (batch == 0) return ffi::Error::Success();

  Params p;
  p.q = q.typed_data(), p.k = k.untyped_data(), p.v = v.untyped_data();
  p.tables = tables.typed_data(), p.lengths = lengths.typed_data();
  p.out = out->typed_data(), p.part_o = part_o->typed_data(), p.part_ml = part_ml->typed_data();
  p.kv_heads = static_cast<int>(kv_heads), p.table_width = static_cast<int>(td[1]), p.page = pool.page;
  p.page_shift = pool.page_shift, p.splits = static_cast<int>(pd[2]);
  p.q_scale = pool.ScoreScale(softmax_scale, k_scale), p.v_scale = pool.ValueScale(v_scale);
  p.variant = variant;
  p.new_k = p.new_v = nullptr, p.slots = nullptr, p.num_slots = pool.slots;
  if (write != nullptr) {
    const auto nd = write->k.dimensions();
    if (nd.size() != 3 || nd[0] != batch || nd[1] != kv_heads || nd[2] != d) {
      return kOp.Invalid("new keys must be [" + std::to_string(batch) + ", " + std::to_string(kv_heads) + ", " +
                         std::to_string(d) + "], got " + DimsToString(nd));
    }
    const auto vd = write->v.dimensions();
    if (vd.size() != 3 || vd[0] != nd[0] || vd[1] != nd[1] || vd[2] != nd[2]) {
      return kOp.Invalid("new values must have the new keys' shape " + DimsToString(nd) + ", got " + DimsToString(vd));
    }
    if (write->k.element_type() != k.element_type() || write->v.element_type() != k.element_type()) {
      return kOp.Invalid("new keys and values must be stored in the pool's dtype");
    }
    if (write->slots.dimensions().size() != 1 || write->slots.dimensions()[0] != batch) {
      return kOp.Invalid("slots must be [" + std::to_string(batch) + "], got " + DimsToString(write->slots.dimensions()));
    }
    if (write->k_pool.dimensions().size() != 3 || write->k_pool.dimensions()[0] != pool.slots ||
        write->v_pool.dimensions().size() != 3 || write->v_pool.dimensions()[0] != pool.slots) {
      return kOp.Invalid("the written pools must have the pools' shape " + DimsToString(k.dimensions()));
    }
    p.new_k = static_cast<const unsigned char*>(write->k.untyped_data());
    p.new_v = static_cast<const unsigned char*>(write->v.untyped_data());
    p.slots = write->slots.typed_data();
    // Read the pools where they are written: the results (XLA aliases them to the operands; were it
    // to copy instead, the copies are what holds this step's tokens).
    p.k = write->k_pool.untyped_data(), p.v = write->v_pool.untyped_data();
  }

  return paged::Dispatch(kOp, pool, [&](auto pool_type, auto head_dim, auto group) {
    Launch<typename decltype(pool_type)::type, decltype(head_dim)::value, decltype(group)::value>(p, batch, stream);
  });
}

// Tests' variant: one more operand, aliased to the output, that they fill with NaN first, so an
// element the kernel fails to write shows.
ffi::Error PagedDecodeCuda(cudaStream_t stream, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lengths,
                           ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Result<ffi::Buffer<ffi::F32>> part_o,
                           ffi::Result<ffi::Buffer<ffi::F32>> part_ml, float k_scale, float v_scale,
                           float softmax_scale, int32_t page, int32_t variant) {
  return Decode(stream, q, k, v, tables, lengths, out, part_o, part_ml, k_scale, v_scale, softmax_scale, page, variant,
                nullptr);
}

// modelopt_paged_decode_write: this step's keys/values (already in the pool's dtype: the FP8 codes
// XLA quantized, exactly as a scatter would store them) written into their slots by the decode
// kernel itself, then attended over; the pools come back as results 3 and 4.
ffi::Error PagedDecodeWriteCuda(cudaStream_t stream, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer new_k,
                                ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                                ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Result<ffi::Buffer<ffi::F32>> part_o,
                                ffi::Result<ffi::Buffer<ffi::F32>> part_ml, ffi::Result<ffi::AnyBuffer> k_pool,
                                ffi::Result<ffi::AnyBuffer> v_pool, float k_scale, float v_scale, float softmax_scale,
                                int32_t page, int32_t variant) {
  const NewTokens write{new_k, new_v, slots, *k_pool, *v_pool};
  return Decode(stream, q, k, v, tables, lengths, out, part_o, part_ml, k_scale, v_scale, softmax_scale, page, variant,
                &write);
}

ffi::Error PagedDecodeCudaPoisoned(cudaStream_t stream, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                   ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lengths,
                                   ffi::Buffer<ffi::F32> /*out_init, aliased to out*/,
                                   ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Result<ffi::Buffer<ffi::F32>> part_o,
                                   ffi::Result<ffi::Buffer<ffi::F32>> part_ml, float k_scale, float v_scale,
                                   float softmax_scale, int32_t page, int32_t variant) {
  return Decode(stream, q, k, v, tables, lengths, out, part_o, part_ml, k_scale, v_scale, softmax_scale, page, variant,
                nullptr);
}

// Results: output [T, H, D], split partials o [T, KV, S, G, D] and (max, sum) [T, KV, S, G, 2] (with one
// split, o is not written but (max, sum) is: the row's log-sum-exp, which cascade attention needs).
template <typename Binding>
auto BindResults(Binding&& b) {  // by reference: a Binding cannot be moved from outside
  return std::move(b).template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

template <typename Binding>
auto BindAttrs(Binding&& b) {
  return std::move(b).template Attr<float>("k_scale")
      .template Attr<float>("v_scale")
      .template Attr<float>("softmax_scale")
      .template Attr<int32_t>("page_size")
      .template Attr<int32_t>("variant");
}

template <typename Binding>
auto BindResultsAndAttrs(Binding b) {
  return BindAttrs(BindResults(std::move(b)));
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
}  // namespace modelopt_jax::cuda::decode

XLA_FFI_DEFINE_HANDLER_SYMBOL(ModeloptPagedDecodeCuda, modelopt_jax::cuda::decode::PagedDecodeCuda,
                              modelopt_jax::cuda::decode::BindResultsAndAttrs(modelopt_jax::cuda::decode::BindOperands()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(ModeloptPagedDecodeWriteCuda, modelopt_jax::cuda::decode::PagedDecodeWriteCuda,
                              modelopt_jax::cuda::decode::BindAttrs(
                                  modelopt_jax::cuda::decode::BindResults(modelopt_jax::cuda::decode::BindOperands()
                                                                      .Arg<xla::ffi::AnyBuffer>()  // new keys [T, KV, D]
                                                                      .Arg<xla::ffi::AnyBuffer>()  // new values
                                                                      .Arg<xla::ffi::Buffer<xla::ffi::S32>>())  // slots
                                      .Ret<xla::ffi::AnyBuffer>()    // key pool, aliased to operand 1
                                      .Ret<xla::ffi::AnyBuffer>()),  // value pool, aliased to operand 2
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(ModeloptPagedDecodeCudaPoisoned, modelopt_jax::cuda::decode::PagedDecodeCudaPoisoned,
                              modelopt_jax::cuda::decode::BindResultsAndAttrs(
                                  modelopt_jax::cuda::decode::BindOperands().Arg<xla::ffi::Buffer<xla::ffi::F32>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
