// CPU implementation of the modelopt_fp8_gemm XLA FFI op.
//
// Same operands, attributes, validation and epilogue order as the CUDA (CUTLASS) handler, in
// plain C++: it lets CI on GPU-less machines run the real FFI path (registration, lowering,
// attribute and buffer plumbing) and gives the GPU tests a second reference. It is also what
// "auto" runs on CPU for small M (decode steps): XLA:CPU converts the whole FP8 weight to float
// on every call, which costs more than the product when M is small, while this handler decodes
// each weight row once into a cache-resident buffer and streams the activations past it
// (bench/RESULTS.md, "FP8 GEMM on CPU"). Not a tuned GEMM: for large M XLA's dot is faster.
//
// Accumulation is in float32 (FP8 x FP8 products are exact in float32), in kLanes partial sums
// per output (k mod kLanes) added in lane order at the end: the order is fixed by this source, not
// by the instruction set the compiler picks, so every machine computes the same bits.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fp8_gemm_problem.h"
#include "fp8_grouped_gemm_problem.h"

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

constexpr int kLanes = 16;  // partial sums per output, k mod 16 (see the top of the file)
constexpr int kRows = 4;    // weight rows decoded and used together: each activation row streams once per kRows outputs
constexpr int64_t kRowBlock = 64;  // activation rows decoded at a time (bounds the buffer; weights decode once per block)
// Eight lanes per vector, two vectors per output: written out by hand below, since GCC spills an
// array of vector accumulators to the stack.
typedef float Vec __attribute__((vector_size(8 * sizeof(float))));

#if defined(__x86_64__) && defined(__GNUC__)
#define MODELOPT_JAX_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define MODELOPT_JAX_CLONES
#endif

__attribute__((always_inline)) inline Vec Load(const float* p) {  // inlined: no vector ABI between clones
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// `count` e4m3fn codes to float, zero-padded to `padded` (a multiple of kLanes; zeros add nothing
// to a dot product). A normal code's exponent and mantissa shifted into a float's, the exponent
// rebased by 127 - 7; a subnormal's mantissa times 2^-9, converted exactly (never a denormal float,
// which XLA's threads flush to zero); 0x7F/0xFF become NaN. Written as scalar code in blocks of 16,
// which the compiler vectorises (GCC scalarises a byte-vector conversion written with vector types).
MODELOPT_JAX_CLONES
void Decode(const uint8_t* in, int64_t count, int64_t padded, const float* lut, float* out) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    for (int j = 0; j < 16; ++j) {
      const uint32_t code = in[i + j], sign = (code & 0x80u) << 24, magnitude = code & 0x7fu;
      const float subnormal = static_cast<float>(static_cast<int32_t>(magnitude & 7u)) * 0x1p-9f;
      uint32_t sub_bits;
      std::memcpy(&sub_bits, &subnormal, sizeof(sub_bits));
      const uint32_t is_subnormal = 0u - static_cast<uint32_t>((magnitude >> 3) == 0);  // masks, not branches
      const uint32_t is_nan = 0u - static_cast<uint32_t>(magnitude == 0x7fu);
      uint32_t bits = (sub_bits & is_subnormal) | (((magnitude << 20) + (120u << 23)) & ~is_subnormal);
      bits = sign | (bits & ~is_nan) | (0x7fc00000u & is_nan);
      std::memcpy(out + i + j, &bits, sizeof(bits));
    }
  }
  for (; i < count; ++i) out[i] = lut[in[i]];
  for (; i < padded; ++i) out[i] = 0.0f;
}

// Lanes 0..15 (k mod 16) of one output, added in lane order.
__attribute__((always_inline)) inline float Total(Vec lo, Vec hi) {
  float total = 0.0f;
  for (int lane = 0; lane < 8; ++lane) total += lo[lane];
  for (int lane = 0; lane < 8; ++lane) total += hi[lane];
  return total;
}

// acc[r] = sum_k x[k] * w[r * kp + k] for kRows = 4 weight rows; kp is a multiple of kLanes.
// Products of decoded FP8 values are exact in float32, so a fused multiply-add gives the same bits.
MODELOPT_JAX_CLONES
void Dots(const float* x, const float* w, int64_t kp, float* acc) {
  static_assert(kRows == 4 && kLanes == 16, "the loop below is written out for 4 rows of 2 vectors");
  const float *w0 = w, *w1 = w + kp, *w2 = w + 2 * kp, *w3 = w + 3 * kp;
  Vec a0 = {}, b0 = {}, a1 = {}, b1 = {}, a2 = {}, b2 = {}, a3 = {}, b3 = {};
  for (int64_t k = 0; k < kp; k += kLanes) {
    const Vec xa = Load(x + k), xb = Load(x + k + 8);
    a0 += xa * Load(w0 + k), b0 += xb * Load(w0 + k + 8);
    a1 += xa * Load(w1 + k), b1 += xb * Load(w1 + k + 8);
    a2 += xa * Load(w2 + k), b2 += xb * Load(w2 + k + 8);
    a3 += xa * Load(w3 + k), b3 += xb * Load(w3 + k + 8);
  }
  acc[0] = Total(a0, b0), acc[1] = Total(a1, b1), acc[2] = Total(a2, b2), acc[3] = Total(a3, b3);
}

