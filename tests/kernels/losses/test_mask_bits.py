"""The masks' bitwise select (``kernels/losses/mask_bits.py``) on the CUDA
simulator or a GPU: ``keep_if`` keeps a value's bits (NaN payloads, -0.0, inf)
or gives +0.0, whatever the value."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from numba import cuda  # noqa: E402  (a module global: the simulator swaps it inside kernels)

from gpurouter.kernels.losses.mask_bits import all_ones_if, keep_if  # noqa: E402

# the test launches one small block directly on host arrays: on a GPU numba warns of the small grid and of the
# copies (NumbaPerformanceWarning; pyproject makes warnings errors)
pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings(
    "ignore:.*(Grid size \\d+ will likely result in GPU under-utilization|Host array used in CUDA kernel)")]


def test_keep_if_selects_bits():
    """``keep_if(v, all_ones_if(bit))``: the value's bits unchanged where the bit
    is 1, +0.0 (bits 0) where it is 0."""

    @cuda.jit
    def kernel(v, byte, out):
        i = cuda.grid(1)
        if i < v.shape[0]:
            out[i] = keep_if(v[i], all_ones_if((np.uint32(byte[0]) >> np.uint32(i % 8)) & np.uint32(1)))

    vals = np.array([1.5, np.nan, -np.inf, np.inf, -0.0, -2.0, 3e-40, np.nan], np.float32)
    vals[7] = np.uint32(0xFFC00001).view(np.float32)  # a NaN with a payload
    byte = np.array([0b10110100], np.uint8)  # bits 2, 4, 5, 7 set
    out = np.empty_like(vals)
    kernel[1, 8](vals, byte, out)
    keep = [(int(byte[0]) >> i) & 1 for i in range(8)]
    want = np.where(np.array(keep, bool), vals.view(np.uint32), np.uint32(0))
    np.testing.assert_array_equal(out.view(np.uint32), want)
