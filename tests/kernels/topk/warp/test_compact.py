"""The warp-per-token forward's compact mode (``warp_topk_fwd_kernel(..., compact=True)``,
``topk_with_score_function_fwd(compact=True)``; docs/contract.md section 11): the weights
``[T, K]`` are the dense probs' bits at the indices, in the selection order, and the op
(``compact=True`` on backend numba where path "auto" takes the warp kernel) launches only
that kernel for the primal, with the jax backend's values and gradients.  Tiny shapes on the
simulator (where "auto" never takes the warp kernel: the op tests force it); a ``gpu`` test
at DeepSeek-V3's shape (T = 4096) for the compact outputs and the group-score rules."""

from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import gpurouter  # noqa: E402
from gpurouter import _backend  # noqa: E402
from gpurouter._ops import topk_kernels as op_topk  # noqa: E402
from gpurouter.kernels.topk.warp.lanes import warp_auto  # noqa: E402

from ..._helpers import host  # noqa: E402

pytestmark = pytest.mark.cuda


def _pair(x, k, **kw):
    dense = [host(a) for a in K.topk_with_score_function_fwd(x, k, return_indices=True, path="warp", **kw)]
    comp = [host(a) for a in K.topk_with_score_function_fwd(x, k, compact=True, path="warp", **kw)]
    return dense, comp


def _check_bits(dense, comp):
    w, ids = comp
    assert ids.dtype == np.int32 and w.dtype == dense[0].dtype and w.shape == ids.shape == dense[3].shape
    np.testing.assert_array_equal(ids, dense[3])
    assert w.tobytes() == np.take_along_axis(dense[0], dense[3], axis=-1).tobytes()


@pytest.mark.parametrize("dtype,fn,grouped", [(np.float32, "sigmoid", True), (np.float16, "softmax", False)])
def test_compact_is_the_dense_bits(dtype, fn, grouped):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 128)).astype(dtype)
    x[1] = np.round(x[1])  # ties
    bias = (rng.standard_normal(128) * 0.05).astype(np.float32) if fn == "sigmoid" else None
    kw = dict(score_function=fn, expert_bias=bias, scaling_factor=2.5)
    if grouped:
        kw.update(num_groups=8, group_topk=2, group_score="max")
    _check_bits(*_pair(x, 4, **kw))


def test_compact_needs_the_warp_kernel():
    x = np.zeros((2, 128), np.float32)
    with pytest.raises(ValueError, match="topk_with_score_function_fwd_plan: compact runs on the warp kernel"):
        K.topk_with_score_function_fwd(x, 4, score_function="sigmoid", compact=True, path="token")


@pytest.mark.skipif(not _backend.numba_usable() or not warp_auto(),
                    reason="the op's path 'auto' takes the warp kernel on a GPU only (on the simulator the "
                           "kernel tests above run it with path='warp')")
def test_op_compact_on_the_warp_kernel(monkeypatch):
    """The op on a GPU, where path "auto" takes the warp kernel: the primal never runs
    the dense forward; values, indices and gradients as the jax backend's."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 128)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(128) * 0.05, jnp.float32)
    kw = dict(num_groups=8, group_topk=2, scaling_factor=2.0, score_function="sigmoid", expert_bias=bias,
              compact=True, group_score="top2_sum")
    calls = []
    real = op_topk._topk_fwd
    monkeypatch.setattr(op_topk, "_topk_fwd", lambda *a: calls.append(1) or real(*a))
    w, ids = gpurouter.fused_topk_with_score_function(x, 4, backend="numba", **kw)
    assert not calls  # the primal: the compact kernel alone
    rw, rids = gpurouter.fused_topk_with_score_function(x, 4, backend="jax", **kw)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(rids))
    np.testing.assert_allclose(np.asarray(w), np.asarray(rw), rtol=1e-6, atol=1e-7)
    cot = jnp.asarray(rng.standard_normal((2, 4)), jnp.float32)

    def loss(backend):
        return lambda v: jnp.sum(gpurouter.fused_topk_with_score_function(v, 4, backend=backend, **kw)[0] * cot)

    g = jax.grad(loss("numba"))(x)
    assert calls  # under the gradient: the dense forward, for the backward's map and scores
    np.testing.assert_allclose(np.asarray(g), np.asarray(jax.grad(loss("jax"))(x)), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_deepseek_v3_compact_and_group_scores():
    """E = 256, K = 8, 8 groups of 32, 4 kept, sigmoid + bias, T = 4096 bf16: the compact outputs
    are the dense bits; each group-score rule selects as the jax reference."""
    import ml_dtypes

    rng = np.random.default_rng(3)
    x = rng.standard_normal((4096, 256)).astype(ml_dtypes.bfloat16)
    x[:64] = np.round(x[:64].astype(np.float32) * 2).astype(ml_dtypes.bfloat16) / 2  # ties
    bias = (rng.standard_normal(256) * 0.05).astype(np.float32)
    kw = dict(score_function="sigmoid", expert_bias=bias, num_groups=8, group_topk=4, scaling_factor=2.5)
    for rule in ("sum_topk", "top2_sum", "max"):
        dense, comp = _pair(x, 8, group_score=rule, **kw)
        _check_bits(dense, comp)
        ref = gpurouter.fused_topk_with_score_function(
            jnp.asarray(x), 8, num_groups=8, group_topk=4, scaling_factor=2.5, score_function="sigmoid",
            expert_bias=jnp.asarray(bias), return_indices=True, group_score=rule, backend="jax")
        np.testing.assert_array_equal(dense[3], np.asarray(ref[2]))
        np.testing.assert_array_equal(dense[1], np.asarray(ref[1]))
