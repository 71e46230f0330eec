"""Operands shared by the grouped-GEMM GPU tests (tests/test_grouped_matmul_gpu.py,
tests/grouped_gemm/test_pallas_gpu.py, test_mosaic_gpu.py): the MoE issue's full
shapes, balanced or skewed group sizes, one jitted forward + backward per
function. The tests check values; tools/probes (grouped_gemm_probe.py,
pallas_gemm_sweep.py, mosaic_gemm_sweep.py) time them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gpurouter.bench.moe import SHAPES

__all__ = ["SHAPES", "assert_matches", "fwd_bwd", "max_rel_error", "operands", "sizes"]


def sizes(t, e, k, skewed: bool, seed=0):
    """Loads of T tokens routed to K distinct random experts; ``skewed``:
    expert 0 takes rows from the largest others until it has 4x the mean."""
    rng = np.random.default_rng(seed)
    sizes = np.bincount(np.argsort(rng.random((t, e)), axis=1)[:, :k].reshape(-1), minlength=e)
    if skewed:
        need = 4 * (t * k // e) - sizes[0]
        for g in np.argsort(-sizes):
            if need <= 0:
                break
            if g:
                take = min(need, sizes[g] // 2)
                sizes[g] -= take
                sizes[0] += take
                need -= take
        assert sizes[0] == 4 * (t * k // e)
    return jnp.asarray(sizes, jnp.int32)


@functools.cache  # one set per shape for every test (bf16; 7.5 GB of weights at DeepSeek-V3-like)
def operands(name):
    t, h, e, k, m = SHAPES[name][:5]
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    n = t * k
    lhs = jax.random.normal(ks[0], (n, h)).astype(jnp.bfloat16)
    rhs = (jax.random.normal(ks[1], (e, h, m)) / np.sqrt(h)).astype(jnp.bfloat16)
    dy = jax.random.normal(ks[2], (n, m)).astype(jnp.bfloat16)
    return (t, e, k), lhs, rhs, dy


@functools.cache  # one compile per function and shape across the tests
def fwd_bwd(fn):
    def f(a, b, s, d):
        out, vjp = jax.vjp(lambda x, y: fn(x, y, s), a, b)
        return (out, *vjp(d))
    return jax.jit(f)


#: elements of one slab of :func:`max_rel_error` (1 GB in float32)
SLAB = 1 << 28


def max_rel_error(a, b) -> tuple[float, bool]:
    """``(max |a - b| / max |b|, all of a finite)``, reduced on the device one
    slab of the leading axis at a time. The DeepSeek-V3-like d_rhs has 3.8 G
    values: float32 copies of both on the host take 15 GB each, plus their
    difference, and at ebb289d a crowded suite's process was killed (SIGKILL)
    in the mosaic test that made them."""
    rows = max(1, SLAB // max(1, int(np.prod(a.shape[1:]))))
    num = den = 0.0
    finite = True
    for i in range(0, a.shape[0], rows):
        x, y = a[i:i + rows].astype(jnp.float32), b[i:i + rows].astype(jnp.float32)
        num = max(num, float(jnp.max(jnp.abs(x - y))))
        den = max(den, float(jnp.max(jnp.abs(y))))
        finite = finite and bool(jnp.all(jnp.isfinite(x)))
    return (num / den if den else num), finite


def assert_matches(got, want, label: str, bound: float = 2e-2) -> None:
    """Each of (out, d_lhs, d_rhs) ``got`` within ``bound`` of the largest
    value of ``want`` (bf16 both), finite; prints each error."""
    for what, a, b in zip(("out", "d_lhs", "d_rhs"), got, want, strict=True):
        assert a.dtype == b.dtype == jnp.bfloat16, what
        err, finite = max_rel_error(a, b)
        assert finite, what
        print(f"{label} {what}: max error {err:.2e} of the largest value")
        assert err < bound, (what, err)

