// The version of the contract between modelopt_jax's Python side (modelopt_jax/ops/native.py) and the
// native libraries: which FFI handlers a library exports, and each handler's operands, results and
// attributes. Both libraries (libmodelopt_jax_ffi_cpu.so, libmodelopt_jax_ffi_cuda.so) export it as
// ModeloptJaxFfiAbiVersion(); native.py loads a library only when it equals native.ABI_VERSION.
// A library from an older build then counts as absent (the XLA paths run, and a warning says to
// rebuild) instead of being probed symbol by symbol and half used.
//
// Bump it, here and in native.py, with any change to a handler's signature or the set of handlers.
//   1: fp8_gemm, fp8_grouped_gemm (+ workspace result), paged_decode(_write, _poisoned) with
//      (max, sum) partials at one split, paged_prefill(_lse, _poisoned); dlpack release; finite scan.
#pragma once

#define MODELOPT_JAX_FFI_ABI_VERSION 1
