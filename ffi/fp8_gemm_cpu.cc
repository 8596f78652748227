// CPU reference implementation of the modelopt_fp8_gemm XLA FFI op.
//
// Same operands, attributes, validation and epilogue order as the CUDA (CUTLASS) handler, in
// plain C++: it lets CI on GPU-less machines run the real FFI path (registration, lowering,
// attribute and buffer plumbing) and gives the GPU tests a second reference. Not tuned for speed:
// on CPU the "auto" backend uses XLA's own FP8 dot.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "fp8_gemm_problem.h"

namespace modelopt_jax {
namespace {

// float8_e4m3fn -> float for all 256 codes (1 sign, 4 exponent bits biased by 7, 3 mantissa bits;
// no infinities, 0x7f/0xff are NaN).
struct E4M3Table {
  float value[256];
  E4M3Table() {
    for (int code = 0; code < 256; ++code) {
      int sign = code >> 7, exponent = (code >> 3) & 0xf, mantissa = code & 0x7;
      float v;
      if (exponent == 0xf && mantissa == 0x7) {
        v = NAN;
      } else if (exponent == 0) {
        v = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m/8 * 2^-6
      } else {
        v = std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
      }
      value[code] = sign ? -v : v;
    }
  }
};

const E4M3Table& Table() {
  static const E4M3Table table;
  return table;
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// Round-to-nearest-even float -> bfloat16, NaN stays NaN.
uint16_t ToBF16(float f) {
  uint32_t u = Bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Round-to-nearest-even float -> IEEE half, with overflow to inf and subnormals.
uint16_t ToF16(float f) {
  uint32_t u = Bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;                  // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;                 // rounds to >= 65520: inf
  if (abs < 0x38800000u) {                                       // below 2^-14: subnormal half
    float scaled = std::fabs(f) * 16777216.0f;                   // * 2^24: exact, then round
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  uint32_t mant = abs + 0xfffu + ((abs >> 13) & 1u);
  return sign | static_cast<uint16_t>(((mant - 0x38000000u) >> 13) & 0xffffu);
}

ffi::Error Fp8GemmCpu(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::RemainingArgs extra,
                      ffi::Result<ffi::AnyBuffer> out, float alpha, bool has_row_scale, bool has_col_scale,
                      bool has_bias, bool has_out_init, int32_t tile, int32_t swizzle, int32_t raster) {
  Fp8GemmProblem p;  // tile, swizzle and raster are validated there and unused here (CUDA kernel choice)
  if (auto e = ParseFp8GemmProblem(a, b, extra, *out, alpha, has_row_scale, has_col_scale, has_bias, has_out_init,
                                   tile, swizzle, raster, &p);
      e.failure()) {
    return e;
  }
  const float* lut = Table().value;
  const uint8_t* A = static_cast<const uint8_t*>(p.a);
  const uint8_t* B = static_cast<const uint8_t*>(p.b);
  for (int64_t m = 0; m < p.m; ++m) {
    for (int64_t n = 0; n < p.n; ++n) {
      float acc = 0.0f;  // FP8 x FP8 products are exact in float32; accumulate in float32
      for (int64_t k = 0; k < p.k; ++k) acc += lut[A[m * p.k + k]] * lut[B[n * p.k + k]];
      float v = p.alpha * acc;
      if (p.row_scale) v *= p.row_scale[m];
      if (p.col_scale) v *= p.col_scale[n];
      if (p.bias) v += p.bias[n];
      int64_t i = m * p.n + n;
      switch (p.out_type) {
        case OutType::kBF16: static_cast<uint16_t*>(p.out)[i] = ToBF16(v); break;
        case OutType::kF16: static_cast<uint16_t*>(p.out)[i] = ToF16(v); break;
        case OutType::kF32: static_cast<float*>(p.out)[i] = v; break;
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace modelopt_jax

XLA_FFI_DEFINE_HANDLER_SYMBOL(ModeloptFp8GemmCpu, modelopt_jax::Fp8GemmCpu,
                              modelopt_jax::BindFp8GemmOperands(xla::ffi::Ffi::Bind()));
