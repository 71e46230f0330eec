"""Token-level MoE ops (their public home gpurouter.moe) against the float64 loop oracles of
tests/moe_oracles.py: forward, backward, padding/NaN safety, determinism,
jit / checkpoint / scan, and every error message pinned with ``match=``."""

from __future__ import annotations

import inspect
import re

import hypothesis.strategies as hps
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from gpurouter import moe as mo
from gpurouter.reference import moe_ops as ref
from gpurouter.reference.routing_map import pack_routing_map
from gpurouter.testing import moe_oracle as orc

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Each example compiles its shapes once (~0.3 s): a third of the profile's
# examples, at least 6 (ci: 8; fuzz: 1000), few distinct shapes: the file in about a minute.
FEWER = settings(max_examples=max(6, settings().max_examples // 3))
OPS = ("compute_grouped_dbias_dscales", "compute_grouped_dbias", "grouped_scaled_bias_add",
       "token_dispatch", "token_combine")


def _np(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32)).astype(np.float64)


def _tol(dtype, n_terms: int = 1) -> dict:
    """fp32: atol 1e-5 * sqrt(n) (a reduction of n terms), rtol 1e-5; 16-bit
    outputs: the output cast's rounding (bf16 spacing 2^-8 relative)."""
    if jnp.dtype(dtype) == jnp.float32:
        return dict(atol=1e-5 * np.sqrt(max(n_terms, 1)), rtol=1e-5)
    return dict(atol=1e-2, rtol=1e-2)


def _close(got, want, dtype, n_terms: int = 1):
    np.testing.assert_allclose(_np(got), np.asarray(want, np.float64), **_tol(dtype, n_terms))


def _rand(rng, shape, dtype, nan_rows=()):
    """A random array in ``dtype``; the rows in ``nan_rows`` filled with NaN."""
    x = rng.standard_normal(shape).astype(np.float32)
    for r in nan_rows:
        x[r] = np.nan
    return jnp.asarray(x).astype(dtype)


# ----------------------------------------------------------------------------
# Grouped dbias / dscales
# ----------------------------------------------------------------------------


@hps.composite
def grouped_cases(draw):
    """Groups (empty ones included) with rows before offsets[0] and past offsets[G]."""
    sizes = draw(hps.lists(hps.integers(0, 3), min_size=1, max_size=3))
    head = draw(hps.integers(0, 1))
    tail = 12 - head - sum(sizes)  # N = 12 rows always (0 .. 12 of them past offsets[G])
    h = draw(hps.sampled_from([1, 4]))
    dtype = draw(hps.sampled_from(DTYPES))
    seed = draw(hps.integers(0, 2**16))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32) + head
    n = int(offsets[-1]) + tail
    return sizes, offsets, n, h, dtype, seed


@pytest.mark.parametrize("backend", ["jax", pytest.param("numba", marks=pytest.mark.cuda)])
@FEWER
@given(case=grouped_cases(), accumulate=hps.booleans())
def test_grouped_dbias_dscales_vs_oracle(case, accumulate, backend):
    sizes, offsets, n, h, dtype, seed = case
    rng = np.random.default_rng(seed)
    unowned = [i for i in range(n) if i < offsets[0] or i >= offsets[-1]]
    dy = _rand(rng, (n, h), dtype, nan_rows=unowned)  # NaN where nothing may read it
    scales = _rand(rng, (n,), dtype)
    bias = _rand(rng, (len(sizes), h), dtype)
    want_db, want_ds = orc.grouped_dbias_dscales(_np(jnp.nan_to_num(dy)), _np(scales), _np(bias), offsets)
    kw = {}
    if accumulate:
        kw = dict(dbias=jnp.asarray(rng.standard_normal((len(sizes), h)), jnp.float32),
                  dscales=jnp.asarray(rng.standard_normal(n), jnp.float32))
        want_db = want_db + _np(kw["dbias"])
        want_ds = want_ds + _np(kw["dscales"])
    db, ds = mo.compute_grouped_dbias_dscales(dy, scales, bias, jnp.asarray(offsets), **kw, backend=backend)
    assert db.dtype == jnp.float32 and ds.dtype == jnp.float32
    assert db.shape == (len(sizes), h) and ds.shape == (n,)
    _close(db, want_db, jnp.float32, n)
    _close(ds, want_ds, jnp.float32, h)
    for i in unowned:  # rows no group owns: dscales exactly 0 (+ the accumulator)
        assert float(ds[i]) == (float(kw["dscales"][i]) if accumulate else 0.0)
    for g, s in enumerate(sizes):
        if s == 0 and not accumulate:
            assert not np.any(np.asarray(db[g]))  # an empty group: exactly 0


@pytest.mark.parametrize("backend", ["jax", pytest.param("numba", marks=pytest.mark.cuda)])
@FEWER
@given(case=grouped_cases())
def test_grouped_dbias_vs_oracle(case, backend):
    sizes, offsets, n, h, dtype, seed = case
    rng = np.random.default_rng(seed)
    unowned = [i for i in range(n) if i < offsets[0] or i >= offsets[-1]]
    dy = _rand(rng, (n, h), dtype, nan_rows=unowned)
    db = mo.compute_grouped_dbias(dy, jnp.asarray(offsets), len(sizes), backend=backend)
    assert db.dtype == jnp.float32
    _close(db, orc.grouped_dbias(_np(jnp.nan_to_num(dy)), offsets, len(sizes)), jnp.float32, n)


