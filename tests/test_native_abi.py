"""The native libraries' handler contract: one version number, checked before a library is used.

A library built from other sources than this package (an old build left in ``_native``, a
``MODELOPT_JAX_NATIVE_DIR`` pointing elsewhere) registers handlers whose operands may differ from
what the ops pass: it must not be loaded, and the user must be told which file and why.
"""

from __future__ import annotations

import ctypes
import pathlib
import re

import pytest

from modelopt_jax.ops import native

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_python_and_the_header_state_the_same_version():
    header = (ROOT / "ffi" / "abi_version.h").read_text()
    match = re.search(r"#define MODELOPT_JAX_FFI_ABI_VERSION (\d+)", header)
    assert match is not None
    assert int(match.group(1)) == native.ABI_VERSION


@pytest.mark.skipif(native._find(native.CPU_LIB) is None, reason="native CPU FFI library not built")
def test_the_built_cpu_library_is_of_this_contract_and_loaded():
    path = native._find(native.CPU_LIB)
    assert native.abi_version(ctypes.cdll.LoadLibrary(path)) == native.ABI_VERSION
    assert native.has_cpu_handler()


@pytest.mark.skipif(native._find(native.CPU_LIB) is None, reason="native CPU FFI library not built")
def test_a_library_of_another_version_is_refused_with_its_path_named(monkeypatch):
    path = native._find(native.CPU_LIB)
    monkeypatch.setattr(native, "ABI_VERSION", native.ABI_VERSION + 1)
    with pytest.warns(UserWarning) as caught:
        assert native._open(path) is None
    message = str(caught[0].message)
    assert path in message
    assert f"version {native.ABI_VERSION - 1}" in message and f"needs version {native.ABI_VERSION}" in message
    assert "Rebuild" in message


def _foreign_library() -> str:
    """A loadable shared library without the version symbol, standing in for an old build."""
    import _ctypes

    path = getattr(_ctypes, "__file__", None)
    if not path:
        pytest.skip("_ctypes is built into this interpreter: no shared library to stand in for an old build")
    return path


def test_a_library_without_the_version_symbol_is_refused():
    foreign = _foreign_library()
    assert native.abi_version(ctypes.cdll.LoadLibrary(foreign)) is None
    with pytest.warns(UserWarning, match="before the version symbol existed"):
        assert native._open(foreign) is None


@pytest.mark.skipif(native._find(native.CPU_LIB) is None, reason="native CPU FFI library not built")
def test_a_stale_copy_first_on_the_search_path_does_not_hide_a_current_one(monkeypatch, tmp_path):
    """MODELOPT_JAX_NATIVE_DIR (searched first) holding a library of another contract: the next copy
    of this contract is loaded, and the warning says the stale one was passed over."""
    current = native._find(native.CPU_LIB)
    (tmp_path / native.CPU_LIB).symlink_to(_foreign_library())
    monkeypatch.setattr(native, "_search_dirs", lambda: [str(tmp_path), str(pathlib.Path(current).parent)])
    with pytest.warns(UserWarning, match="the next copy on the search path is tried"):
        lib = native._open_first(native.CPU_LIB)
    assert lib is not None and native.abi_version(lib) == native.ABI_VERSION