inline void Store(const Fp8GemmProblem& p, int64_t i, float v) {
  switch (p.out_type) {
    case OutType::kBF16: static_cast<uint16_t*>(p.out)[i] = ToBF16(v); break;
    case OutType::kF16: static_cast<uint16_t*>(p.out)[i] = ToF16(v); break;
    case OutType::kF32: static_cast<float*>(p.out)[i] = v; break;
  }
}

// The blocked product of one problem; shared by the dense op and each group of the grouped op.
void RunGemm(const Fp8GemmProblem& p) {
  const float* lut = Table().value;
  const uint8_t* A = static_cast<const uint8_t*>(p.a);
  const uint8_t* B = static_cast<const uint8_t*>(p.b);
  const int64_t kp = (p.k + kLanes - 1) / kLanes * kLanes;
  const int64_t block = p.m < kRowBlock ? p.m : kRowBlock;
  std::vector<float> x(block * kp), w(kRows * kp);
  for (int64_t m0 = 0; m0 < p.m; m0 += block) {
    const int64_t m1 = p.m - m0 < block ? p.m : m0 + block;
    for (int64_t m = m0; m < m1; ++m) Decode(A + m * p.k, p.k, kp, lut, x.data() + (m - m0) * kp);
    for (int64_t n0 = 0; n0 < p.n; n0 += kRows) {
      const int rows = p.n - n0 < kRows ? static_cast<int>(p.n - n0) : kRows;
      for (int r = 0; r < kRows; ++r) {  // rows past N decode as zeros and are never stored
        Decode(B + (n0 + (r < rows ? r : 0)) * p.k, r < rows ? p.k : 0, kp, lut, w.data() + r * kp);
      }
      for (int64_t m = m0; m < m1; ++m) {
        float acc[kRows];
        Dots(x.data() + (m - m0) * kp, w.data(), kp, acc);
        for (int r = 0; r < rows; ++r) {
          const int64_t n = n0 + r;
          float v = p.alpha * acc[r];
          if (p.row_scale) v *= p.row_scale[m];
          if (p.col_scale) v *= p.col_scale[n];
          if (p.bias) v += p.bias[n];
          Store(p, m * p.n + n, v);
        }
      }
    }
  }
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
  RunGemm(p);
  return ffi::Error::Success();
}

// Each group is a dense problem over its rows and its weight; rows past the groups' sum are zeros.
ffi::Error Fp8GroupedGemmCpu(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer group_sizes, ffi::AnyBuffer col_scale,
                             ffi::RemainingArgs extra, ffi::Result<ffi::AnyBuffer> out, bool has_row_scale,
                             int32_t tile) {
  Fp8GroupedGemmProblem g;
  if (auto e = ParseFp8GroupedGemmProblem(a, b, group_sizes, col_scale, extra, *out, has_row_scale, tile, &g);
      e.failure()) {
    return e;
  }
  int64_t total = 0;
  for (int64_t i = 0; i < g.groups; ++i) {
    if (g.group_sizes[i] < 0 || total + g.group_sizes[i] > g.m) {
      return InvalidGrouped("group_sizes must be >= 0 and sum to at most M = " + std::to_string(g.m) + "; group " +
                            std::to_string(i) + " has " + std::to_string(g.group_sizes[i]) + " rows after " +
                            std::to_string(total));
    }
    total += g.group_sizes[i];
  }
  const size_t elem = g.out_type == OutType::kF32 ? 4 : 2;
  std::memset(static_cast<char*>(g.out) + total * g.n * elem, 0, (g.m - total) * g.n * elem);
  int64_t offset = 0;
  for (int64_t i = 0; i < g.groups; ++i) {
    Fp8GemmProblem p;
    p.m = g.group_sizes[i];
    p.n = g.n;
    p.k = g.k;
    p.a = static_cast<const uint8_t*>(g.a) + offset * g.k;
    p.b = static_cast<const uint8_t*>(g.b) + i * g.n * g.k;
    p.row_scale = g.row_scale ? g.row_scale + offset : nullptr;
    p.col_scale = g.col_scale + i * g.n;
    p.out = static_cast<char*>(g.out) + offset * g.n * elem;
    p.out_type = g.out_type;
    if (p.m) RunGemm(p);
    offset += p.m;
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace modelopt_jax

XLA_FFI_DEFINE_HANDLER_SYMBOL(ModeloptFp8GemmCpu, modelopt_jax::Fp8GemmCpu,
                              modelopt_jax::BindFp8GemmOperands(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ModeloptFp8GroupedGemmCpu, modelopt_jax::Fp8GroupedGemmCpu,
                              modelopt_jax::BindFp8GroupedGemmOperands(xla::ffi::Ffi::Bind()));