def test_grouped_dbias_is_bit_identical_across_runs_and_jit():
    rng = np.random.default_rng(0)
    n, h, g = 1000, 16, 7
    dy = jnp.asarray(rng.standard_normal((n, h)) * 100, jnp.float32)
    scales = jnp.asarray(rng.random(n), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((g, h)), jnp.float32)
    offsets = jnp.asarray([0, 10, 10, 400, 401, 700, 950, 990], jnp.int32)
    # Bit-identical repeats of one program (eager: the reference's own jitted
    # core; under a user's jit XLA may fuse multiply-adds differently, so the
    # two programs agree within rounding, each with itself exactly).
    for f in (mo.compute_grouped_dbias_dscales, jax.jit(mo.compute_grouped_dbias_dscales)):
        first = [np.asarray(a) for a in f(dy, scales, bias, offsets)]
        for _ in range(3):
            for a, b in zip(f(dy, scales, bias, offsets), first, strict=True):
                np.testing.assert_array_equal(np.asarray(a), b)
    for a, b in zip(jax.jit(mo.compute_grouped_dbias_dscales)(dy, scales, bias, offsets),
                    mo.compute_grouped_dbias_dscales(dy, scales, bias, offsets), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-3)
    np.testing.assert_array_equal(np.asarray(mo.compute_grouped_dbias(dy, offsets, g)),
                                  np.asarray(mo.compute_grouped_dbias(dy, offsets, g)))


def test_grouped_dbias_inf_stays_in_its_group():
    # A cumsum difference would turn every group after an inf into inf - inf = NaN.
    dy = jnp.asarray([[1.0], [np.inf], [2.0], [3.0]], jnp.float32)
    db = mo.compute_grouped_dbias(dy, jnp.asarray([0, 2, 4]), 2)
    assert np.isinf(float(db[0, 0])) and float(db[1, 0]) == 5.0


def test_grouped_dbias_traced_offsets_under_jit():
    dy = jnp.ones((6, 2), jnp.bfloat16)
    f = jax.jit(lambda d, o: mo.compute_grouped_dbias(d, o, 3))
    np.testing.assert_array_equal(np.asarray(f(dy, jnp.asarray([1, 1, 3, 5]))), [[0, 0], [2, 2], [2, 2]])
    np.testing.assert_array_equal(np.asarray(f(dy, jnp.asarray([0, 6, 6, 6]))), [[6, 6], [0, 0], [0, 0]])


