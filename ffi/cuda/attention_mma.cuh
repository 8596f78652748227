// Tensor-core and async-copy helpers shared by the paged attention kernels (decode and prefill).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace modelopt_jax::cuda::attention {

// The MMA's element type for a pool type: f16 pages run f16 MMAs, bf16 and FP8 pages bf16 ones.
template <typename T>
struct Mma {
  using Elem = __nv_bfloat16;
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <>
struct Mma<__half> {
  using Elem = __half;
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

__device__ __forceinline__ void CopyAsync16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;  // 0: the 16 bytes are zero-filled, nothing is read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void CommitAsync() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void WaitAllAsync() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// ldmatrix: four 8x8 matrices of 16-bit elements from shared memory, one row address per lane
// (lanes 8m .. 8m + 7 give matrix m's rows). Plain: lane t receives row t / 4, elements 2 (t % 4)
// and + 1 -- an MMA B-fragment half when the rows are the fragment's n (keys of a K tile, k along
// d). Transposed: lane t receives elements (2 (t % 4), t / 4) and (2 (t % 4) + 1, t / 4) -- the
// B-fragment half of a tile whose rows run along k (keys of a V tile). One instruction replaces
// four 32-bit (plain) or eight 16-bit (transposed) shared-memory loads per lane.
__device__ __forceinline__ void LoadMatrices(uint32_t (&r)[4], const void* smem) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void LoadMatricesTransposed(uint32_t (&r)[4], const void* smem) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

template <int kPending>
__device__ __forceinline__ void WaitAsync() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory"); }

// MMA B-fragment halves read from a shared-memory tile of pool rows (row = one key's [D] slice in
// the pool's own type T, rows ``stride`` bytes apart), converted to the MMA type: FP8 codes become
// bf16 exactly. ``KeyPair``: elements col, col + 1 of one row (a K fragment: k runs along d);
// ``ValuePair``: element col of rows row and row + 1 (a V fragment: k runs along the keys).
template <typename T>
struct Fragments {
  static __device__ __forceinline__ uint32_t KeyPair(const unsigned char* tile, int stride, int row, int col) {
    return *reinterpret_cast<const uint32_t*>(tile + row * stride + col * 2);
  }
  static __device__ __forceinline__ uint32_t ValuePair(const unsigned char* tile, int stride, int row, int col) {
    const uint32_t lo = *reinterpret_cast<const uint16_t*>(tile + row * stride + col * 2);
    const uint32_t hi = *reinterpret_cast<const uint16_t*>(tile + (row + 1) * stride + col * 2);
    return lo | (hi << 16);
  }
};
template <>
struct Fragments<__nv_fp8_e4m3> {
  static __device__ __forceinline__ uint32_t Convert(__nv_fp8x2_storage_t codes) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(codes, __NV_E4M3);  // exact: e4m3 is a subset of f16 and bf16
    const float2 f = __half22float2(*reinterpret_cast<__half2*>(&h));
    return Mma<__nv_fp8_e4m3>::pack(f.x, f.y);
  }
  static __device__ __forceinline__ uint32_t KeyPair(const unsigned char* tile, int stride, int row, int col) {
    return Convert(*reinterpret_cast<const __nv_fp8x2_storage_t*>(tile + row * stride + col));
  }
  static __device__ __forceinline__ uint32_t ValuePair(const unsigned char* tile, int stride, int row, int col) {
    const unsigned lo = tile[row * stride + col], hi = tile[(row + 1) * stride + col];
    return Convert(static_cast<__nv_fp8x2_storage_t>(lo | (hi << 8)));
  }
};

}  // namespace modelopt_jax::cuda::attention
