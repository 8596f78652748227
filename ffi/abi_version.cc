// ModeloptJaxFfiAbiVersion: compiled into each native library (see abi_version.h).
#include <cstdint>

#include "abi_version.h"

extern "C" __attribute__((visibility("default"))) int32_t ModeloptJaxFfiAbiVersion() {
  return MODELOPT_JAX_FFI_ABI_VERSION;
}
