"""The router z-loss's unit kernels (``kernels/losses/z_loss_unit.py``), chosen
by the plans for rows of no whole 16-byte vectors, with a token mask (GPU or
the CUDA simulator; the unmasked unit kernels' values: test_z_loss.py)."""

from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype,E", [(np.float16, 12), (np.float32, 7)])  # quads; masked elements
def test_unit_kernels_masked_and_counting(dtype, E):
    """fp16 E = 12 (24-byte rows: not the vector kernels) and E = 7: the masked unit builds, 3
    blocks of 4 rows, the count taken by the final kernel: the loss of the
    unmasked kernels on the dead rows with N the valid count, bit for bit;
    the masked rows' gradient 0 whatever they hold."""
    from gpurouter.kernels._base.plan import spec_for
    from gpurouter.kernels.losses import last_block as L
    from gpurouter.kernels.losses import z_loss_unit as U

    tiling = K.ZLossTiling(threads=4, bwd_threads=4)
    T = 11
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((T, E)) * 3).astype(dtype)
    mask = np.arange(T) % 4 != 2
    x[~mask, 0] = np.asarray(np.inf, dtype)
    n = int(mask.sum())
    dead = np.where(mask[:, None], x, np.asarray(-np.inf, dtype))
    want, wsaved = K.router_z_loss_fwd(dead, 0.5, n, tiling=tiling)
    loss, saved, got_n = K.router_z_loss_fwd(x, 0.5, token_mask=mask, return_count=True, tiling=tiling)
    assert loss.tobytes() == want.tobytes() and got_n == n
    grad = K.router_z_loss_bwd(x, saved, np.float32(2), 0.5, token_mask=mask, tiling=tiling)
    wgrad = K.router_z_loss_bwd(dead, wsaved, np.float32(2), 0.5, n, tiling=tiling)
    np.testing.assert_array_equal(grad[mask], wgrad[mask])
    assert not grad[~mask].astype(np.float32).any()
    spec = spec_for((T, E), dtype)
    plan = K.router_z_loss_fwd_plan(spec, np.float32(0.5), 1, tiling, True, True)
    quads = E % 4 == 0
    assert [st.kernel for st in plan.steps] == [U.z_loss_rows_kernel(spec.kind, quads, tiling.hold, True, True),
                                                L.z_loss_final_counted_kernel]
