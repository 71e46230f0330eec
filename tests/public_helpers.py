"""The backends, configs and inputs the public-op tests share (tests/ops/:
test_public.py, test_losses.py, test_topk_indices.py, test_routing_map_format.py,
test_edges.py, the token-mask tests): one home,
so that no test file imports another."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpurouter import _backend

_NUMBA_MARKS = [
    pytest.mark.cuda,
    pytest.mark.skipif(not _backend.numba_usable(),
                       reason="backend='numba' needs numba-cuda and a GPU or NUMBA_ENABLE_CUDASIM=1"),
]
# "numba" picks its transport automatically (ffi when JAX is on a GPU);
# "numba:zero-copy" and "numba:callback" force the other two, which are then
# tested on the GPU too.
_ON_GPU_ONLY = pytest.mark.skipif(jax.default_backend() != "gpu",
                                  reason="on a CPU 'numba' already means the callback transport")
BACKENDS = [
    "jax",
    pytest.param("numba", marks=_NUMBA_MARKS),
    pytest.param("numba:zero-copy", marks=[*_NUMBA_MARKS, _ON_GPU_ONLY]),
    pytest.param("numba:callback", marks=[*_NUMBA_MARKS, _ON_GPU_ONLY]),
]


def backend_kw(backend: str) -> dict:
    name, _, transport = backend.partition(":")
    return dict(backend=name, transport=transport or "auto")



def tie_free_logits(shape, dtype, seed=0):
    """Rows of distinct values, well apart at the dtype's precision."""
    rng = np.random.default_rng(seed)
    e = shape[-1]
    rows = int(np.prod(shape[:-1]))
    perms = np.stack([rng.permutation(e) for _ in range(rows)]).reshape(shape)
    return jnp.asarray((perms - e / 2) * (4.0 / e), dtype)


CONFIGS = {
    "softmax-post": dict(score_function="softmax"),
    "softmax-pre": dict(score_function="softmax", use_pre_softmax=True, scaling_factor=1.5),
    "sigmoid-groups-bias": dict(score_function="sigmoid", num_groups=4, group_topk=2,
                                scaling_factor=2.5, bias=True),
    "sqrtsoftplus-bias": dict(score_function="sqrtsoftplus", bias=True, scaling_factor=1.5),
    "sigmoid-k1": dict(score_function="sigmoid", topk=1),
}


def call(fn, x, cfg, **kw):
    cfg = dict(cfg)
    topk = cfg.pop("topk", 4)
    bias = None
    if cfg.pop("bias", False):
        bias = jnp.linspace(0.3, -0.3, x.shape[-1], dtype=jnp.float32)
    return fn(x, topk, expert_bias=bias, **cfg, **kw)


def masked_losses_under_axis_name(mesh, probs, tpe_local, logits, mask, **kw):
    """``(aux loss, z-loss)`` of ``fused_moe_aux_loss`` / ``router_z_loss`` with
    ``token_mask`` and ``axis_name="data"`` in a ``shard_map`` over ``mesh``: the
    rows and the mask sharded, shard i taking ``tpe_local[i]``, each loss
    psummed; ``kw`` (``backend=``, ...) goes to both ops."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import gpurouter as gr

    def shard(q, c, z, m):
        aux = gr.fused_moe_aux_loss(q, c[0], 2, 0.1, axis_name="data", token_mask=m, **kw)
        zl = gr.router_z_loss(z, 0.01, axis_name="data", token_mask=m, **kw)
        return jax.lax.psum(aux, "data"), jax.lax.psum(zl, "data")

    rows = P("data", None)
    sm = jax.shard_map(shard, mesh=mesh, in_specs=(rows, rows, rows, P("data")), out_specs=(P(), P()))
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, NamedSharding(mesh, s))
                for a, s in ((probs, rows), (tpe_local, rows), (logits, rows), (mask, P("data")))]
        return jax.jit(sm)(*args)
