"""The loader's NaN/inf scan (issue 13, item 14), on both of its paths: the native read-and-scan of
``ffi/finite_scan.cc`` and the numpy fallback used when the CPU library is absent.

The truth every case is checked against is ``np.isfinite`` of the values widened to float64, which
shares nothing with the bit tricks under test. Positions are chosen where a vectorised loop goes
wrong: the first and last element, the tail after the last whole vector, a 4 KiB block boundary,
an unaligned file offset, and a tensor large enough (> 4 MiB) for the helper thread that scans
behind the reads.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from modelopt_jax.checkpoint import finite_scan
from modelopt_jax.checkpoint.safetensors_index import NUMPY_DTYPES

TAGS = list(finite_scan.NONFINITE_BITS)
# Per tag: bit patterns that are NaN or inf, and the largest finite ones (which must pass).
BAD = {"F8_E4M3": [0x7F, 0xFF], "F8_E5M2": [0x7C, 0xFC, 0x7D, 0xFF], "BF16": [0x7F80, 0xFF80, 0x7FC0, 0xFFFF],
       "F16": [0x7C00, 0xFC00, 0x7E00], "F32": [0x7F800000, 0xFF800000, 0x7FC00001],
       "F64": [0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000000]}
LARGEST = {"F8_E4M3": [0x7E, 0xFE], "F8_E5M2": [0x7B, 0xFB], "BF16": [0x7F7F, 0xFF7F], "F16": [0x7BFF, 0xFBFF],
           "F32": [0x7F7FFFFF, 0xFF7FFFFF], "F64": [0x7FEFFFFFFFFFFFFF, 0xFFEFFFFFFFFFFFFF]}


def _truth(values: np.ndarray) -> int:
    with np.errstate(invalid="ignore"):  # widening a signalling NaN
        bad = ~np.isfinite(values.astype(np.float64))
    return int(np.argmax(bad)) if bad.any() else -1


def _read(tmp_path, values: np.ndarray, tag: str | None, *, lead: int = 3):
    """``values`` written after ``lead`` junk bytes (an unaligned offset), read back by read_into."""
    file = tmp_path / "t.bin"
    file.write_bytes(b"\xff" * lead + values.tobytes() + b"\xff" * 5)
    out = np.empty_like(values)
    with open(file, "rb") as f:
        got, first = finite_scan.read_into(f, lead, out, tag)
    assert got == values.nbytes and out.tobytes() == values.tobytes()
    return first


def _with_bits(tag: str, n: int, at: dict[int, int], fill: int = 0x01) -> np.ndarray:
    unsigned = finite_scan.NONFINITE_BITS[tag][1]
    bits = np.full(n, fill, unsigned)
    for i, b in at.items():
        bits[i] = b
    return bits.view(NUMPY_DTYPES[tag])


@pytest.mark.parametrize("tag", TAGS)
def test_every_nonfinite_pattern_found_where_it_is(tag, scan_path, tmp_path):
    block = 4096 // np.dtype(NUMPY_DTYPES[tag]).itemsize  # the native loop tests its accumulator per 4 KiB
    n = 2 * block + 7  # two blocks and a ragged tail
    for bad in BAD[tag]:
        for where in (0, 1, block - 1, block, n - 8, n - 1):
            values = _with_bits(tag, n, {where: bad})
            assert _truth(values) == where
            assert _read(tmp_path, values, tag) == where, (hex(bad), where)
    values = _with_bits(tag, n, {i: LARGEST[tag][i % 2] for i in range(0, n, 3)})
    assert _truth(values) == -1 and _read(tmp_path, values, tag) == -1


@pytest.mark.parametrize("tag", TAGS)
def test_random_bits_agree_with_isfinite(tag, scan_path, tmp_path):
    rng = np.random.default_rng(TAGS.index(tag))
    unsigned = finite_scan.NONFINITE_BITS[tag][1]
    for n in (1, 31, 33, 1000, 20000):
        bits = rng.integers(0, np.iinfo(unsigned).max, n, dtype=unsigned, endpoint=True)
        values = bits.view(NUMPY_DTYPES[tag])
        with np.errstate(invalid="ignore"):
            nonfinite = ~np.isfinite(values.astype(np.float64))
        drop = rng.random(n) < 0.999  # mostly finite: the first non-finite value lies deep in
        values = np.where(nonfinite & drop, np.zeros((), values.dtype), values)
        assert _read(tmp_path, values, tag, lead=n % 7) == _truth(values)


def test_large_tensor_scanned_behind_the_reads(scan_path, tmp_path):
    """20 MiB (the native path hands the scan to a helper thread above 4 MiB; reads are 1 MiB each)."""
    n = 20 << 20
    for where in (0, (1 << 20) - 1, 1 << 20, n - 1):
        values = _with_bits("F8_E4M3", n, {where: 0xFF}, fill=0x38)
        assert _read(tmp_path, values, "F8_E4M3", lead=1) == where
    values = _with_bits("BF16", n // 2, {}, fill=0x3F80)
    assert _read(tmp_path, values, "BF16") == -1


def test_without_a_tag_nothing_is_scanned(scan_path, tmp_path):
    values = _with_bits("F8_E4M3", 100, {5: 0x7F})
    assert _read(tmp_path, values, None) == -1
    assert _read(tmp_path, values.view(np.uint8), None) == -1


def test_short_file_reports_what_it_read(scan_path, tmp_path):
    file = tmp_path / "short.bin"
    file.write_bytes(b"\x00" * 100)
    out = np.empty(64, ml_dtypes.bfloat16)
    with open(file, "rb") as f:
        assert finite_scan.read_into(f, 10, out, "BF16") == (90, -1)
