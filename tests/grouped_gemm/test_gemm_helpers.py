"""The grouped-GEMM GPU tests' comparison (tests/gemm_gpu_helpers.py), on the
CPU: the error reduced slab by slab is the whole array's, and a non-finite
value or a large error fails."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from gemm_gpu_helpers import assert_matches, max_rel_error


@pytest.mark.parametrize("slab", [1 << 28, 7, 1])
def test_slabs_give_the_whole_arrays_error(monkeypatch, slab):
    import gemm_gpu_helpers

    monkeypatch.setattr(gemm_gpu_helpers, "SLAB", slab)
    rng = np.random.default_rng(0)
    b = rng.normal(size=(5, 3, 4)).astype(np.float32)
    a = b + rng.normal(size=b.shape).astype(np.float32) * 1e-3
    a[4, 2, 1] += 0.5  # the largest difference in the last slab
    want = np.max(np.abs(a - b)) / np.max(np.abs(b))
    err, finite = max_rel_error(jnp.asarray(a), jnp.asarray(b))
    assert finite and err == pytest.approx(want, rel=1e-6)
    a[0, 0, 0] = np.inf
    assert not max_rel_error(jnp.asarray(a), jnp.asarray(b))[1]


def test_assert_matches_fails_on_a_large_error_or_a_nan(capsys):
    b = jnp.asarray(np.random.default_rng(1).normal(size=(6, 4)), jnp.bfloat16)
    ok = (b, b, b)
    assert_matches(ok, ok, "same")
    assert "same d_rhs: max error 0.00e+00" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="d_lhs"):
        assert_matches((b, b * 1.5, b), ok, "off")
    with pytest.raises(AssertionError, match="out"):
        assert_matches((b.at[0, 0].set(jnp.nan), b, b), ok, "nan")
