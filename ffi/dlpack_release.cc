// DLPack deleter for device arrays that view memory owned by someone else (the weight-cache
// daemon's CUDA IPC allocation).
//
// Why C and not a ctypes callback: XLA calls a DLPack deleter whenever the viewing buffer dies,
// which for arrays still alive at interpreter exit is *after* Python has finalized; a Python
// callback then crashes the process. This function touches no Python state: it only decrements
// the live-view counter that the importer stored in manager_ctx, which Python reads to decide
// when the IPC mapping may be closed. The importer never frees the counter.
#include <atomic>
#include <cstdint>

namespace {
// The two leading members of DLManagedTensor we need; the layout is fixed by the DLPack ABI.
struct DLTensorPrefix {
  void* data;
  int32_t device_type, device_id;
  int32_t ndim;
  uint8_t code, bits;
  uint16_t lanes;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensorPrefix {
  DLTensorPrefix dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorPrefix*);
};
}  // namespace

extern "C" __attribute__((visibility("default"))) void ModeloptJaxDlpackRelease(DLManagedTensorPrefix* tensor) {
  if (tensor == nullptr || tensor->manager_ctx == nullptr) return;
  reinterpret_cast<std::atomic<int64_t>*>(tensor->manager_ctx)->fetch_sub(1, std::memory_order_acq_rel);
}

// The importer's increment, atomic with respect to the decrements above (which XLA may run on
// any thread while other views of the same allocation are being created).
extern "C" __attribute__((visibility("default"))) void ModeloptJaxCounterAdd(int64_t* counter, int64_t delta) {
  reinterpret_cast<std::atomic<int64_t>*>(counter)->fetch_add(delta, std::memory_order_acq_rel);
}
