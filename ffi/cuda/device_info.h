// Compute capability and SM count of a CUDA device, queried once per device, the text of a launch
// status and the configuration-name export: shared by the dense and grouped GEMM handlers.
#ifndef MODELOPT_JAX_FFI_CUDA_DEVICE_INFO_H_
#define MODELOPT_JAX_FFI_CUDA_DEVICE_INFO_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "gemm_launch.h"

namespace modelopt_jax::cuda {

struct DeviceInfo {
  int major = 0, minor = 0, sm_count = 0;
};

// Returned by value: another device's thread may resize the cache (moving its elements) as soon
// as the lock is released, so a reference into it could dangle.
inline DeviceInfo GetDeviceInfo(int device) {
  static std::mutex mu;
  static std::vector<DeviceInfo> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (device >= static_cast<int>(cache.size())) cache.resize(device + 1);
  DeviceInfo& info = cache[device];
  if (info.major == 0) {
    cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, device);
    cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount, device);
  }
  return info;
}

inline const char* StatusText(LaunchStatus s) {
  switch (s) {
    case LaunchStatus::kOk: return "ok";
    case LaunchStatus::kCannotImplement: return "CUTLASS cannot implement this problem (alignment: K % 16, N % 8)";
    case LaunchStatus::kWorkspace: return "this configuration needs a workspace, which is not supported";
    case LaunchStatus::kInitialize: return "CUTLASS initialize failed";
    case LaunchStatus::kRun: return "the kernel failed to launch or run";
  }
  return "unknown";
}

// For the exported *ConfigName functions: copies the name of `table[index]` (a table of `count`
// configurations with a `name` member) into `buffer` of `size` bytes, NUL-terminated; returns `count`.
template <class Config>
int CopyConfigName(const Config* table, int count, int index, char* buffer, int size) {
  if (table && index >= 0 && index < count && buffer && size > 0) {
    std::string name = table[index].name;
    name.copy(buffer, size - 1);
    buffer[std::min<int>(name.size(), size - 1)] = '\0';
  }
  return count;
}

}  // namespace modelopt_jax::cuda

#endif  // MODELOPT_JAX_FFI_CUDA_DEVICE_INFO_H_
