"""fp16 as uint64 quad words (``_base/access.py``): ``f16_bits_to_f32`` on every
one of the 65,536 fp16 words against NumPy's conversion, bit for bit, and the
quad load the aux loss forward sums fp16 probs with (``f16_quad_loader``: on a GPU
PTX's ``cvt.f32.f16``, on the simulator ``f16_bits_to_f32``), and the pair packing
of the z-loss's fp16 gradient (``f16_pair_ops``: ``cvt.rn.f16x2.f32``)."""

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


_HALVES, _PACK = A.f16_pair_ops()


@cuda.jit
def _pack_pairs(vals, words, back):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < words.shape[0]:
        w = _PACK(vals[2 * i], vals[2 * i + 1])
        words[i] = w
        lo, hi = _HALVES(w)
        back[2 * i] = lo
        back[2 * i + 1] = hi


def _check_pack(vals):
    """``f16_pair_ops``: each pair of fp32 packed into a word (the first value in
    the low half) equals NumPy's round-to-nearest-even fp16 bits (any NaN a NaN),
    and ``halves`` gives the fp16 values back as fp32."""
    vals = np.asarray(vals, np.float32)
    n = vals.size // 2
    d_words, d_back = cuda.to_device(np.zeros(n, np.uint32)), cuda.to_device(np.zeros(2 * n, np.float32))
    L.launch(_pack_pairs, -(-n // 128), min(n, 128), 0, 0, cuda.to_device(vals), d_words, d_back)
    got = d_words.copy_to_host().view(np.uint16)  # little-endian: each word's low half first
    with np.errstate(over="ignore"):
        want = vals.astype(np.float16)
    nan = np.isnan(want)
    assert np.isnan(got.view(np.float16)[nan]).all()
    bad = np.nonzero((got != want.view(np.uint16)) & ~nan)[0]
    assert bad.size == 0, f"values {vals[bad[:8]]}: {got[bad[:8]]} != {want.view(np.uint16)[bad[:8]]}"
    back = d_back.copy_to_host()
    np.testing.assert_array_equal(back[~nan], want[~nan].astype(np.float32))
    assert np.isnan(back[nan]).all()


def test_pair_pack_rounds_to_nearest_even():
    """Ties both ways (1 + 2^-11 rounds down to 1, 1 + 3 * 2^-11 up), the
    overflow edge (65519.99 stays 65504, 65520 is inf), subnormals and their
    ties, +-0, +-inf and NaN; the first of a pair in the low half."""
    ulp = 2.0 ** -10
    vals = [1.0 + ulp / 2, 1.0 + 3 * ulp / 2, -(1.0 + ulp / 2), 65519.99, 65520.0, -65520.0,
            2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -26, 1.5 * 2.0 ** -24, 0.0, -0.0, np.inf, -np.inf, np.nan, 0.1,
            -7.3e-6, 1e-9, 3.14159, -2.5]
    _check_pack(vals)


@pytest.mark.skipif(L.simulator_enabled(), reason="2^20 values take minutes on the CUDA simulator; "
                    "test_pair_pack_rounds_to_nearest_even checks the edges there")
def test_pair_pack_on_random_bits_on_the_gpu():
    """``cvt.rn.f16x2.f32`` against NumPy on 2^20 fp32 bit patterns whose exponents
    span fp16's range and beyond (subnormal results, overflow to inf)."""
    rng = np.random.default_rng(16)
    exp = rng.integers(127 - 28, 127 + 17, 1 << 20, dtype=np.uint32) << np.uint32(23)
    sign = rng.integers(0, 2, 1 << 20, dtype=np.uint32) << np.uint32(31)
    bits = exp | rng.integers(0, 1 << 23, 1 << 20, dtype=np.uint32) | sign
    _check_pack(bits.view(np.float32))
