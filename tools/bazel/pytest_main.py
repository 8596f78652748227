"""`main` of every py_test made by //tools/bazel:pytest.bzl: runs one test file under pytest.

Bazel runs this with the `python3` on PATH, so jax, flax, pytest, ... come from the environment
where `pip install` put them. Before pytest starts, two settings point into this test's runfiles:

- MODELOPT_JAX_NATIVE_DIR: the folder of the Bazel-built libmodelopt_jax_ffi_cpu.so, so the FFI
  tests run against //ffi's library, not a pip-built copy (modelopt_jax.ops.native looks there first);
- MODELOPT_JAX_FIXTURES: the fixtures of @modelopt_jax_fixtures when the test has them as data.

and one into the test's private scratch folder ($TEST_TMPDIR, writable, discarded afterwards):

- MODELOPT_JAX_COMPILATION_CACHE: the persistent XLA compilation cache that ``LLM(...)`` turns on
  (modelopt_jax.llm.enable_compilation_cache), by default under ~/.cache, which the Bazel sandbox
  mounts read-only: every test that built an LLM warned that it could not write cache entries.
  A value passed with ``--test_env=MODELOPT_JAX_COMPILATION_CACHE=...`` is kept.

The exit status is pytest's (0 only when every test passed or was skipped), and pytest's JUnit XML
goes where Bazel asks for it.
"""

from __future__ import annotations

import os
import sys

import pytest
from bazel_tools.tools.python.runfiles import runfiles

NATIVE_LIB = "ffi/libmodelopt_jax_ffi_cpu.so"
FIXTURES_MARKER = "modelopt_jax_fixtures/FIXTURES_ROOT"


def _runfile(files, path: str) -> str | None:
    found = files.Rlocation(path)
    return found if found and os.path.exists(found) else None


def main(argv: list[str]) -> int:
    files = runfiles.Create()
    workspace = os.environ.get("TEST_WORKSPACE", "modelopt_jax_workspace")
    lib = _runfile(files, f"{workspace}/{NATIVE_LIB}")
    if lib is None:
        print(f"pytest_main: //{NATIVE_LIB.replace('/', ':', 1)} is not in this test's runfiles", file=sys.stderr)
        return 1
    os.environ["MODELOPT_JAX_NATIVE_DIR"] = os.path.dirname(lib)
    marker = _runfile(files, FIXTURES_MARKER)
    # Without fixtures in `data`, a named folder that does not exist: fixture tests skip and say where.
    os.environ["MODELOPT_JAX_FIXTURES"] = (os.path.dirname(marker) if marker else
                                           os.path.join(os.getcwd(), "no-fixtures-in-data-of-this-test"))
    for name in ("MODELOPT_JAX_NATIVE_DIR", "MODELOPT_JAX_FIXTURES"):  # shown relative to the runfiles
        print(f"pytest_main: {name}={os.path.relpath(os.environ[name], os.environ.get('TEST_SRCDIR', '/'))}")
    scratch = os.environ.get("TEST_TMPDIR")
    if scratch and not os.environ.get("MODELOPT_JAX_COMPILATION_CACHE"):
        os.environ["MODELOPT_JAX_COMPILATION_CACHE"] = os.path.join(scratch, "modelopt_jax_xla_cache")
    print(f"pytest_main: MODELOPT_JAX_COMPILATION_CACHE={os.environ.get('MODELOPT_JAX_COMPILATION_CACHE', '(default)')}")
    sys.stdout.flush()

    args = list(argv) + ["-p", "no:cacheprovider"]  # the runfiles tree is no place for .pytest_cache
    if os.environ.get("XML_OUTPUT_FILE"):
        args.append("--junitxml=" + os.environ["XML_OUTPUT_FILE"])
    return int(pytest.main(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
