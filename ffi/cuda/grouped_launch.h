// What the grouped GEMM's FFI handler hands to a compiled tile configuration (no CUTLASS types
// here, so the handler and the per-configuration translation units share it cheaply).
#ifndef MODELOPT_JAX_FFI_CUDA_GROUPED_LAUNCH_H_
#define MODELOPT_JAX_FFI_CUDA_GROUPED_LAUNCH_H_

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "gemm_launch.h"

namespace modelopt_jax::cuda {

struct GroupedLaunchArgs {
  int m = 0, n = 0, k = 0, groups = 0;
  const void* a = nullptr;              // [M, K] e4m3fn, rows sorted by group
  const void* b = nullptr;              // [G, N, K] e4m3fn
  const int32_t* group_sizes = nullptr; // [G] int32, device memory
  const float* col_scale = nullptr;     // [G, N]
  const float* row_scale = nullptr;     // [M] or null
  void* out = nullptr;                  // [M, N] bf16 or fp16
  bool out_bf16 = true;
  cudaStream_t stream = nullptr;
  int device = 0;
  int sm_count = 0;
};

// A configuration is used in two steps: the handler asks how many bytes of device workspace it
// needs (the per-group problem table the setup kernel writes, plus CUTLASS's own: TMA descriptors
// and the tile scheduler's), allocates them from XLA, then runs.
using GroupedWorkspaceFn = size_t (*)(const GroupedLaunchArgs&);
using GroupedRunFn = LaunchStatus (*)(const GroupedLaunchArgs&, void* workspace);

struct GroupedKernelConfig {
  const char* name;  // e.g. "sm90 grouped swapab 64x16x256 pingpong"
  GroupedWorkspaceFn workspace_bytes;
  GroupedRunFn run;
};

extern const GroupedKernelConfig kSm90GroupedConfigs[];
extern const int kNumSm90GroupedConfigs;
// Picks a configuration from the static shape only (group sizes are device data): M / G is the
// rows an expert gets under uniform routing.
int ChooseSm90GroupedConfig(int m, int n, int k, int groups);
extern const GroupedKernelConfig kSm100GroupedConfigs[];
extern const int kNumSm100GroupedConfigs;
int ChooseSm100GroupedConfig(int m, int n, int k, int groups);

}  // namespace modelopt_jax::cuda

#endif  // MODELOPT_JAX_FFI_CUDA_GROUPED_LAUNCH_H_
