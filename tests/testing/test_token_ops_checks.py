"""check_token_dispatch / check_token_combine: gpurouter's own token ops pass;
one-line mistakes in a dispatch or a combine are caught at the defaults."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import gpurouter.moe as gm
from gpurouter.testing import CheckFailure, check_token_combine, check_token_dispatch


def _dispatch(backend):
    return lambda inp, m, n, probs, align: gm.token_dispatch(inp, m, n, probs, align, backend=backend)


def _combine(backend):
    return lambda inp, rid, w, pad: gm.token_combine(inp, rid, w, pad, backend=backend)


def test_the_reference_passes():
    # 2 examples a property (3 until 2026-11-28: each example compiles the reference again)
    report = check_token_dispatch(_dispatch("jax"), max_examples=2, seed=0)
    assert report.passed and report.examples == 4 * 2, report
    report = check_token_combine(_combine("jax"), _dispatch("jax"), max_examples=2, seed=0)
    assert report.passed and report.examples == 3 * 2, report


def test_the_kernels_pass():
    pytest.importorskip("numba")
    check_token_dispatch(_dispatch("numba"), max_examples=3, seed=0, properties=["values", "gradient"])
    check_token_combine(_combine("numba"), _dispatch("numba"), max_examples=3, seed=0,
                        properties=["values", "gradient"])


def _unweighted_combine(inp, rid, w, pad):  # forgets the merging probs
    return gm.token_combine(inp, rid, None, pad, backend="jax")


def _probs_without_gradient(inp, m, n, probs, align):  # the permuted probs get no gradient
    out = gm.token_dispatch(inp, m, n, probs, align, backend="jax")
    return (out[0], None if out[1] is None else jax.lax.stop_gradient(out[1]), *out[2:])


def _rows_in_fp32(inp, m, n, probs, align):  # the rows upcast and left in fp32
    out = gm.token_dispatch(inp, m, n, probs, align, backend="jax")
    return (out[0].astype(jnp.float32), *out[1:])


def _unpadded_counts(inp, m, n, probs, align):  # tokens_per_expert before the alignment
    out = gm.token_dispatch(inp, m, n, probs, align, backend="jax")
    return (*out[:4], jnp.sum(jnp.asarray(m), axis=0, dtype=jnp.int32))


@pytest.mark.parametrize("mutant, prop", [(_probs_without_gradient, "gradient"), (_rows_in_fp32, "values"),
                                          (_unpadded_counts, "align_size")])
def test_a_broken_dispatch_is_caught(mutant, prop):
    # the default max_examples, on the property that owns the mistake (the others would run first)
    with pytest.raises(CheckFailure, match=f"property '{prop}' failed"):
        check_token_dispatch(mutant, properties=[prop])


def test_a_broken_combine_is_caught():
    with pytest.raises(CheckFailure, match="property 'values' failed"):
        check_token_combine(_unweighted_combine, _dispatch("jax"), properties=["values"])
