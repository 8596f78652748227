"""Finds the compiled XLA FFI libraries and registers their targets with JAX, once, at import.

``libmodelopt_jax_ffi_cpu.so`` (reference C++ handler, always built) and
``libmodelopt_jax_ffi_cuda.so`` (CUTLASS kernels, built when nvcc was found) are installed into
``modelopt_jax/_native``. ``MODELOPT_JAX_NATIVE_DIR`` overrides the search (Bazel sets it). A
missing CUDA library is not an error: the GEMM then uses XLA's FP8 path on GPUs, and a warning
says so the first time a CUDA device is seen.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sysconfig
import warnings

import jax

TARGET = "modelopt_fp8_gemm"
GROUPED_TARGET = "modelopt_fp8_grouped_gemm"  # a sparse layer's experts
PAGED_DECODE_TARGET = "modelopt_paged_decode"
PAGED_DECODE_POISONED_TARGET = "modelopt_paged_decode_poisoned"  # tests: output aliased to a NaN-filled operand
PAGED_DECODE_WRITE_TARGET = "modelopt_paged_decode_write"  # the decode kernel writing this step's keys/values too
PAGED_PREFILL_TARGET = "modelopt_paged_prefill"
PAGED_PREFILL_POISONED_TARGET = "modelopt_paged_prefill_poisoned"
PAGED_PREFILL_LSE_TARGET = "modelopt_paged_prefill_lse"  # also each (token, head)'s log-sum-exp (cascade attention)
CPU_LIB = "libmodelopt_jax_ffi_cpu.so"
CUDA_LIB = "libmodelopt_jax_ffi_cuda.so"


def _search_dirs() -> list[str]:
    dirs = []
    if os.environ.get("MODELOPT_JAX_NATIVE_DIR"):
        dirs.append(os.environ["MODELOPT_JAX_NATIVE_DIR"])
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../modelopt_jax
    for root in [package] + [
            os.path.join(sysconfig.get_paths()["platlib"], "modelopt_jax")]:
        dirs.append(os.path.join(root, "_native"))
    return dirs


def _find(name: str) -> str | None:
    for d in _search_dirs():
        path = os.path.join(d, name)
        if os.path.exists(path):
            return path
    return None


def _load(path: str, handler: str, platform: str) -> ctypes.CDLL:
    lib = ctypes.cdll.LoadLibrary(path)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(lib, handler)), platform=platform)
    return lib


@functools.cache
def cpu_library() -> ctypes.CDLL | None:
    path = _find(CPU_LIB)
    if path is None:
        return None
    lib = _load(path, "ModeloptFp8GemmCpu", "cpu")
    if hasattr(lib, "ModeloptFp8GroupedGemmCpu"):  # absent from libraries built before the op existed
        jax.ffi.register_ffi_target(GROUPED_TARGET, jax.ffi.pycapsule(lib.ModeloptFp8GroupedGemmCpu), platform="cpu")
    return lib


@functools.cache
def cuda_library() -> ctypes.CDLL | None:
    path = _find(CUDA_LIB)
    if path is None:
        return None
    try:
        lib = _load(path, "ModeloptFp8GemmCuda", "CUDA")
    except OSError as e:  # e.g. a CUDA runtime mismatch on this machine
        warnings.warn(f"{path} failed to load ({e}); FP8 GEMMs on CUDA use XLA's path", stacklevel=2)
        return None
    if hasattr(lib, "ModeloptFp8GroupedGemmCuda"):  # absent from libraries built before the op existed
        jax.ffi.register_ffi_target(GROUPED_TARGET, jax.ffi.pycapsule(lib.ModeloptFp8GroupedGemmCuda),
                                    platform="CUDA")
    if hasattr(lib, "ModeloptPagedDecodeCuda"):  # absent from libraries built before the kernel existed
        jax.ffi.register_ffi_target(PAGED_DECODE_TARGET, jax.ffi.pycapsule(lib.ModeloptPagedDecodeCuda),
                                    platform="CUDA")
        jax.ffi.register_ffi_target(PAGED_DECODE_POISONED_TARGET,
                                    jax.ffi.pycapsule(lib.ModeloptPagedDecodeCudaPoisoned), platform="CUDA")
    if hasattr(lib, "ModeloptPagedDecodeWriteCuda"):
        jax.ffi.register_ffi_target(PAGED_DECODE_WRITE_TARGET, jax.ffi.pycapsule(lib.ModeloptPagedDecodeWriteCuda),
                                    platform="CUDA")
    if hasattr(lib, "ModeloptPagedPrefillCuda"):
        jax.ffi.register_ffi_target(PAGED_PREFILL_TARGET, jax.ffi.pycapsule(lib.ModeloptPagedPrefillCuda),
                                    platform="CUDA")
        jax.ffi.register_ffi_target(PAGED_PREFILL_POISONED_TARGET,
                                    jax.ffi.pycapsule(lib.ModeloptPagedPrefillCudaPoisoned), platform="CUDA")
    if hasattr(lib, "ModeloptPagedPrefillLseCuda"):
        jax.ffi.register_ffi_target(PAGED_PREFILL_LSE_TARGET, jax.ffi.pycapsule(lib.ModeloptPagedPrefillLseCuda),
                                    platform="CUDA")
    return lib


@functools.cache
def warn_if_gpu_without_kernels() -> None:
    """Once per process: a CUDA device is present but our CUDA library is not, so XLA's FP8 path runs."""
    if cuda_library() is not None:
        return
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return
    if gpus:
        warnings.warn(f"{CUDA_LIB} was not found (modelopt_jax was built without nvcc?): FP8 GEMMs on "
                      f"{gpus[0].device_kind} use XLA's FP8 path instead of the CUTLASS kernels", stacklevel=3)


