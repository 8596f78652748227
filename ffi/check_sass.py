"""Checks the built CUDA library's machine code for FP8 tensor-core instructions (run by CI).

A kernel that compiled but fell back to a slow path would still pass every CPU test; its SASS
cannot hide it. Every sm_90a cubin that holds a GEMM kernel must issue FP8 warpgroup MMAs
(``QGMMA...E4M3.E4M3``) fed by TMA loads (``UTMALDG``); every sm_100a cubin must issue
``UTCQMMA`` (Blackwell FP8 UMMA). Every instantiation of the tensor-core attention kernels
(``PagedPrefillKernel``, ``PagedDecodeMmaKernel``) must issue ``HMMA.16816`` (mma.sync m16n8k16), and the
prefill kernel ``LDSM.16.M88.4`` and ``LDSM.16.MT88.4`` (ldmatrix, plain and transposed). Every
instantiation of the weight-streaming GEMM (``StreamGemm``) must issue ``HMMA.16816.F32`` (its e4m3
mma.sync, as ptxas expands it on sm_90) and 16-byte weight loads that skip L1
(``LDG.E.NA...128``). Needs ``cuobjdump`` and ``nvdisasm`` (CUDA toolkit, or the
``nvidia-cuda-cuobjdump`` / ``nvidia-cuda-nvdisasm`` wheels, whose bin/ is searched too).

    python ffi/check_sass.py [path/to/libmodelopt_jax_ffi_cuda.so]
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile


def _tool_path() -> str:
    dirs = glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "*", "bin"))
    return os.pathsep.join(dirs + [os.environ.get("PATH", "")])


def main() -> int:
    if len(sys.argv) > 1:
        lib = sys.argv[1]
    else:
        from modelopt_jax.ops import native

        lib = native._find(native.CUDA_LIB)
        if lib is None:
            print("check_sass: CUDA library not built", file=sys.stderr)
            return 1
    env = dict(os.environ, PATH=_tool_path())
    if shutil.which("cuobjdump", path=env["PATH"]) is None:
        print("check_sass: cuobjdump not found", file=sys.stderr)
        return 1
    failures, checked, attention_kernels, stream_kernels = [], 0, 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["cuobjdump", "--extract-elf", "all", os.path.abspath(lib)], cwd=tmp, env=env, check=True,
                       capture_output=True)
        for cubin in sorted(glob.glob(os.path.join(tmp, "*.cubin"))):
            sass = subprocess.run(["cuobjdump", "--dump-sass", cubin], env=env, check=True, capture_output=True,
                                  text=True).stdout
            for function in sass.split("Function : ")[1:]:
                if "PagedPrefillKernel" in function or "PagedDecodeMmaKernel" in function:
                    attention_kernels += 1
                    if "HMMA.16816.F32" not in function:
                        failures.append(function.split()[0][:120])
                    # the prefill kernel's B fragments come from ldmatrix, V's transposed (without
                    # them it ran at ~65 TFLOP/s instead of 135-151, bench/RESULTS.md)
                    if "PagedPrefillKernel" in function and not ("LDSM.16.M88.4" in function and
                                                                 "LDSM.16.MT88.4" in function):
                        failures.append(function.split()[0][:120] + " (no ldmatrix)")
                if "StreamGemm" in function:
                    stream_kernels += 1
                    if "HMMA.16816.F32" not in function or not re.search(r"LDG\.E\.NA\S*\.128", function):
                        failures.append(function.split()[0][:120] + " (no HMMA or no 16-byte L1-bypassing loads)")
            if "Function : " not in sass or "GemmUniversal" not in sass and "cutlass" not in sass:
                continue  # host-side handler, table or attention kernels: no GEMM kernels
            name = os.path.basename(cubin)
            checked += 1
            if "sm_90a" in name:
                qgmma = len(re.findall(r"QGMMA\.\S+\.E4M3\.E4M3", sass))
                tma = sass.count("UTMALDG")
                print(f"{name}: {qgmma} QGMMA E4M3 x E4M3, {tma} UTMALDG")
                if not qgmma or not tma:
                    failures.append(name)
            elif "sm_100a" in name:
                umma = sass.count("UTCQMMA")
                print(f"{name}: {umma} UTCQMMA")
                if not umma:
                    failures.append(name)
    if not checked:
        print("check_sass: no kernel cubins found", file=sys.stderr)
        return 1
    if not attention_kernels:
        print("check_sass: no tensor-core attention kernels found", file=sys.stderr)
        return 1
    if failures:
        print(f"check_sass: no tensor-core instructions in {failures}", file=sys.stderr)
        return 1
    print(f"check_sass: {checked} kernel cubins use FP8 tensor-core instructions; "
          f"{attention_kernels} attention kernels use HMMA (the prefill kernels ldmatrix too); "
          f"{stream_kernels} weight-streaming GEMM kernels use HMMA and 16-byte L1-bypassing loads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
