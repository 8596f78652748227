// XLA FFI handlers of the modelopt_paged_prefill ops: prompt chunks attend over their sequences'
// pages of the paged KV cache, causally (the kernel and its design: paged_prefill_kernel.cuh).
//   modelopt_paged_prefill           q, pools, block tables, row tokens, positions -> out
//   modelopt_paged_prefill_lse       the same and each (token, head)'s log-sum-exp (cascade attention)
//   modelopt_paged_prefill_poisoned  tests: the output aliased to a NaN-filled operand
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <utility>

#include "paged_prefill_kernel.cuh"
#include "paged_pool.h"
#include "xla/ffi/api/ffi.h"

namespace modelopt_jax::cuda::prefill {
namespace {

namespace ffi = xla::ffi;
using paged::DimsToString;

constexpr paged::Op kOp{"modelopt_paged_prefill"};

// q's or the output's element type as the kernel reads or writes it; false: not one it serves.
bool IoOf(ffi::DataType type, Io* io) {
  switch (type) {
    case ffi::DataType::F32: *io = Io::kF32; return true;
    case ffi::DataType::BF16: *io = Io::kBF16; return true;
    case ffi::DataType::F16: *io = Io::kF16; return true;
    default: return false;
  }
}

// The handlers' body; ``lse`` ([tokens, heads] floats) only for the log-sum-exp variant, else null.
// q and out are each float32, bf16 or f16 (the engine passes its compute dtype for both).
ffi::Error PagedPrefill(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> row_tokens, ffi::Buffer<ffi::S32> positions,
                        ffi::Result<ffi::AnyBuffer> out, float k_scale, float v_scale, float softmax_scale,
                        int32_t page, float* lse) {
  paged::Pool pool;
  if (auto err = paged::ParsePool(kOp, "tokens", q.dimensions(), k, v, page, &pool); err.failure()) return err;
  const auto qd = q.dimensions(), td = tables.dimensions(), rd = row_tokens.dimensions();
  const int64_t tokens = pool.tokens;
  if (td.size() != 2) return kOp.Invalid("block_tables must be [rows, pages], got " + DimsToString(td));
  if (rd.size() != 2 || rd[0] != td[0]) {
    return kOp.Invalid("row_tokens must be [" + std::to_string(td[0]) + ", row_width], got " + DimsToString(rd));
  }
  if (positions.dimensions().size() != 1 || positions.dimensions()[0] != tokens) {
    return kOp.Invalid("positions must be [" + std::to_string(tokens) + "], got " + DimsToString(positions.dimensions()));
  }
  const int64_t rows = td[0], row_width = rd[1];
  const auto od = out->dimensions();
  if (od.size() != 3 || od[0] != tokens || od[1] != pool.heads || od[2] != pool.head_dim) {
    return kOp.Invalid("out must be q's shape " + DimsToString(qd) + ", got " + DimsToString(od));
  }
  if (rows > 65535 || pool.kv_heads > 65535) return kOp.Invalid("rows and kv_heads must be at most 65535");
  Io q_type, out_type;
  if (!IoOf(q.element_type(), &q_type)) return kOp.Invalid("q must be float32, bfloat16 or float16");
  if (!IoOf(out->element_type(), &out_type)) return kOp.Invalid("out must be float32, bfloat16 or float16");
  // tokens in no row (step padding) keep these zeros; the kernel writes every other one. The
  // log-sum-exp variant skips this: its caller (cascade attention) reads only the tokens of rows
  // with a real position, and masks the rest.
  if (lse == nullptr) {
    if (cudaError_t err = cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream); err != cudaSuccess) {
      return kOp.Cuda(err);
    }
  }
  if (rows == 0 || row_width == 0) return ffi::Error::Success();