def has_cpu_handler() -> bool:
    return cpu_library() is not None


def has_cpu_grouped_handler() -> bool:
    lib = cpu_library()
    return lib is not None and hasattr(lib, "ModeloptFp8GroupedGemmCpu")


def has_fast_cpu_handler() -> bool:
    """The CPU handler is the blocked one (``ModeloptFp8GemmCpuVersion`` >= 2), which beats XLA:CPU
    for few rows; a library built before it has a reference loop that "auto" must not pick."""
    lib = cpu_library()
    return lib is not None and hasattr(lib, "ModeloptFp8GemmCpuVersion") and lib.ModeloptFp8GemmCpuVersion() >= 2


def has_cuda_handler() -> bool:
    return cuda_library() is not None


def has_cuda_grouped_handler() -> bool:
    """Whether the CUDA library has the grouped GEMM's handler and its workspace-size export."""
    lib = cuda_library()
    return lib is not None and hasattr(lib, "ModeloptFp8GroupedGemmCuda") and \
        hasattr(lib, "ModeloptFp8GroupedGemmWorkspaceBytes")


def grouped_workspace_bytes(m: int, n: int, k: int, groups: int, out_bf16: bool) -> int:
    """Bytes of the uint8 workspace result the CUDA grouped GEMM needs for these dimensions on the
    current device (what every compiled configuration fits)."""
    lib = cuda_library()
    fn = lib.ModeloptFp8GroupedGemmWorkspaceBytes
    fn.restype = ctypes.c_longlong
    fn.argtypes = [ctypes.c_int] * 5
    size = int(fn(m, n, k, groups, int(out_bf16)))
    if size < 0:
        raise RuntimeError("modelopt_fp8_grouped_gemm: no grouped configuration is compiled for this device")
    return size


def has_paged_decode_kernel() -> bool:
    lib = cuda_library()
    return lib is not None and hasattr(lib, "ModeloptPagedDecodeCuda")


def has_paged_decode_write_kernel() -> bool:
    lib = cuda_library()
    return lib is not None and hasattr(lib, "ModeloptPagedDecodeWriteCuda")


def has_paged_prefill_kernel() -> bool:
    lib = cuda_library()
    return lib is not None and hasattr(lib, "ModeloptPagedPrefillCuda")


def has_paged_prefill_lse_kernel() -> bool:
    """The prefill kernel's variant that also returns each row's log-sum-exp (cascade attention)."""
    lib = cuda_library()
    return lib is not None and hasattr(lib, "ModeloptPagedPrefillLseCuda")


def _major(major: int | None) -> int:
    """``major``, or the compute capability major of GPU 0."""
    return int(jax.devices("gpu")[0].compute_capability.split(".")[0]) if major is None else major


def config_count(major: int | None = None) -> int:
    """Number of compiled CUDA tile configurations for compute capability ``major`` (default: device 0)."""
    lib = cuda_library()
    if lib is None:
        return 0
    return int(lib.ModeloptFp8GemmConfigName(_major(major), 0, None, 0))


def config_name(index: int, major: int | None = None) -> str:
    lib = cuda_library()
    major = _major(major)
    buf = ctypes.create_string_buffer(128)
    lib.ModeloptFp8GemmConfigName(major, index, buf, 128)
    return buf.value.decode()


def grouped_config_names(major: int | None = None) -> list[str]:
    """Names of the compiled grouped-GEMM configurations for compute capability ``major`` (default:
    device 0), in the order the ``tile`` attribute indexes them."""
    lib = cuda_library()
    if lib is None or not hasattr(lib, "ModeloptFp8GroupedGemmConfigName"):
        return []
    major = _major(major)
    names = []
    for index in range(int(lib.ModeloptFp8GroupedGemmConfigName(major, 0, None, 0))):
        buf = ctypes.create_string_buffer(128)
        lib.ModeloptFp8GroupedGemmConfigName(major, index, buf, 128)
        names.append(buf.value.decode())
    return names
