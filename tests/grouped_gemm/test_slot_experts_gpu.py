"""The expert FFN in capacity slots (``moe(..., grouped_matmul="slots")``) on a
GPU at the MoE issue's two full shapes: the same values and gradients in bf16
as the row-by-row FFN on ``batched_ragged_dot``, balanced routing (slots) and
skewed (the largest expert at 4x the mean: the largest slots, 1.5x the mean,
and tiles past them).
Times: ``moe-bench --grouped-matmul batched,slots``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gemm_gpu_helpers import SHAPES, max_rel_error
from gemm_gpu_helpers import sizes as _sizes

from gpurouter.reference.grouped_matmul import batched_ragged_dot
from gpurouter.reference.moe import _expert_ffn, rows_of_groups
from gpurouter.reference.slot_experts import slots_expert_ffn

pytestmark = pytest.mark.gpu


@functools.cache
def _operands(name):
    t, h, e, k, m = SHAPES[name][:5]
    ks = jax.random.split(jax.random.PRNGKey(1), 6)
    n = t * k
    x = jax.random.normal(ks[0], (n, h)).astype(jnp.bfloat16)
    w = dict(wi_0=(jax.random.normal(ks[1], (e, h, m)) / np.sqrt(h)).astype(jnp.bfloat16),
             wi_1=(jax.random.normal(ks[2], (e, h, m)) / np.sqrt(h)).astype(jnp.bfloat16),
             wo=(jax.random.normal(ks[3], (e, m, h)) / np.sqrt(m)).astype(jnp.bfloat16))
    w_rows = jax.random.uniform(ks[4], (n,), jnp.float32)
    dz = jax.random.normal(ks[5], (n, h), jnp.float32)
    return (t, e, k), x, w, w_rows, dz


@functools.cache
def _step(slots: bool):
    def f(x, w, w_rows, sizes, dz):
        rows_e = rows_of_groups(sizes, x.shape[0])
        kw = dict(wi_0_bias=None, wi_1_bias=None, wo_bias=None, activation=jax.nn.silu, early=True,
                  dtype=jnp.bfloat16)
        if slots:
            fn = functools.partial(slots_expert_ffn, **kw)
        else:
            fn = functools.partial(_expert_ffn, **kw, align_size=0, grouped_matmul=batched_ragged_dot)
        z, vjp = jax.vjp(lambda x_, w_: fn(x_, rows_e, sizes, w_rows, **w_), x, w)
        dx, dw = vjp(dz)
        return z, dx, dw["wi_0"], dw["wo"]
    return jax.jit(f)


@pytest.mark.parametrize("routing", ["balanced", "skewed"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_slots_equal_the_row_ffn_at_the_full_shapes(name, routing):
    (t, e, k), x, w, w_rows, dz = _operands(name)
    sizes = _sizes(t, e, k, routing == "skewed")
    got = _step(True)(x, w, w_rows, sizes, dz)
    want = _step(False)(x, w, w_rows, sizes, dz)
    for what, a, b in zip(("z", "d x", "d wi_0", "d wo"), got, want, strict=True):
        assert a.dtype == b.dtype, what
        err, finite = max_rel_error(a, b)
        print(f"{name} {routing} {what}: max error {err:.2e} of the largest value")
        assert finite and err < 2e-2, (what, err)
