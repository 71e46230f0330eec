"""fp16 as uint64 quad words (``_base/access.py``): ``f16_bits_to_f32`` on every
one of the 65,536 fp16 words against NumPy's conversion, bit for bit, and the
quad load the aux loss forward sums fp16 probs with (``f16_quad_loader``: on a GPU
PTX's ``cvt.f32.f16``, on the simulator ``f16_bits_to_f32``)."""

from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from numba import cuda  # noqa: E402

from gpurouter.kernels._base import access as A  # noqa: E402
from gpurouter.kernels._base import launch as L  # noqa: E402

pytestmark = pytest.mark.cuda

#: every fp16 word, and what NumPy makes of each as fp32 (zeros, subnormals, inf, NaN payloads)
WORDS = np.arange(1 << 16, dtype=np.uint32)
WANT = WORDS.astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)


def test_every_word_in_python():
    """The device function's arithmetic as Python (its ``py_func``, NumPy scalars):
    the integer steps and the subnormals' one fp32 subtraction, every word."""
    f = A.f16_bits_to_f32.py_func
    got = np.array([f(np.uint32(h)) for h in WORDS], dtype=np.float32).view(np.uint32)
    bad = np.nonzero(got != WANT)[0]
    assert bad.size == 0, f"words {bad[:8]}: {got[bad[:8]]} != {WANT[bad[:8]]}"


_LOAD4 = A.f16_quad_loader()


@cuda.jit
def _load_quads(words, out):
    w = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if w < words.shape[0]:
        a, b, c, d = _LOAD4(words, w)
        out[4 * w] = a
        out[4 * w + 1] = b
        out[4 * w + 2] = c
        out[4 * w + 3] = d


def test_quad_load_order_and_specials():
    """Quad ``w``'s four halves in element order (the lowest half first), for a
    [2, 8] array seen as ``quad_words``: normals of both signs, +-0, the smallest
    and largest subnormal, the largest normal, +-inf and a NaN."""
    x = np.array([[1.5, -2.0, 0.0, -0.0, 2.0 ** -24, 1023 * 2.0 ** -24, 65504.0, -3.25],
                  [np.inf, -np.inf, np.nan, 0.333, -6e-8, 1e-5, 7.0, -65504.0]], np.float16)
    spec = A.quad_words(L.F16, x.shape)
    assert spec.shape == (4,) and spec.dtype == np.uint64
    out = cuda.to_device(np.zeros(x.size, np.float32))
    L.launch(_load_quads, 1, 32, 0, 0, cuda.to_device(x.reshape(-1).view(np.uint64)), out)
    got = out.copy_to_host().view(np.uint32)
    want = x.reshape(-1).astype(np.float32).view(np.uint32)
    nan = np.isnan(x.reshape(-1))  # a NaN (the GPU's cvt gives its canonical NaN)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.isnan(got[nan].view(np.float32)).all()


@pytest.mark.skipif(L.simulator_enabled(), reason="16,384 threads take minutes on the CUDA simulator; "
                    "test_every_word_in_python checks its conversion there")
def test_every_word_through_the_quad_loader_on_the_gpu():
    """The GPU's loader (``cvt.f32.f16``) on every fp16 word, bit for bit but for
    the NaNs, which stay NaNs (the H200 gives its canonical NaN, sign and payload
    dropped)."""
    d_out = cuda.to_device(np.zeros(WORDS.size, np.float32))
    L.launch(_load_quads, WORDS.size // 4 // 128, 128, 0, 0, cuda.to_device(WORDS.astype(np.uint16).view(np.uint64)),
             d_out)
    out = d_out.copy_to_host()
    got = out.view(np.uint32)
    nan = np.isnan(WANT.view(np.float32))
    assert np.isnan(out[nan]).all()
    bad = np.nonzero((got != WANT) & ~nan)[0]
    assert bad.size == 0, f"words {bad[:8]}: {got[bad[:8]]} != {WANT[bad[:8]]}"
