"""``last_block.py``'s one-block finish of the unit z-loss kernels
(``z_loss_final_kernel``): thread i sums partials i, i + n, ... in order, a
halving tree combines the threads, ``coeff * (S / N)``; the vector kernels'
in-kernel finish is tested in test_z_loss_vec.py."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from gpurouter.kernels._base import launch as L  # noqa: E402
from gpurouter.kernels.losses.last_block import z_loss_final_kernel  # noqa: E402

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("nparts,threads", [(1, 1), (5, 4), (9, 8)])
def test_final_kernel_sums_in_the_fixed_order(nparts, threads):
    from numba import cuda

    partial = np.linspace(0.1, 3.0, nparts).astype(np.float32)
    loss = cuda.device_array((1,), np.float32)
    coeff, total = np.float32(0.37), np.float32(7)
    L.launch(z_loss_final_kernel, 1, threads, 0, 0, cuda.to_device(partial), loss, nparts, coeff, total)
    acc = [np.float32(0)] * threads
    for i in range(nparts):  # thread i's running sum, then the halving tree
        acc[i % threads] = np.float32(acc[i % threads] + partial[i])
    half = threads // 2
    while half:
        for t in range(half):
            acc[t] = np.float32(acc[t] + acc[t + half])
        half //= 2
    assert loss.copy_to_host()[0] == np.float32(coeff * np.float32(acc[0] / total))
