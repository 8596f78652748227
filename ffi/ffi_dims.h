// A buffer's dimensions as text ("[4, 8, 128]"), for the handlers' error messages: the GEMMs'
// (fp8_gemm_problem.h) and the paged attention ops' (cuda/paged_pool.h) name shapes the same way.
#ifndef MODELOPT_JAX_FFI_FFI_DIMS_H_
#define MODELOPT_JAX_FFI_FFI_DIMS_H_

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace modelopt_jax {

inline std::string DimsToString(xla::ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

}  // namespace modelopt_jax

#endif  // MODELOPT_JAX_FFI_FFI_DIMS_H_
