"""Finds the compiled XLA FFI libraries and registers their targets with JAX, once, at import.

``libmodelopt_jax_ffi_cpu.so`` (reference C++ handler, always built) and
``libmodelopt_jax_ffi_cuda.so`` (CUTLASS kernels, built when nvcc was found) are installed into
``modelopt_jax/_native``. ``MODELOPT_JAX_NATIVE_DIR`` overrides the search (Bazel sets it). A
missing CUDA library is not an error: the GEMM then uses XLA's FP8 path on GPUs, and a warning
says so the first time a CUDA device is seen.

Each library states the version of the handler contract it was built to
(``ModeloptJaxFfiAbiVersion``, ffi/abi_version.h). One built from other sources than this package
would register handlers whose operands differ from what the ops pass, or lack some: it is not
loaded (a warning names it and says how to rebuild), the next copy on the search path is tried, and
with none of this contract the XLA paths run.
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
ABI_VERSION = 1  # MODELOPT_JAX_FFI_ABI_VERSION in ffi/abi_version.h: bump both with any handler change
ABI_SYMBOL = "ModeloptJaxFfiAbiVersion"


def _search_dirs() -> list[str]:
    dirs = []
    if os.environ.get("MODELOPT_JAX_NATIVE_DIR"):
        dirs.append(os.environ["MODELOPT_JAX_NATIVE_DIR"])
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../modelopt_jax
    for root in [package] + [
            os.path.join(sysconfig.get_paths()["platlib"], "modelopt_jax")]:
        dirs.append(os.path.join(root, "_native"))
    return dirs


def _candidates(name: str) -> list[str]:
    """Every copy of library ``name`` on the search path, in search order."""
    return [p for p in (os.path.join(d, name) for d in _search_dirs()) if os.path.exists(p)]


def _find(name: str) -> str | None:
    """The first copy of library ``name`` on the search path."""
    found = _candidates(name)
    return found[0] if found else None


def abi_version(lib: ctypes.CDLL) -> int | None:
    """The handler contract ``lib`` was built to, or None for a library older than the version symbol."""
    if not hasattr(lib, ABI_SYMBOL):
        return None
    fn = getattr(lib, ABI_SYMBOL)
    fn.restype = ctypes.c_int32
    fn.argtypes = []
    return int(fn())


def _open(path: str, *, fallback: bool = False) -> ctypes.CDLL | None:
    """``path`` loaded, or None (with a warning naming it) where it was built to another contract;
    ``fallback``: the warning says another copy is tried next instead of that XLA's paths run."""
    lib = ctypes.cdll.LoadLibrary(path)
    version = abi_version(lib)
    if version != ABI_VERSION:
        built = "before the version symbol existed" if version is None else f"for FFI ABI version {version}"
        then = "the next copy on the search path is tried" if fallback else "XLA's paths run instead"
        warnings.warn(f"{path} was built {built}, but this modelopt_jax needs version {ABI_VERSION}: it is not "
                      f"used ({then}). Rebuild it from this source tree (`pip install .`, or cmake as in README) "
                      f"or remove it.", stacklevel=3)
        return None
    return lib


def _open_first(name: str) -> ctypes.CDLL | None:
    """The first copy of ``name`` on the search path built to this contract: a stale build that
    shadows a current one (``MODELOPT_JAX_NATIVE_DIR``, an old in-tree ``_native``) does not hide it."""
    found = _candidates(name)
    for i, path in enumerate(found):
        lib = _open(path, fallback=i + 1 < len(found))
        if lib is not None:
            return lib
    return None


def _register(lib: ctypes.CDLL, platform: str, targets: dict[str, str]) -> None:
    for target, symbol in targets.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform=platform)


@functools.cache
def cpu_library() -> ctypes.CDLL | None:
    lib = _open_first(CPU_LIB)
    if lib is not None:
        _register(lib, "cpu", {TARGET: "ModeloptFp8GemmCpu", GROUPED_TARGET: "ModeloptFp8GroupedGemmCpu"})
    return lib


@functools.cache
def cuda_library() -> ctypes.CDLL | None:
    try:
        lib = _open_first(CUDA_LIB)
    except OSError as e:  # e.g. a CUDA runtime mismatch on this machine
        warnings.warn(f"{CUDA_LIB} failed to load ({e}); FP8 GEMMs on CUDA use XLA's path", stacklevel=2)
        return None
    if lib is not None:
        _register(lib, "CUDA", {
            TARGET: "ModeloptFp8GemmCuda",
            GROUPED_TARGET: "ModeloptFp8GroupedGemmCuda",
            PAGED_DECODE_TARGET: "ModeloptPagedDecodeCuda",
            PAGED_DECODE_POISONED_TARGET: "ModeloptPagedDecodeCudaPoisoned",
            PAGED_DECODE_WRITE_TARGET: "ModeloptPagedDecodeWriteCuda",
            PAGED_PREFILL_TARGET: "ModeloptPagedPrefillCuda",
            PAGED_PREFILL_POISONED_TARGET: "ModeloptPagedPrefillCudaPoisoned",
            PAGED_PREFILL_LSE_TARGET: "ModeloptPagedPrefillLseCuda",
        })
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
    """The CPU library of this contract is loaded: the blocked FP8 GEMM handler (which beats XLA:CPU
    for few rows) and the grouped GEMM's."""
    return cpu_library() is not None


def has_cuda_handler() -> bool:
    """The CUDA library of this contract is loaded: the GEMMs (dense and grouped, with the grouped
    workspace-size export) and every paged attention op (decode, its fused write, prefill, its
    log-sum-exp variant)."""
    return cuda_library() is not None



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
    if lib is None:
        return []
    major = _major(major)
    names = []
    for index in range(int(lib.ModeloptFp8GroupedGemmConfigName(major, 0, None, 0))):
        buf = ctypes.create_string_buffer(128)
        lib.ModeloptFp8GroupedGemmConfigName(major, index, buf, 128)
        names.append(buf.value.decode())
    return names
