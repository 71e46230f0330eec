"""The 16-byte quad accesses of ``gpurouter/kernels/_base/vec.py`` on aligned and
misaligned arrays (on the simulator: the element fallbacks).
"""

from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from numba import cuda  # noqa: E402

pytestmark = pytest.mark.cuda


def _quad_copy_kernel(variant="checked"):
    """(Kernels name ``cuda`` as a module global: the simulator swaps globals, not closures.)
    ``variant``: ``checked`` (``quad_f32``'s load and store) or ``unchecked``
    (``quad_f32_unchecked``'s load where the source is aligned, else the
    checked one; ``quad_store_once_f32``'s store)."""
    from gpurouter.kernels._base import vec as _vec

    load, store = _vec.quad_f32()
    if variant == "unchecked":
        aligned, load_aligned = _vec.quad_f32_unchecked()
        store_once = _vec.quad_store_once_f32()

        @cuda.jit
        def copy_quads_unchecked(src, dst, n):
            w = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
            if w < n:
                if aligned(src):
                    a, b, c, d = load_aligned(src, w)
                else:
                    a, b, c, d = load(src, w)
                store_once(dst, w, d, c, b, a)

        return copy_quads_unchecked

    @cuda.jit
    def copy_quads(src, dst, n):
        w = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if w < n:
            a, b, c, d = load(src, w)
            store(dst, w, d, c, b, a)

    return copy_quads


@pytest.mark.parametrize("variant", ["checked", "unchecked"])
def test_quad_access_aligned_and_misaligned(variant):
    """``_vec.quad_f32`` (and ``quad_f32_unchecked``, ``quad_store_once_f32``):
    on a GPU 16-byte loads and stores on aligned arrays and the element
    fallback on views whose base is not 16-byte aligned (on the simulator,
    elements throughout): every quad moved, nothing outside."""
    from gpurouter.kernels._base import launch as L

    copy_quads = _quad_copy_kernel(variant)
    host_src = np.arange(4 * 8 + 3, dtype=np.float32) + np.float32(0.5)
    for off_src, off_dst in ((0, 0), (1, 0), (0, 3), (2, 1)):
        src = cuda.to_device(host_src)
        dst = cuda.to_device(np.full(4 * 8 + 3, -7.0, np.float32))
        L.launch(copy_quads, 1, 8, 0, 0, src[off_src:off_src + 32], dst[off_dst:off_dst + 32], 8)
        got = dst.copy_to_host()
        want = host_src[off_src:off_src + 32].reshape(8, 4)[:, ::-1].reshape(-1)
        np.testing.assert_array_equal(got[off_dst:off_dst + 32], want)
        assert (np.delete(got, np.s_[off_dst:off_dst + 32]) == -7.0).all(), "wrote outside the view"


def _u16_quad_kernel():
    """(``cuda`` a module global, as above.) Reads quad ``j`` of row ``i`` of a 2-D
    uint16 array: ``u16_quad_2d``'s 8-byte load where ``aligned``, else the four
    elements; records which path ran."""
    from gpurouter.kernels._base import vec as _vec

    aligned, load = _vec.u16_quad_2d()

    @cuda.jit
    def read_quads(src, out, path):
        i = cuda.blockIdx.x
        j = cuda.threadIdx.x
        if 4 * j < src.shape[1]:
            if aligned(src):
                v = load(src, i, 4 * j)
                path[0] = 1
            else:
                f = 4 * j
                v = (np.uint64(src[i, f]) | (np.uint64(src[i, f + 1]) << np.uint64(16))
                     | (np.uint64(src[i, f + 2]) << np.uint64(32)) | (np.uint64(src[i, f + 3]) << np.uint64(48)))
                path[1] = 1
            out[i, j] = v

    return read_quads


def test_u16_quad_2d_rows_and_alignment():
    """``_vec.u16_quad_2d``: elements ``a[i, 4j .. 4j+3]`` as one uint64, ``a[i, 4j]``
    lowest, on every row of a ``[5, 12]`` uint16 array; ``aligned`` is true for a
    C-contiguous array at an allocation's base and for rows 16 words apart, and
    (on a GPU) false on a view 2 bytes in and for rows 14 words apart (the
    simulator: always true, element loads)."""
    from gpurouter.kernels._base import launch as L

    read_quads = _u16_quad_kernel()
    host = (np.arange(5 * 16 + 1, dtype=np.uint32) * 2654435761 >> 16).astype(np.uint16)
    cases = {  # name: (host rows, device rows, the 8-byte path on a GPU)
        "base": (lambda h: h[:60].reshape(5, 12), True),
        "2 bytes in": (lambda h: h[1:61].reshape(5, 12), False),
        "pitch 16": (lambda h: h[:80].reshape(5, 16)[:, :12], True),
        "pitch 14": (lambda h: h[:70].reshape(5, 14)[:, :12], False),
    }
    for name, (view, fast_on_gpu) in cases.items():
        rows = view(host)
        src = view(cuda.to_device(host))
        out = cuda.to_device(np.zeros((5, 3), np.uint64))
        path = cuda.to_device(np.zeros(2, np.int32))
        L.launch(read_quads, 5, 4, 0, 0, src, out, path)
        w = rows.astype(np.uint64).reshape(5, 3, 4)
        want = w[..., 0] | (w[..., 1] << np.uint64(16)) | (w[..., 2] << np.uint64(32)) | (w[..., 3] << np.uint64(48))
        np.testing.assert_array_equal(out.copy_to_host(), want, err_msg=name)
        fast = fast_on_gpu or L.simulator_enabled()
        assert tuple(path.copy_to_host()) == ((1, 0) if fast else (0, 1)), name