# ----------------------------------------------------------------------------
# Grouped scaled bias add
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["jax", pytest.param("numba", marks=pytest.mark.cuda)])
@FEWER
@given(case=grouped_cases())
def test_grouped_scaled_bias_add_fwd_bwd_vs_oracle(case, backend):
    sizes, offsets, n, h, dtype, seed = case
    n = n - int(offsets[0])  # group_sizes start at row 0: no head rows, the same tail
    offsets = offsets - offsets[0]
    rng = np.random.default_rng(seed)
    tail = list(range(int(offsets[-1]), n))
    y = _rand(rng, (n, h), dtype, nan_rows=tail[:1])
    bias = _rand(rng, (len(sizes), h), dtype)
    scales = _rand(rng, (n,), dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    out, vjp = jax.vjp(lambda a, b, s: mo.grouped_scaled_bias_add(a, b, s, gs, backend=backend), y, bias, scales)
    assert out.dtype == y.dtype
    want = orc.scaled_bias_add(_np(y), _np(bias), _np(scales), sizes)
    np.testing.assert_array_equal(np.isnan(_np(out)), np.isnan(want))
    _close(jnp.nan_to_num(out), np.nan_to_num(want), dtype)
    for i in tail:  # rows past sum(group_sizes): unchanged, bit for bit
        np.testing.assert_array_equal(np.asarray(out[i].view(jnp.uint16 if dtype != jnp.float32 else jnp.uint32)),
                                      np.asarray(y[i].view(jnp.uint16 if dtype != jnp.float32 else jnp.uint32)))
    dy = _rand(rng, (n, h), dtype, nan_rows=tail)  # NaN cotangents on the tail
    d_y, d_b, d_s = vjp(dy)
    assert (d_y.dtype, d_b.dtype, d_s.dtype) == (y.dtype, bias.dtype, scales.dtype)
    want_db, want_ds = orc.grouped_dbias_dscales(_np(jnp.nan_to_num(dy)), _np(scales), _np(bias),
                                                 np.concatenate([[0], np.cumsum(sizes)]))
    np.testing.assert_array_equal(_np(d_y), _np(dy))  # d_y = dy (NaN tail included)
    _close(d_b, want_db, dtype, n)
    _close(d_s, want_ds, dtype, h)
    assert not np.isnan(_np(d_b)).any() and not np.isnan(_np(d_s)).any()


# ----------------------------------------------------------------------------
# Token dispatch / combine
# ----------------------------------------------------------------------------


@hps.composite
def routing_cases(draw):
    """Routing maps: exactly K per token (K = 1 .. E), all on one expert, or
    arbitrary (tokens and experts with no routes), with optional alignment."""
    t = draw(hps.sampled_from([1, 5]))
    e = draw(hps.sampled_from([1, 3, 4]))
    kind = draw(hps.sampled_from(["topk", "one", "any"]))
    rng = np.random.default_rng(draw(hps.integers(0, 2**16)))
    if kind == "topk":
        k = draw(hps.integers(1, e))
        m = np.zeros((t, e), bool)
        for row in range(t):
            m[row, rng.permutation(e)[:k]] = True
    elif kind == "one":
        m = np.zeros((t, e), bool)
        m[:, draw(hps.integers(0, e - 1))] = True
    else:
        m = rng.random((t, e)) < draw(hps.sampled_from([0.0, 0.3, 0.7]))
    h = 3
    align = draw(hps.sampled_from([None, 1, 2, 3, 4]))
    slack = draw(hps.sampled_from([0, 0, 2]))  # num_out_tokens above the routed count
    num_out = max(int(m.sum()) + slack, 1)
    dtype = draw(hps.sampled_from(DTYPES))
    with_probs = draw(hps.booleans())
    bitmap = draw(hps.booleans())
    return m, h, num_out, align, dtype, with_probs, bitmap, rng


@pytest.mark.parametrize("backend", ["jax", pytest.param("numba", marks=pytest.mark.cuda)])
@FEWER
@given(case=routing_cases())
def test_token_dispatch_fwd_bwd_vs_oracle(case, backend):
    m, h, num_out, align, dtype, with_probs, bitmap, rng = case
    t, e = m.shape
    x = _rand(rng, (t, h), dtype)
    probs = jnp.asarray(np.where(m, rng.random((t, e)), 0.0), dtype) if with_probs else None
    rmap = pack_routing_map(jnp.asarray(m)) if bitmap else jnp.asarray(m)
    kw = dict(num_experts=e) if bitmap and not with_probs else {}
    out, pp, rid, pad, tpe = mo.token_dispatch(x, rmap, num_out, probs, align, **kw, backend=backend)
    w_out, w_pp, w_rid, w_pad, w_tpe = orc.dispatch(_np(x), m, num_out, None if probs is None else _np(probs),
                                                    align)
    np.testing.assert_array_equal(np.asarray(rid), w_rid)
    assert rid.dtype == jnp.int32 and tpe.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(tpe), w_tpe)
    if align is None:
        assert pad is None
    else:
        np.testing.assert_array_equal(np.asarray(pad), w_pad)
    assert out.dtype == x.dtype and out.shape == w_out.shape
    np.testing.assert_array_equal(_np(out), w_out)  # a pure copy: exact
    if probs is None:
        assert pp is None
    else:
        assert pp.dtype == probs.dtype
        np.testing.assert_array_equal(_np(pp), w_pp)

    # Backward: NaN cotangents on rows no pair holds must not leak.
    held = set(int(r) for r in w_rid.ravel() if r >= 0)
    free = [r for r in range(out.shape[0]) if r not in held]
    d_out = _rand(rng, out.shape, dtype, nan_rows=free)
    d_pp = None if probs is None else _rand(rng, (out.shape[0],), dtype, nan_rows=free)

    def f(a, p):
        o, q, *_ = mo.token_dispatch(a, rmap, num_out, p, align, **kw, backend=backend)
        return o, q

    _, vjp = jax.vjp(f, x, probs)
    d_x, d_p = vjp((d_out, d_pp))
    w_dx, w_dp = orc.dispatch_bwd(_np(jnp.nan_to_num(d_out)), None if d_pp is None else
                                  _np(jnp.nan_to_num(d_pp)), w_rid)
    assert d_x.dtype == x.dtype
    _close(d_x, w_dx, dtype, e)
    if probs is not None:
        assert d_p.dtype == probs.dtype
        _close(d_p, w_dp, dtype)


