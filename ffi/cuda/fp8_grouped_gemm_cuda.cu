// XLA FFI handler of the modelopt_fp8_grouped_gemm op on CUDA: validates the call (the parser the
// CPU handler uses), picks a grouped tile configuration by rows per group (or the one `tile`
// names, for tuning), runs it in the workspace the call's second result provides (sized at trace
// time by ModeloptFp8GroupedGemmWorkspaceBytes; XLA's scratch allocator refused such requests under
// JAX, 2026-12-05) and launches setup, GEMM and tail on XLA's stream (fp8_grouped_gemm_kernel.cuh).
// Every failure returns an ffi::Error; nothing aborts the process.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "../fp8_grouped_gemm_problem.h"
#include "device_info.h"
#include "grouped_launch.h"

namespace modelopt_jax::cuda {
namespace {

// The configurations compiled for the device's compute capability (null where none are).
const GroupedKernelConfig* DeviceConfigs(const DeviceInfo& info, int* count) {
  *count = 0;
#ifdef MODELOPT_JAX_HAVE_SM90
  if (info.major == 9) return *count = kNumSm90GroupedConfigs, kSm90GroupedConfigs;
#endif
#ifdef MODELOPT_JAX_HAVE_SM100
  if (info.major == 10) return *count = kNumSm100GroupedConfigs, kSm100GroupedConfigs;
#endif
  return nullptr;
}

// The workspace every configuration fits: the result the handler gets is this big, whichever runs.
// The base pointer is aligned up to kWorkspaceAlign inside it.
constexpr size_t kWorkspaceAlign = 256;

size_t WorkspaceBound(const GroupedKernelConfig* table, int count, const GroupedLaunchArgs& args) {
  size_t bytes = 0;
  for (int i = 0; i < count; ++i) bytes = std::max(bytes, table[i].workspace_bytes(args));
  return bytes + kWorkspaceAlign;
}

ffi::Error Fp8GroupedGemmCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                              ffi::AnyBuffer group_sizes, ffi::AnyBuffer col_scale, ffi::RemainingArgs extra,
                              ffi::Result<ffi::AnyBuffer> out, bool has_row_scale, int32_t tile,
                              ffi::Result<ffi::AnyBuffer> workspace) {
  Fp8GroupedGemmProblem p;
  if (auto e = ParseFp8GroupedGemmProblem(a, b, group_sizes, col_scale, extra, *out, has_row_scale, tile, &p);
      e.failure()) {
    return e;
  }
  if (p.out_type == OutType::kF32) return InvalidGrouped("the CUDA kernels write bfloat16 or float16, not float32");
  if (p.k % 16 != 0 || p.n % 8 != 0) {
    return InvalidGrouped("K (" + std::to_string(p.k) + ") must be a multiple of 16 and N (" + std::to_string(p.n) +
                          ") of 8 for the CUDA kernels (the rule by which backend 'auto' picks them)");
  }
  if (p.m > INT32_MAX || p.n > INT32_MAX || p.k > INT32_MAX || p.groups > INT32_MAX) {
    return InvalidGrouped("dimensions must fit int32");
  }
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  const size_t out_bytes = static_cast<size_t>(p.m) * p.n * 2;
  if (p.groups == 0) {  // no group: every row is past the (empty) sum
    return cudaMemsetAsync(p.out, 0, out_bytes, stream) == cudaSuccess
               ? ffi::Error::Success()
               : ffi::Error::Internal("modelopt_fp8_grouped_gemm: cudaMemsetAsync failed");
  }
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    return ffi::Error::Internal("modelopt_fp8_grouped_gemm: cudaGetDevice failed");
  }
  const DeviceInfo info = GetDeviceInfo(device);
  int count = 0, chosen = -1;
  const GroupedKernelConfig* table = DeviceConfigs(info, &count);
  const int m = static_cast<int>(p.m), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
  const int groups = static_cast<int>(p.groups);
#ifdef MODELOPT_JAX_HAVE_SM90
  if (info.major == 9) chosen = ChooseSm90GroupedConfig(m, n, k, groups);
#endif
#ifdef MODELOPT_JAX_HAVE_SM100
  if (info.major == 10) chosen = ChooseSm100GroupedConfig(m, n, k, groups);
#endif
  if (table == nullptr) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "modelopt_fp8_grouped_gemm: no grouped kernel compiled for compute capability " +
                          std::to_string(info.major) + "." + std::to_string(info.minor) + " (built for sm90a/sm100a)");
  }
  const int index = p.tile >= 0 ? p.tile : chosen;
  if (index >= count) {
    return InvalidGrouped("tile " + std::to_string(index) + " out of range (" + std::to_string(count) +
                          " grouped configurations compiled for this device)");
  }
  GroupedLaunchArgs args;
  args.m = m, args.n = n, args.k = k, args.groups = groups;
  args.a = p.a, args.b = p.b, args.group_sizes = p.group_sizes;
  args.col_scale = p.col_scale, args.row_scale = p.row_scale, args.out = p.out;
  args.out_bf16 = p.out_type == OutType::kBF16;
  args.stream = stream, args.device = device, args.sm_count = info.sm_count;
  const GroupedKernelConfig& config = table[index];
  const size_t need = config.workspace_bytes(args) + kWorkspaceAlign;
  if (workspace->element_type() != ffi::DataType::U8 || workspace->size_bytes() < need) {
    return InvalidGrouped("the workspace result must be uint8 of at least " + std::to_string(need) +
                          " bytes (ModeloptFp8GroupedGemmWorkspaceBytes), got " +
                          std::to_string(workspace->size_bytes()));
  }
  const uintptr_t base = reinterpret_cast<uintptr_t>(workspace->untyped_data());
  void* aligned = reinterpret_cast<void*>((base + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign);
  const LaunchStatus status = config.run(args, aligned);
  if (status != LaunchStatus::kOk) {
    return ffi::Error::Internal(std::string("modelopt_fp8_grouped_gemm [") + config.name + "] M=" + std::to_string(m) +
                                " N=" + std::to_string(n) + " K=" + std::to_string(k) + " G=" +
                                std::to_string(groups) + ": " + StatusText(status));
  }
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return ffi::Error::Internal(std::string("modelopt_fp8_grouped_gemm [") + config.name + "]: " +
                                cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace modelopt_jax::cuda

// Command-buffer compatible, as the dense handler: everything it enqueues (kernels, a memset) can be
// captured into a CUDA graph, and its host-side choices depend on shapes and attributes only. Without
// it XLA ended a graph at every grouped call: on a 12-layer Qwen3-30B-A3B decode step each layer
// waited 28-85 us for the next graph's launch after its experts (bench/RESULTS.md, 2026-12-07).
XLA_FFI_DEFINE_HANDLER_SYMBOL(ModeloptFp8GroupedGemmCuda, modelopt_jax::cuda::Fp8GroupedGemmCuda,
                              modelopt_jax::BindFp8GroupedGemmOperands(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>())
                                  .Ret<xla::ffi::AnyBuffer>(),  // workspace [W] uint8
                              {xla::ffi::Traits::kCmdBufferCompatible});

// Bytes of the uint8 workspace result a call with these dimensions needs on the current device
// (every configuration fits it, plus alignment slack); -1 where no configuration is compiled for
// the device or the runtime cannot name it. Called at trace time (ops/grouped_gemm.py).
extern "C" long long ModeloptFp8GroupedGemmWorkspaceBytes(int m, int n, int k, int groups, int out_bf16) {
  using namespace modelopt_jax::cuda;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || m < 0 || n < 0 || k < 0 || groups < 0) return -1;
  const DeviceInfo info = GetDeviceInfo(device);
  int count = 0;
  const GroupedKernelConfig* table = DeviceConfigs(info, &count);
  if (table == nullptr) return -1;
  GroupedLaunchArgs args;
  args.m = m, args.n = n, args.k = k, args.groups = groups, args.out_bf16 = out_bf16 != 0;
  args.device = device, args.sm_count = info.sm_count;
  return static_cast<long long>(WorkspaceBound(table, count, args));
}

// Names of the compiled grouped configurations (bench/grouped_gemm.py): returns the count, and
// copies the name of configuration `index` (for compute capability `major`) into `buffer`.
extern "C" int ModeloptFp8GroupedGemmConfigName(int major, int index, char* buffer, int size) {
  const modelopt_jax::cuda::GroupedKernelConfig* table = nullptr;
  int count = 0;
#ifdef MODELOPT_JAX_HAVE_SM90
  if (major == 9) table = modelopt_jax::cuda::kSm90GroupedConfigs, count = modelopt_jax::cuda::kNumSm90GroupedConfigs;
#endif
#ifdef MODELOPT_JAX_HAVE_SM100
  if (major == 10) {
    table = modelopt_jax::cuda::kSm100GroupedConfigs, count = modelopt_jax::cuda::kNumSm100GroupedConfigs;
  }
#endif
  return modelopt_jax::cuda::CopyConfigName(table, count, index, buffer, size);
}
