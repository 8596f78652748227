// DLPack deleter for device arrays that view memory owned by someone else (the weight-cache
// daemon's CUDA IPC allocation).
//
// Why C and not a ctypes callback: XLA calls a DLPack deleter whenever the viewing buffer dies,
// which for arrays still alive at interpreter exit is *after* Python has finalized; a Python
// callback then crashes the process. This function touches no Python state: it decrements the
// live-view count that the importer stored in manager_ctx (a ViewLease), which Python reads to
// decide when the IPC mapping may be closed, and when the count reaches zero it closes the
// client's lease on the daemon (the attach connection, see weight_cache/daemon.py), which is what
// lets a stopping daemon free its allocation: no array of this client views it any more. The
// importer never frees the ViewLease.
#include <unistd.h>

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

// Laid out as the Python side's ctypes structure (dlpack_view._ViewLease): {int64 live; int32 fd}.
struct ViewLease {
  std::atomic<int64_t> live;  // views of the allocation still alive
  std::atomic<int32_t> fd;    // the client's lease connection, -1 once closed (or if there is none)
};

void CloseLease(ViewLease* lease) {
  int32_t fd = lease->fd.exchange(-1, std::memory_order_acq_rel);  // exactly once, whoever gets here first
  if (fd >= 0) close(fd);
}

void Add(ViewLease* lease, int64_t delta) {
  if (lease->live.fetch_add(delta, std::memory_order_acq_rel) + delta == 0) CloseLease(lease);
}
}  // namespace

extern "C" __attribute__((visibility("default"))) void ModeloptJaxDlpackRelease(DLManagedTensorPrefix* tensor) {
  if (tensor == nullptr || tensor->manager_ctx == nullptr) return;
  Add(static_cast<ViewLease*>(tensor->manager_ctx), -1);
}

// The importer's increment (and its decrement when an import fails), atomic with respect to the
// releases above, which XLA may run on any thread while other views are being created.
extern "C" __attribute__((visibility("default"))) void ModeloptJaxCounterAdd(ViewLease* lease, int64_t delta) {
  Add(lease, delta);
}

// Closes the lease now (the IPC mapping is being closed, or the attach failed); idempotent.
extern "C" __attribute__((visibility("default"))) void ModeloptJaxLeaseClose(ViewLease* lease) { CloseLease(lease); }
