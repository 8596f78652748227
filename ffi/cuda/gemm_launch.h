// What the FFI handler hands to a compiled kernel configuration (no CUTLASS types here, so the
// handler and the per-configuration translation units share it cheaply).
#ifndef MODELOPT_JAX_FFI_CUDA_GEMM_LAUNCH_H_
#define MODELOPT_JAX_FFI_CUDA_GEMM_LAUNCH_H_

#include <cstddef>

#include <cuda_runtime_api.h>

namespace modelopt_jax::cuda {

struct LaunchArgs {
  int m = 0, n = 0, k = 0;
  const void* a = nullptr;          // [M, K] e4m3fn
  const void* b = nullptr;          // [N, K] e4m3fn
  const float* row_scale = nullptr; // [M] or null
  const float* col_scale = nullptr; // [N] or null
  const float* bias = nullptr;      // [N] or null
  void* out = nullptr;              // [M, N] bf16 or fp16
  bool out_bf16 = true;
  float alpha = 1.0f;
  cudaStream_t stream = nullptr;
  int device = 0;
  int sm_count = 0;
  int swizzle = 1;  // persistent scheduler: tiles swizzled in groups of 1, 2, 4 or 8 (L2 reuse)
  int raster = 0;   // 0 heuristic, 1 along M, 2 along N
};

// What a missing scale vector stands for in the epilogue out = token[m] * (channel[n] * acc) + bias[n]:
// alpha rides on a missing token scale if there is one, else on a missing channel scale (the
// handler rejects alpha != 1 with both present). Every kernel of the table follows this one rule.
struct MissingScales {
  float token = 1.0f;    // used where row_scale is null
  float channel = 1.0f;  // used where col_scale is null
};

inline MissingScales MissingScaleValues(const LaunchArgs& p) {
  MissingScales v;
  if (p.row_scale == nullptr) {
    v.token = p.alpha;
  } else if (p.col_scale == nullptr) {
    v.channel = p.alpha;
  }
  return v;
}

enum class LaunchStatus { kOk, kCannotImplement, kWorkspace, kInitialize, kRun };

using LaunchFn = LaunchStatus (*)(const LaunchArgs&);

struct KernelConfig {
  const char* name;   // e.g. "sm90 swapab 64x16x256 c1x1 ws"
  LaunchFn run;
};

// Per-architecture tables (defined in the sm90 / sm100 translation units).
extern const KernelConfig kSm90Configs[];
extern const int kNumSm90Configs;
int ChooseSm90Config(int m, int n, int k);
extern const KernelConfig kSm100Configs[];
extern const int kNumSm100Configs;
int ChooseSm100Config(int m, int n, int k);

}  // namespace modelopt_jax::cuda

#endif  // MODELOPT_JAX_FFI_CUDA_GEMM_LAUNCH_H_