  Params p;
  p.q = q.untyped_data(), p.k = k.untyped_data(), p.v = v.untyped_data();
  p.tables = tables.typed_data(), p.row_tokens = row_tokens.typed_data(), p.positions = positions.typed_data();
  p.out = out->untyped_data();
  p.q_type = q_type, p.out_type = out_type;
  p.lse = lse;
  p.tokens = static_cast<int>(tokens), p.kv_heads = static_cast<int>(pool.kv_heads);
  p.table_width = static_cast<int>(td[1]), p.row_width = static_cast<int>(row_width), p.page = pool.page;
  p.page_shift = pool.page_shift;
  p.score_scale = pool.ScoreScale(softmax_scale, k_scale) * kLog2e;
  p.v_scale = pool.ValueScale(v_scale);
  return paged::Dispatch(kOp, pool, [&](auto pool_type, auto head_dim, auto group) {
    Launch<typename decltype(pool_type)::type, decltype(head_dim)::value, decltype(group)::value>(p, rows, stream);
  });
}

ffi::Error PagedPrefillCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> row_tokens,
                            ffi::Buffer<ffi::S32> positions, ffi::Result<ffi::AnyBuffer> out, float k_scale,
                            float v_scale, float softmax_scale, int32_t page) {
  return PagedPrefill(stream, q, k, v, tables, row_tokens, positions, out, k_scale, v_scale, softmax_scale, page,
                      nullptr);
}

// Tests' variant: one more operand, aliased to the output, that they fill with NaN first, so an
// element the kernel fails to write shows.
ffi::Error PagedPrefillCudaPoisoned(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                    ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> row_tokens,
                                    ffi::Buffer<ffi::S32> positions, ffi::AnyBuffer /*out_init*/,
                                    ffi::Result<ffi::AnyBuffer> out, float k_scale, float v_scale,
                                    float softmax_scale, int32_t page) {
  return PagedPrefillCuda(stream, q, k, v, tables, row_tokens, positions, out, k_scale, v_scale, softmax_scale, page);
}

// The cascade attention's variant: a second result, lse [T, H] float32, the natural log-sum-exp of
// each (token, head)'s scaled scores (-inf where it saw no key), so that the engine can merge this
// attention over a shared prefix with the decode kernel's over each row's own pages. Unlike the
// plain op, tokens of CTAs without a real position (all -1, or padding) are left unwritten in
// both results: the caller masks them.
ffi::Error PagedPrefillLseCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                               ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> row_tokens,
                               ffi::Buffer<ffi::S32> positions, ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::Buffer<ffi::F32>> lse, float k_scale, float v_scale,
                               float softmax_scale, int32_t page) {
  const auto qd = q.dimensions(), ld = lse->dimensions();
  if (qd.size() != 3 || ld.size() != 2 || ld[0] != qd[0] || ld[1] != qd[1]) {
    return kOp.Invalid("lse must be [tokens, heads] of q " + DimsToString(qd) + ", got " + DimsToString(ld));
  }
  return PagedPrefill(stream, q, k, v, tables, row_tokens, positions, out, k_scale, v_scale, softmax_scale, page,
                      lse->typed_data());
}

template <typename Binding>
auto BindResultsAndAttrs(Binding b) {
  return std::move(b).template Ret<ffi::AnyBuffer>()
      .template Attr<float>("k_scale")
      .template Attr<float>("v_scale")
      .template Attr<float>("softmax_scale")
      .template Attr<int32_t>("page_size");
}

auto BindOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()          // q [T, H, D] float32, bf16 or f16
      .Arg<ffi::AnyBuffer>()          // key pool [slots, KV, D]
      .Arg<ffi::AnyBuffer>()          // value pool
      .Arg<ffi::Buffer<ffi::S32>>()   // block tables [R, W]
      .Arg<ffi::Buffer<ffi::S32>>()   // row tokens [R, Wq]
      .Arg<ffi::Buffer<ffi::S32>>();  // positions [T]
}

}  // namespace
}  // namespace modelopt_jax::cuda::prefill

XLA_FFI_DEFINE_HANDLER_SYMBOL(ModeloptPagedPrefillCuda, modelopt_jax::cuda::prefill::PagedPrefillCuda,
                              modelopt_jax::cuda::prefill::BindResultsAndAttrs(modelopt_jax::cuda::prefill::BindOperands()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(ModeloptPagedPrefillLseCuda, modelopt_jax::cuda::prefill::PagedPrefillLseCuda,
                              modelopt_jax::cuda::prefill::BindOperands()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<float>("k_scale")
                                  .Attr<float>("v_scale")
                                  .Attr<float>("softmax_scale")
                                  .Attr<int32_t>("page_size"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(ModeloptPagedPrefillCudaPoisoned, modelopt_jax::cuda::prefill::PagedPrefillCudaPoisoned,
                              modelopt_jax::cuda::prefill::BindResultsAndAttrs(
                                  modelopt_jax::cuda::prefill::BindOperands().Arg<xla::ffi::AnyBuffer>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
