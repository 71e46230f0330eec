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
