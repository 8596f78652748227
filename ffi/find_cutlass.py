"""Prints the CUTLASS include directories (core and tools/util), fetching the headers if needed.

CMake calls this at configure time when the CUDA kernels are enabled. Order of preference:
1. ``$MODELOPT_JAX_CUTLASS_DIR`` (a CUTLASS source tree or an extracted wheel),
2. an importable ``cutlass_library`` (the ``nvidia-cutlass`` wheel carries the C++ headers under
   ``cutlass_library/source``),
3. the pinned ``nvidia-cutlass`` wheel fetched into the build directory -- with pip when one is
   reachable (``python -m pip``, else ``pip`` on PATH: pip's isolated build environments have none
   of their own), else straight from PyPI's simple index with its sha256 checked -- unpacking only the
   headers (the wheel's Python dependencies -- cuda-python, scipy, ... -- are not needed to compile).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
import zipfile

PINNED = "4.2.0.0"  # CUTLASS 4.2.0 headers; kernels are written against this version


def _dirs(source_root: str) -> list[str]:
    return [os.path.join(source_root, "include"), os.path.join(source_root, "tools", "util", "include")]


def _valid(dirs: list[str]) -> bool:
    return os.path.exists(os.path.join(dirs[0], "cutlass", "cutlass.h")) and os.path.isdir(dirs[1])


def find(build_dir: str) -> list[str]:
    env = os.environ.get("MODELOPT_JAX_CUTLASS_DIR")
    if env:
        for root in (env, os.path.join(env, "cutlass_library", "source")):
            if _valid(_dirs(root)):
                return _dirs(root)
        raise SystemExit(f"MODELOPT_JAX_CUTLASS_DIR={env} holds no include/cutlass/cutlass.h")
    try:
        import cutlass_library

        root = os.path.join(os.path.dirname(cutlass_library.__file__), "source")
        if _valid(_dirs(root)):
            return _dirs(root)
    except ImportError:
        pass
    target = os.path.join(build_dir, f"nvidia-cutlass-{PINNED}")
    root = os.path.join(target, "cutlass_library", "source")
    if not _valid(_dirs(root)):
        wheel = _fetch_wheel(os.path.join(build_dir, "wheels"))
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.startswith("cutlass_library/source/include/")
                       or m.startswith("cutlass_library/source/tools/util/include/")]
            zf.extractall(target, members)
    if not _valid(_dirs(root)):
        raise SystemExit(f"could not obtain CUTLASS {PINNED} headers in {target}")
    return _dirs(root)


def _fetch_wheel(wheels: str) -> str:
    os.makedirs(wheels, exist_ok=True)
    args = ["download", "--no-deps", "--only-binary=:all:", f"nvidia-cutlass=={PINNED}", "-d", wheels]
    pips = [[sys.executable, "-m", "pip"]] + [[p] for p in (shutil.which("pip3"), shutil.which("pip")) if p]
    for pip in pips:
        if subprocess.run(pip + args, stdout=sys.stderr, stderr=sys.stderr).returncode == 0:
            break
    else:
        _download_from_pypi(wheels)
    return next(os.path.join(wheels, f) for f in os.listdir(wheels) if f.startswith("nvidia_cutlass"))


def _download_from_pypi(wheels: str) -> None:
    """Fetches the pinned wheel through PyPI's simple index (PEP 503), checking its sha256."""
    name = f"nvidia_cutlass-{PINNED}-py3-none-any.whl"
    with urllib.request.urlopen("https://pypi.org/simple/nvidia-cutlass/", timeout=60) as r:
        page = r.read().decode()
    match = re.search(r'href="([^"]*/' + re.escape(name) + r')#sha256=([0-9a-f]{64})"', page)
    if match is None:
        raise SystemExit(f"{name} not found on PyPI's simple index")
    url, digest = match.group(1), match.group(2)
    url = urllib.parse.urljoin("https://pypi.org/simple/nvidia-cutlass/", url)
    with urllib.request.urlopen(url, timeout=300) as r:
        data = r.read()
    if hashlib.sha256(data).hexdigest() != digest:
        raise SystemExit(f"sha256 mismatch for {name}")
    with open(os.path.join(wheels, name), "wb") as f:
        f.write(data)


if __name__ == "__main__":
    print(";".join(find(sys.argv[1] if len(sys.argv) > 1 else os.getcwd())))
