"""pytest_test: one py_test running one tests/test_*.py under pytest (see pytest_main.py)."""

def pytest_test(name, src, size = "medium", fixtures = True, data = [], deps = [], **kwargs):
    """A py_test that runs `src` with pytest, against //:modelopt_jax and the Bazel-built FFI library.

    Args:
      name: target name (conventionally `src` without `.py`).
      src: the test file.
      size: Bazel test size ("medium": up to 5 minutes, "large": 15).
      fixtures: whether the ModelOpt fixtures (@modelopt_jax_fixtures) are in `data`.
      data, deps, **kwargs: passed on to py_test.
    """
    native.py_test(
        name = name,
        size = size,
        srcs = [src, "//tools/bazel:pytest_main.py"],
        main = "//tools/bazel:pytest_main.py",
        args = ["$(location %s)" % src],
        data = data + [
            "//:pyproject.toml",  # pytest's settings (markers, -ra, importlib import mode)
            "//ffi:libmodelopt_jax_ffi_cpu.so",
        ] + (["@modelopt_jax_fixtures//:fixtures"] if fixtures else []),
        deps = deps + [
            "//:modelopt_jax",
            "@bazel_tools//tools/python/runfiles",
        ],
        python_version = "PY3",
        srcs_version = "PY3",
        legacy_create_init = False,  # no generated __init__.py: tests/ stays a plain pytest folder
        **kwargs
    )
