"""``gpurouter/kernels/_base/device.py``'s ``inline_device``: a device function
whose callers pass constants is compiled once (not once per constant value)
and computes what a plain device function does."""

from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from numba import cuda  # noqa: E402

# one small block on host arrays: on a GPU numba warns of the small grid and of the copies
# (NumbaPerformanceWarning; pyproject makes warnings errors)
pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings(
    "ignore:.*(Grid size \\d+ will likely result in GPU under-utilization|Host array used in CUDA kernel)")]


def _calling(fn):
    """A kernel calling device function ``fn`` with three constants."""

    @cuda.jit
    def kernel(x, out):
        i = cuda.grid(1)
        if i < x.size:
            out[i, 0] = fn(x[i], 1)
            out[i, 1] = fn(x[i], 3)
            out[i, 2] = fn(x[i], 5)

    return kernel


def _kernels():
    """``(once, plain, kernel calling once, kernel calling plain)``: one function
    as an ``inline_device`` and as a plain device function."""
    from gpurouter.kernels._base.device import inline_device

    def shift(x, k):
        return (x << k) | (x >> (8 - k))

    once = inline_device(shift)
    plain = cuda.jit(device=True)(shift)
    return once, plain, _calling(once), _calling(plain)


def _run(kernel, x):
    out = np.zeros((x.size, 3), np.int64)
    kernel[1, 32](x, out)
    return out


def test_the_same_values_as_a_plain_device_function():
    _, _, with_once, with_plain = _kernels()
    x = np.arange(1, 20, dtype=np.int64)
    want = np.stack([(x << k) | (x >> (8 - k)) for k in (1, 3, 5)], axis=1)
    np.testing.assert_array_equal(_run(with_once, x), want)
    np.testing.assert_array_equal(_run(with_plain, x), want)


@pytest.mark.gpu
def test_one_compile_for_every_constant_and_inlined():
    once, plain, with_once, with_plain = _kernels()
    x = np.arange(1, 20, dtype=np.int64)
    _run(with_once, x)
    _run(with_plain, x)
    assert len(plain.overloads) == 3  # numba's own: one compile per constant value
    assert len(once.overloads) == 1
    assert once.targetoptions.get("forceinline") is True
    ptx = with_once.inspect_asm(with_once.signatures[0])
    assert "call.uni" not in ptx and "call " not in ptx  # inlined: no device call left