@pytest.mark.parametrize("backend", ["jax", pytest.param("numba", marks=pytest.mark.cuda)])
@FEWER
@given(case=routing_cases())
def test_token_combine_fwd_bwd_vs_oracle(case, backend):
    m, h, num_out, align, dtype, with_probs, _, rng = case
    t, e = m.shape
    _, _, w_rid, _, _ = orc.dispatch(np.zeros((t, 1)), m, num_out, None, align)
    rows = ((num_out + e * (align - 1)) // align) * align if align else num_out
    held = set(int(r) for r in w_rid.ravel() if r >= 0)
    free = [r for r in range(rows) if r not in held]
    z = _rand(rng, (rows, h), dtype, nan_rows=free)  # padding rows hold NaN
    w = jnp.asarray(np.where(m, rng.random((t, e)), 0.0), dtype) if with_probs else None
    rid = jnp.asarray(w_rid, jnp.int32)
    if w is None:
        y, vjp = jax.vjp(lambda a: mo.token_combine(a, rid, backend=backend), z)
    else:
        y, vjp = jax.vjp(lambda a, b: mo.token_combine(a, rid, b, backend=backend), z, w)
    assert y.dtype == z.dtype and y.shape == (t, h)
    z_clean = _np(jnp.nan_to_num(z))
    _close(y, orc.combine(z_clean, w_rid, None if w is None else _np(w)), dtype, e)
    dy = _rand(rng, (t, h), dtype)
    grads = vjp(dy)
    w_dz, w_dw = orc.combine_bwd(_np(dy), z_clean, w_rid, None if w is None else _np(w))
    assert grads[0].dtype == z.dtype
    _close(grads[0], w_dz, dtype)
    for r in free:  # padding rows of d_inp: exactly 0, never NaN
        assert not np.any(_np(grads[0][r]))
    if w is not None:
        assert grads[1].dtype == w.dtype
        assert not np.isnan(_np(grads[1])).any()
        _close(grads[1], w_dw, dtype, h)


@FEWER
@given(case=routing_cases())
def test_dispatch_then_combine_is_the_prob_weighted_sum(case):
    m, h, _, align, _, _, _, rng = case
    t, e = m.shape
    x = _rand(rng, (t, h), jnp.float32)
    p = jnp.asarray(np.where(m, rng.random((t, e)), 0.0), jnp.float32)
    out, _, rid, pad, _ = mo.token_dispatch(x, jnp.asarray(m), max(int(m.sum()), 1), p, align)
    y = mo.token_combine(out, rid, p, pad)
    want = _np(x) * _np(p).sum(axis=1, keepdims=True)  # sum_k p_k x_t
    _close(y, want, jnp.float32, e)


@pytest.mark.parametrize("backend", ["jax", pytest.param("numba", marks=pytest.mark.cuda)])
def test_dispatch_rows_past_num_out_tokens_are_dropped(backend):
    m = jnp.asarray([[True, True], [True, False], [False, True]])
    x = jnp.asarray([[1.0], [2.0], [3.0]])
    out, _, rid, _, tpe = mo.token_dispatch(x, m, 3, backend=backend)
    np.testing.assert_array_equal(np.asarray(rid), [[0, 2], [1, -1], [-1, -1]])
    np.testing.assert_array_equal(np.asarray(out[:, 0]), [1.0, 2.0, 1.0])
    np.testing.assert_array_equal(np.asarray(tpe), [2, 2])
    d = jax.grad(lambda a: jnp.sum(mo.token_dispatch(a, m, 3, backend=backend)[0]))(x)
    np.testing.assert_array_equal(np.asarray(d[:, 0]), [2.0, 1.0, 0.0])


@pytest.mark.parametrize("backend", ["jax", pytest.param("numba", marks=pytest.mark.cuda)])
def test_dispatch_padding_rows_are_zero_and_combine_pad_offsets_is_optional(backend):
    m = jnp.asarray([[True, False], [True, True], [False, True]])
    x = jnp.asarray([[1.0], [2.0], [3.0]], jnp.bfloat16)
    out, _, rid, pad, tpe = mo.token_dispatch(x, m, 4, align_size=4, backend=backend)
    assert out.shape == (8, 1)  # ((4 + 2 * 3) // 4) * 4
    np.testing.assert_array_equal(np.asarray(pad), [0, 2])
    np.testing.assert_array_equal(np.asarray(tpe), [4, 4])
    np.testing.assert_array_equal(_np(out[:, 0]), [1, 2, 0, 0, 2, 3, 0, 0])
    np.testing.assert_array_equal(np.asarray(mo.token_combine(out, rid, backend=backend)),
                                  np.asarray(mo.token_combine(out, rid, pad_offsets=pad, backend=backend)))


# ----------------------------------------------------------------------------
# jit, checkpoint, scan
# ----------------------------------------------------------------------------


def _op_cases(backend="jax"):
    """(name, differentiable fn of float args, float args): one per op (``backend``:
    the ops with kernels only, on that backend)."""
    kw = dict(backend=backend)
    rng = np.random.default_rng(3)
    off = jnp.asarray([0, 2, 2, 5], jnp.int32)
    dy, sc, b = _rand(rng, (6, 3), jnp.float32), _rand(rng, (6,), jnp.float32), _rand(rng, (3, 3), jnp.float32)
    m = jnp.asarray(rng.random((5, 4)) < 0.5).at[:, 0].set(True)
    x, p = _rand(rng, (5, 3), jnp.float32), jnp.asarray(rng.random((5, 4)), jnp.float32)
    n_out = int(m.sum())
    _, _, rid, _, _ = mo.token_dispatch(x, m, n_out, align_size=2)
    z = _rand(rng, (int(mo.token_dispatch(x, m, n_out, align_size=2)[0].shape[0]), 3), jnp.float32)
    cases = [
        ("dbias_dscales", lambda d, s, bb: sum(jnp.sum(a ** 2) for a in
                                              mo.compute_grouped_dbias_dscales(d, s, bb, off, **kw)), (dy, sc, b)),
        ("dbias", lambda d: jnp.sum(mo.compute_grouped_dbias(d, off, 3, **kw) ** 2), (dy,)),
        ("scaled_bias_add", lambda y, bb, s: jnp.sum(mo.grouped_scaled_bias_add(
            y, bb, s, jnp.asarray([2, 0, 3]), **kw) ** 2), (dy, b, sc)),
        ("dispatch", lambda a, q: sum(jnp.sum(o ** 2) for o in
                                      mo.token_dispatch(a, m, n_out, q, 2, **kw)[:2]), (x, p)),
        ("combine", lambda a, q: jnp.sum(mo.token_combine(a, rid, q, **kw) ** 2), (z, p)),
    ]
    return cases


def _backend_cases():
    """(backend, name, fn, args) of every op on jax and of the kernel ops on numba (simulator or GPU)."""
    out = [pytest.param("jax", *c, id=f"jax-{c[0]}") for c in _op_cases()]
    out += [pytest.param("numba", *c, id=f"numba-{c[0]}", marks=pytest.mark.cuda) for c in _op_cases("numba")]
    return out


@pytest.mark.parametrize("backend,name,fn,args", _backend_cases())
def test_every_op_under_jit_checkpoint_scan_and_vmap(backend, name, fn, args):
    want = fn(*args)
    want_g = jax.grad(fn, argnums=tuple(range(len(args))))(*args)
    np.testing.assert_allclose(float(jax.jit(fn)(*args)), float(want), rtol=1e-6)
    got_g = jax.jit(jax.grad(jax.checkpoint(fn), argnums=tuple(range(len(args)))))(*args)
    for a, b in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

    def body(carry, xs):
        return carry + fn(*xs), None

    stacked = tuple(jnp.stack([a, 2 * a]) for a in args)
    want2 = fn(*(2 * a for a in args))  # (once: each eager call launches the kernels)
    total, _ = jax.lax.scan(body, jnp.float32(0), stacked)
    np.testing.assert_allclose(float(total), float(want + want2), rtol=1e-5)
    g_scan = jax.grad(lambda st: jax.lax.scan(body, jnp.float32(0), st)[0])(stacked)
    for a, b in zip(g_scan, want_g, strict=True):
        np.testing.assert_allclose(np.asarray(a[0]), np.asarray(b), rtol=1e-5, atol=1e-6)
    # vmap over a leading batch of the float arguments (values and gradients)
    vals = jax.vmap(fn)(*stacked)
    np.testing.assert_allclose(np.asarray(vals), [float(want), float(want2)], rtol=1e-5)
    g_vmap = jax.vmap(jax.grad(fn, argnums=tuple(range(len(args)))))(*stacked)
    for a, b in zip(g_vmap, want_g, strict=True):
        np.testing.assert_allclose(np.asarray(a[0]), np.asarray(b), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------
# API and errors
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", OPS)
def test_signature_is_the_reference_plus_keyword_backend_and_transport(name):
    pub = list(inspect.signature(getattr(mo, name)).parameters.values())
    assert [(p.name, p.default) for p in pub[-2:]] == [("backend", "auto"), ("transport", "auto")]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in pub[-2:])
    assert pub[:-2] == list(inspect.signature(getattr(ref, name)).parameters.values())


def test_te_positional_order():
    def names(f):
        return [p.name for p in inspect.signature(f).parameters.values()]

    assert names(mo.compute_grouped_dbias_dscales)[:6] == ["dy", "scales", "bias", "offsets", "dbias", "dscales"]
    assert names(mo.compute_grouped_dbias)[:4] == ["dy", "offsets", "num_groups", "dbias"]
    assert names(mo.token_dispatch)[:5] == ["inp", "routing_map", "num_out_tokens", "probs", "align_size"]
    assert names(mo.token_combine)[:4] == ["inp", "row_id_map", "merging_probs", "pad_offsets"]


D = jnp.zeros((4, 3), jnp.float32)
S = jnp.zeros((4,), jnp.float32)
B = jnp.zeros((2, 3), jnp.float32)
OFF = jnp.asarray([0, 2, 4], jnp.int32)
M = jnp.zeros((4, 5), bool)
RID = jnp.full((4, 5), -1, jnp.int32)
GS = jnp.asarray([2, 2], jnp.int32)

DBS, DB, SBA, DIS, COM = OPS
CASES = [
    # (op, args, kwargs, exception, message)
    (DBS, (D[0], S, B, OFF), {}, ValueError, f"{DBS}: dy shape (3,) must have rank 2 ([num_rows, hidden])."),
    (DBS, (D.astype(jnp.int32), S, B, OFF), {}, TypeError,
     f"{DBS}: dy must be float32, bfloat16 or float16 (or float64 with backend=\"jax\"), got int32."),
    (DBS, (D, S[:3], B, OFF), {}, ValueError, f"{DBS}: scales shape (3,) must be (num_rows,) = (4,)."),
    (DBS, (D, S, B[:, :2], OFF), {}, ValueError,
     f"{DBS}: bias shape (2, 2) must be (num_groups, hidden) with num_groups >= 1 and hidden = dy.shape[1] (3)."),
    (DBS, (D, S, B, OFF[:2]), {}, ValueError, f"{DBS}: offsets shape (2,) must be (num_groups + 1,) = (3,)."),
    (DBS, (D, S, B, OFF.astype(jnp.float32)), {}, TypeError, f"{DBS}: offsets must be integers, got float32."),
    (DBS, (D, S, B, jnp.asarray([0, 3, 2])), {}, ValueError, f"{DBS}: offsets ([0, 3, 2]) must be non-decreasing."),
    (DBS, (D, S, B, OFF), dict(dbias=B.astype(jnp.bfloat16)), TypeError,
     f"{DBS}: dbias must be float32 (it is accumulated into), got bfloat16."),
    (DBS, (D, S, B, OFF), dict(dscales=S[:2]), ValueError,
     f"{DBS}: dscales shape (2,) must be (4,) (it is accumulated into)."),
    (DBS, ([[0.0]], S, B, OFF), {}, TypeError,
     f"{DBS}: dy must be an array (jax.Array or numpy.ndarray), got list; wrap it as jnp.asarray(dy)."),
    (DB, (D, OFF, 0), {}, ValueError, f"{DB}: num_groups (0) must be >= 1."),
    (DB, (D, OFF, 2.0), {}, TypeError, f"{DB}: num_groups (2.0) must be an int, got float."),
    (DB, (D, OFF, 3), {}, ValueError, f"{DB}: offsets shape (3,) must be (num_groups + 1,) = (4,)."),
    (DB, (D, OFF, 2), dict(dbias=B[:1]), ValueError,
     f"{DB}: dbias shape (1, 3) must be (2, 3) (it is accumulated into)."),
    (SBA, (D, B, S, GS[:1]), {}, ValueError, f"{SBA}: group_sizes shape (1,) must be (num_groups,) = (2,)."),
    (SBA, (D, B, S, jnp.asarray([3, -1])), {}, ValueError,
     f"{SBA}: group_sizes ([3, -1]) must be >= 0 and sum to at most y.shape[0] (4)."),
    (SBA, (D, B, S, GS.astype(jnp.float32)), {}, TypeError, f"{SBA}: group_sizes must be integers, got float32."),
    (SBA, (D, B[:, :1], S, GS), {}, ValueError,
     f"{SBA}: bias shape (2, 1) must be (num_groups, hidden) with num_groups >= 1 and hidden = y.shape[1] (3)."),
    (SBA, (D, B, S[:1], GS), {}, ValueError, f"{SBA}: scales shape (1,) must be (num_rows,) = (4,)."),
    (DIS, (D, M, 0), {}, ValueError, f"{DIS}: num_out_tokens (0) must be > 0."),
    (DIS, (D, M, 4), dict(align_size=0), ValueError, f"{DIS}: align_size (0) must be >= 1 (or None)."),
    (DIS, (D, M, 4.0), {}, TypeError, f"{DIS}: num_out_tokens (4.0) must be an int, got float."),
    (DIS, (D[0], M, 4), {}, ValueError, f"{DIS}: inp shape (3,) must have rank 2 ([num_tokens, hidden])."),
    (DIS, (D, M[:3], 4), {}, ValueError,
     f"{DIS}: routing_map shape (3, 5) must have num_tokens = inp.shape[0] (4) rows."),
    (DIS, (D, M.astype(jnp.int32), 4), {}, TypeError,
     f"{DIS}: routing_map must be bool (BYTEMAP) or uint8 (BITMAP_U8), got int32."),
    (DIS, (D, jnp.zeros((4, 1), jnp.uint8), 4), {}, ValueError,
     f"{DIS}: num_experts must be given (or probs) with a uint8 routing_map (BITMAP_U8): "
     "its byte count only bounds it."),
    (DIS, (D, jnp.zeros((4, 1), jnp.uint8), 4), dict(num_experts=9), ValueError,
     f"{DIS}: routing_map shape (4, 1) (uint8, a BITMAP_U8) must end in ceil(num_experts / 8) = 2 "
     "for num_experts (9)."),
    (DIS, (D, M, 4, jnp.zeros((4, 4))), {}, ValueError,
     f"{DIS}: probs shape (4, 4) must be (num_tokens, num_experts) = (4, 5)."),
    (DIS, (D, M, 4, jnp.zeros((4, 5))), dict(num_experts=6), ValueError,
     f"{DIS}: num_experts (6) must equal probs.shape[1] (5)."),
    (DIS, (D, M, 4, jnp.zeros((4, 5), jnp.int32)), {}, TypeError,
     f"{DIS}: probs must be float32, bfloat16 or float16 (or float64 with backend=\"jax\"), got int32."),
    (COM, (D, RID.astype(jnp.float32)), {}, TypeError, f"{COM}: row_id_map must be integers, got float32."),
    (COM, (D, RID[0]), {}, ValueError, f"{COM}: row_id_map shape (5,) must have rank 2 ([num_tokens, num_experts])."),
    (COM, (D, RID, jnp.zeros((4, 4))), {}, ValueError,
     f"{COM}: merging_probs shape (4, 4) must be row_id_map's (num_tokens, num_experts) = (4, 5)."),
    (COM, (D, RID, None, jnp.zeros((4,), jnp.int32)), {}, ValueError,
     f"{COM}: pad_offsets shape (4,) must be (num_experts,) = (5,)."),
    (COM, (D, RID, None, jnp.zeros((5,))), {}, TypeError, f"{COM}: pad_offsets must be integers, got float32."),
    (COM, (D, jnp.zeros((4, 0), jnp.int32)), {}, ValueError,
     f"{COM}: num_experts (row_id_map.shape[1] = 0) must be >= 1."),
]


@pytest.mark.parametrize("module", [mo, ref], ids=["public", "reference"])
@pytest.mark.parametrize("op,args,kwargs,exc,msg", CASES, ids=[c[4].split(": ", 1)[1][:48] for c in CASES])
def test_errors(module, op, args, kwargs, exc, msg):
    with pytest.raises(exc, match="^" + re.escape(msg)):
        getattr(module, op)(*args, **kwargs)


def _valid_args(op):
    return {DBS: (D, S, B, OFF), DB: (D, OFF, 2), SBA: (D, B, S, GS), DIS: (D, M, 4), COM: (D, RID)}[op]


@pytest.mark.parametrize("op", OPS)
def test_backend_and_transport_values(op):
    with pytest.raises(ValueError, match="^" + re.escape(f"{op}: transport ('pcie') must be one of 'auto', "
                                                         "'callback', 'ffi', 'zero-copy'.")):
        getattr(mo, op)(*_valid_args(op), transport="pcie")
    with pytest.raises(ValueError, match="^" + re.escape(f"{op}: backend ('cuda') must be one of 'auto', 'jax', "
                                                         "'numba'.")):
        getattr(mo, op)(*_valid_args(op), backend="cuda")
    auto, jax_ = getattr(mo, op)(*_valid_args(op)), getattr(mo, op)(*_valid_args(op), backend="jax")
    for a, b in zip(jax.tree.leaves(auto), jax.tree.leaves(jax_), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_traced_static_arguments_are_refused_under_jit():
    with pytest.raises(TypeError, match="^" + re.escape(
            f"{DIS}: num_out_tokens must be a static Python int, got a traced value")):
        jax.jit(lambda n: mo.token_dispatch(D, M, n))(4)
    with pytest.raises(TypeError, match="^" + re.escape(
            f"{DB}: num_groups must be a static Python int, got a traced value")):
        jax.jit(lambda g: mo.compute_grouped_dbias(D, OFF, g))(2)


# ----------------------------------------------------------------------------
# The numba backend (the CUDA simulator in CI, a GPU where there is one)
# ----------------------------------------------------------------------------


@pytest.mark.cuda
def test_numba_grouped_dbias_dscales_is_bit_identical_across_runs():
    rng = np.random.default_rng(0)
    n, h, g = 300, 8, 5
    dy = jnp.asarray(rng.standard_normal((n, h)) * 100, jnp.bfloat16)
    scales = jnp.asarray(rng.random(n), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((g, h)), jnp.float32)
    offsets = jnp.asarray([0, 10, 10, 140, 141, 290], jnp.int32)
    f = jax.jit(lambda *a: mo.compute_grouped_dbias_dscales(*a, backend="numba"))
    first = [np.asarray(a) for a in f(dy, scales, bias, offsets)]
    for got in (f(dy, scales, bias, offsets), mo.compute_grouped_dbias_dscales(dy, scales, bias, offsets,
                                                                                 backend="numba")):
        for a, b in zip(got, first, strict=True):  # the kernel's order, eager or under jit
            np.testing.assert_array_equal(np.asarray(a), b)
    want = orc.grouped_dbias_dscales(_np(dy), _np(scales), _np(bias), np.asarray(offsets))
    _close(first[0], want[0], jnp.float32, n)
    _close(first[1], want[1], jnp.float32, h)


@pytest.mark.cuda
@pytest.mark.parametrize("op,args,kwargs,exc,msg", CASES, ids=[c[4].split(": ", 1)[1][:48] for c in CASES])
def test_errors_on_numba_read_the_same(op, args, kwargs, exc, msg):
    with pytest.raises(exc, match="^" + re.escape(msg)):
        getattr(mo, op)(*args, **kwargs, backend="numba")


@pytest.mark.cuda
def test_numba_refuses_float64_and_too_many_experts():
    with jax.enable_x64(True):
        with pytest.raises(TypeError, match="^" + re.escape(
                f"{DBS}: dy dtype (float64) must be float32, bfloat16 or float16 with backend=\"numba\"")):
            mo.compute_grouped_dbias_dscales(D.astype(jnp.float64), S, B, OFF, backend="numba")
    with pytest.raises(NotImplementedError, match="^" + re.escape(
            f'{COM} (numba): num_experts (1025) exceeds the kernel limit of 1024; use backend="jax".')):
        mo.token_combine(D, jnp.full((4, 1025), -1, jnp.int32), backend="numba")


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["zero-copy", "ffi", "callback"])
def test_numba_transports_agree_on_a_gpu(transport):
    """Every transport launches the same plans: the same bits as the default's (on a GPU)."""
    rng = np.random.default_rng(5)
    dy, sc = _rand(rng, (300, 64), jnp.bfloat16), _rand(rng, (300,), jnp.float32)
    b, off = _rand(rng, (4, 64), jnp.bfloat16), jnp.asarray([0, 50, 50, 200, 290], jnp.int32)
    m = jnp.asarray(rng.random((40, 8)) < 0.4)
    x, p = _rand(rng, (40, 64), jnp.bfloat16), jnp.asarray(rng.random((40, 8)), jnp.float32)

    def run(**kw):
        out, pp, rid, _, _ = mo.token_dispatch(x, m, int(m.sum()) + 3, p, 4, backend="numba", **kw)
        y, vjp = jax.vjp(lambda a, q: mo.token_combine(a, rid, q, backend="numba", **kw), out, p)
        return (*mo.compute_grouped_dbias_dscales(dy, sc, b, off, backend="numba", **kw), out, pp, y, *vjp(x))

    for a, want in zip(run(transport=transport), run(), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(want))


def test_auto_runs_the_kernels_where_they_measured_faster(monkeypatch):
    """gpurouter/_auto.py: with a device transport (faked), the MoE ops on the
    kernels from AUTO_MOE_MIN_ELEMENTS row elements (the dispatch from
    AUTO_DISPATCH_MIN_ELEMENTS output row elements), never float64, never an
    unknown or too large E, never the host callback."""
    from gpurouter import _auto, _backend, _transport
    from gpurouter.kernels.moe.permute import CMB_MAX_EXPERTS

    f32, f64, bf16 = jnp.float32, jnp.float64, jnp.bfloat16
    n = _auto.AUTO_MOE_MIN_ELEMENTS
    monkeypatch.setattr(_transport, "resolve_transport", lambda op, t: "ffi")
    assert _auto.moe_kernels_faster(COM, "auto", n, [bf16, f32], 128)
    assert not _auto.moe_kernels_faster(COM, "auto", n - 1, [bf16], 128)
    assert not _auto.moe_kernels_faster(COM, "auto", n, [f64], 128)
    assert not _auto.moe_kernels_faster(COM, "auto", n, [bf16], CMB_MAX_EXPERTS + 1)
    assert not _auto.moe_kernels_faster(DIS, "auto", n, [bf16], -1)  # a packed map without probs
    assert not _auto.moe_kernels_faster(DIS, "auto", _auto.AUTO_DISPATCH_MIN_ELEMENTS - 1, [bf16], 128)
    assert _auto.moe_kernels_faster(DIS, "auto", _auto.AUTO_DISPATCH_MIN_ELEMENTS, [bf16], 128)
    assert _auto.moe_kernels_faster(DB, "auto", n, [f32])
    monkeypatch.setattr(_transport, "resolve_transport", lambda op, t: "callback")
    assert not _auto.moe_kernels_faster(DB, "auto", 1 << 40, [f32])

    # what each public op asks: its rows times hidden, its arrays' dtypes, its E
    monkeypatch.setattr(_transport, "resolve_transport", lambda op, t: "ffi")
    asked = []
    monkeypatch.setattr(_auto, "moe_kernels_faster", lambda *a: asked.append(a) or False)
    monkeypatch.setattr(_backend, "resolve", lambda op, b, faster=None: faster() and "numba" or "jax")
    for op in OPS:
        getattr(mo, op)(*_valid_args(op))
    rows = {DBS: 4 * 3, DB: 4 * 3, SBA: 4 * 3, DIS: 4 * 3, COM: 4 * 3}
    assert [(a[0], a[2]) for a in asked] == [(op, rows[op]) for op in OPS]
    assert asked[OPS.index(DIS)][4] == 5 and asked[OPS.index(COM)][4] == 5


def test_errors_are_the_references_where_auto_could_pick_the_kernels(monkeypatch):
    """With JAX on a GPU (faked), "auto" asks the measured rule before the
    arguments are checked: a list, a traced size or a wrong rank must still
    reach the reference's checks and their messages (they once raised jnp's
    own errors on the GPU)."""
    from gpurouter import _backend, _transport

    monkeypatch.setattr(_backend, "zero_copy_available", lambda: True)
    monkeypatch.setattr(_transport, "resolve_transport", lambda op, t: "ffi")
    for op, args, kwargs, exc, msg in CASES:
        with pytest.raises(exc, match="^" + re.escape(msg)):
            getattr(mo, op)(*args, **kwargs)
    test_traced_static_arguments_are_refused_under_jit()


def test_auto_leaves_a_wrong_accumulator_to_the_references_check(monkeypatch):
    """A float64 dbias to add to is an array the kernels do not take: "auto"
    sees its dtype, stays on the reference, and the reference's check says
    what is wrong (JAX on a GPU faked)."""
    from gpurouter import _auto, _backend, _transport

    seen = []
    monkeypatch.setattr(_transport, "resolve_transport", lambda op, t: "ffi")
    monkeypatch.setattr(_auto, "moe_kernels_faster", lambda op, t, n, dtypes, e=None: seen.append(dtypes) or False)
    monkeypatch.setattr(_backend, "resolve", lambda op, b, faster=None: faster() and "numba" or "jax")
    with jax.enable_x64(True):
        acc = jnp.zeros((2, 3), jnp.float64)
        with pytest.raises(TypeError, match="dbias must be float32 .it is accumulated into., got float64"):
            mo.compute_grouped_dbias_dscales(D, S, B, OFF, dbias=acc)
        with pytest.raises(TypeError, match="dbias must be float32 .it is accumulated into., got float64"):
            mo.compute_grouped_dbias(D, OFF, 2, acc)
    assert jnp.float64 in seen[0] and jnp.float64 in seen[1]


def test_moe_ops_is_the_moe_modules_ops_under_the_older_path():
    """``gpurouter.moe_ops`` re-exports the five ops of ``gpurouter.moe`` (the
    same function objects), and ``gpurouter.moe`` is their one home: the
    bodies live in gpurouter/_ops/ (no module handles in between)."""
    import gpurouter.moe_ops as old

    assert sorted(old.__all__) == sorted(OPS)
    for op in OPS:
        assert getattr(old, op) is getattr(mo, op), op
        assert getattr(mo, op).__module__ in ("gpurouter._ops.grouped_bias", "gpurouter._ops.permute"), op


def test_a_token_is_followed_by_name_from_moe_to_the_dispatch_kernels():
    """The static walk of issue 39 (review change 3): from ``gpurouter.moe.moe``
    the tokens go by direct calls of imported names (no module handles such as
    the old ``_kernels()``) to ``_ops/permute.py``'s dispatch, whose functions
    reach the functions that import ``gpurouter/kernels/moe/`` (the plans and
    the kernel module) by name."""
    import ast
    import pathlib

    import gpurouter

    pkg = pathlib.Path(gpurouter.__file__).parent

    def functions(path):
        tree = ast.parse((pkg / path).read_text())
        return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}

    def called(fn):  # names called, or passed as arguments (the transport's launcher/planner)
        names = {c.func.id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        return names | {a.id for c in ast.walk(fn) if isinstance(c, ast.Call) for a in c.args
                        if isinstance(a, ast.Name)}

    def imports_kernels(fn):
        return {a.name for n in ast.walk(fn) if isinstance(n, ast.ImportFrom) and (n.module or "") in
                ("kernels.moe", "kernels.moe.permute", "kernels.moe.plans") for a in n.names}

    moe_fns, permute_fns = functions("moe.py"), functions("_ops/permute.py")
    assert "block_dispatch" in called(moe_fns["moe"])
    assert "_kernels" not in permute_fns and "_kernels" not in functions("_ops/grouped_bias.py")
    seen, todo, reached = set(), ["block_dispatch"], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in permute_fns:
            continue
        seen.add(name)
        reached |= imports_kernels(permute_fns[name])
        todo += sorted(called(permute_fns[name]))
    for fn in ("token_dispatch", "_kernel_token_dispatch", "_dispatch_apply", "_dispatch_apply_fwd"):
        assert fn in seen, fn
    assert {"plans", "CMB_MAX_EXPERTS"} <= reached, reached
