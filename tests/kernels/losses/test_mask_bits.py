"""The masked aux loss's staged mask bits (``kernels/losses/mask_bits.py``) on
the CUDA simulator or a GPU: ``stage_mask_bits``'s layout and count against
NumPy, and ``keep_if``'s bitwise select (+0.0 for a masked NaN or inf)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from numba import cuda  # noqa: E402  (a module global: the simulator swaps it inside kernels)
from numba import float32 as nb_f32  # noqa: E402
from numba import uint8 as nb_u8  # noqa: E402

from gpurouter.kernels.losses.mask_bits import (  # noqa: E402
    keep_if,
    pick,
    row_bit,
    stage_mask_bits,
    staged_mask_bytes,
)

# the tests launch one small block directly on host arrays: on a GPU numba warns of the small grid and of the
# copies (NumbaPerformanceWarning; pyproject makes warnings errors)
pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings(
    "ignore:.*(Grid size \\d+ will likely result in GPU under-utilization|Host array used in CUDA kernel)")]


def _stage(mask, rows_per_block, nrl, threads):
    """Each block of ``rows_per_block`` rows stages its bits; returns (bits per
    block [grid, nrl * nb] uint8, each block's count)."""
    size = staged_mask_bytes(rows_per_block, nrl)
    nb = size // nrl
    grid = -(-mask.shape[0] // rows_per_block)

    @cuda.jit
    def kernel(mask, out, counts, rows_per_block, nrl, nb):
        bits = cuda.shared.array(0, nb_u8)
        red = cuda.shared.array(64, nb_f32)
        tid = cuda.threadIdx.x
        b = cuda.blockIdx.x
        r0 = b * rows_per_block
        r1 = min(mask.shape[0], r0 + rows_per_block)
        red[tid] = stage_mask_bits(mask, bits, r0, r1, nrl, nb, tid, cuda.blockDim.x)
        # Barrier: thread 0 reads the staged bytes and every thread's count.
        cuda.syncthreads()
        if tid == 0:
            k = np.float32(0)
            for i in range(cuda.blockDim.x):
                k += red[i]
            counts[b] = k
            for i in range(nrl * nb):
                out[b, i] = bits[i]

    out = np.full((grid, size), 0xAA, np.uint8)  # a byte never staged would keep 0xAA
    counts = np.zeros(grid, np.float32)
    kernel[grid, threads, 0, size](mask, out, counts, rows_per_block, nrl, nb)
    return out, counts


@pytest.mark.parametrize("T,rows,nrl,threads", [
    (45, 20, 2, 8),  # 3 blocks (the last of 5 rows), 10 rows a lane: 2 bytes, the second partly past r1
    (33, 33, 4, 3),  # one block, 4 lanes of 9 or 8 rows, fewer threads than bytes (a thread stages several)
    (16, 16, 1, 4),  # one row lane, 2 whole bytes
])
def test_stage_mask_bits_layout_and_count(T, rows, nrl, threads):
    mask = np.random.default_rng(T).random(T) >= 0.35
    mask[rows - 1::rows] = mask[-1] = True  # each block's last row valid: a bit past r1 must not copy it
    out, counts = _stage(mask, rows, nrl, threads)
    nb = out.shape[1] // nrl
    for b in range(out.shape[0]):
        r0, r1 = b * rows, min(T, (b + 1) * rows)
        want = np.zeros((nrl, nb * 8), bool)  # bit k of lane rl: row r0 + rl + k nrl
        for rl in range(nrl):
            for k in range(nb * 8):
                r = r0 + rl + k * nrl
                want[rl, k] = r < r1 and mask[r]
        np.testing.assert_array_equal(out[b], np.packbits(want, axis=1, bitorder="little").reshape(-1))
        assert counts[b] == mask[r0:r1].sum()


def test_keep_if_selects_bits():
    """``keep_if``: the value's bits unchanged (NaN payloads, -0.0, inf) where
    the mask is all ones, +0.0 (bits 0) where it is 0; ``row_bit`` of each bit;
    ``pick`` (the float select) the same bits."""

    @cuda.jit
    def kernel(v, byte, out, out2):
        i = cuda.grid(1)
        if i < v.shape[0]:
            out[i] = keep_if(v[i], row_bit(np.uint32(byte[0]), i % 8))
            out2[i] = pick(v[i], (np.uint32(byte[0]) >> np.uint32(i % 8)) & np.uint32(1) != 0)

    vals = np.array([1.5, np.nan, -np.inf, np.inf, -0.0, -2.0, 3e-40, np.nan], np.float32)
    vals[7] = np.uint32(0xFFC00001).view(np.float32)  # a NaN with a payload
    byte = np.array([0b10110100], np.uint8)  # bits 2, 4, 5, 7 set
    out, out2 = np.empty_like(vals), np.empty_like(vals)
    kernel[1, 8](vals, byte, out, out2)
    keep = [(int(byte[0]) >> i) & 1 for i in range(8)]
    want = np.where(np.array(keep, bool), vals.view(np.uint32), np.uint32(0))
    np.testing.assert_array_equal(out.view(np.uint32), want)
    np.testing.assert_array_equal(out2.view(np.uint32), want)
