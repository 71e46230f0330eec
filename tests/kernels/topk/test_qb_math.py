"""QB's fp32 math (gpurouter/kernels/topk/qb_math.py): the kernels' sigmoid is
``jax.nn.sigmoid`` bit for bit on this platform (the CUDA simulator: XLA:CPU's
exp; a GPU: the mode the op's one-time check picks)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from gpurouter._ops import qb as op_qb  # noqa: E402
from gpurouter.kernels._base.launch import simulator_enabled  # noqa: E402
from gpurouter.kernels.topk import qb_math  # noqa: E402


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def test_sigmoid_is_jax_bit_for_bit():
    """The probe values of the op's one-time check (a grid over [-104, 20], normals,
    +-0, +-inf, the flush to 0 below -87): the same bits as jax.nn.sigmoid."""
    x = op_qb._probe_values(simulator_enabled())
    got = qb_math.qb_sigmoid_probe(x)
    np.testing.assert_array_equal(_bits(got), _bits(jax.nn.sigmoid(jnp.asarray(x))))
    assert op_qb.kernel_exp_mode() == qb_math.default_exp_mode()


def test_sigmoid_exact_values_and_nan():
    got = qb_math.qb_sigmoid_probe(np.array([0.0, np.inf, -np.inf, np.nan, 200.0], np.float32))
    assert got[0] == 0.5 and got[1] == 1.0 and got[2] == 0.0 and np.isnan(got[3]) and got[4] == 1.0
    assert qb_math.qb_sigmoid_probe(np.zeros(0, np.float32)).shape == (0,)


def test_exp_mode_checked():
    with pytest.raises(ValueError, match="exp_mode"):
        qb_math.qb_sigmoid_fn("fast")
