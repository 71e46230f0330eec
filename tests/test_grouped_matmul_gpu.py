"""``tiled_ragged_dot`` on a GPU at the MoE issue's two full shapes (issue #38):
the same values and gradients as ``batched_ragged_dot`` in bf16, balanced and
skewed routing (the largest expert at 4x the mean load), and no cliff: its
forward + backward under the skewed routing within 1.5x of the balanced one.
The times are printed (``-s``) for the record; tools/probes/grouped_gemm_probe.py
has the breakdown."""

from __future__ import annotations

import jax
import pytest
from gemm_gpu_helpers import SHAPES
from gemm_gpu_helpers import assert_matches as _assert_matches
from gemm_gpu_helpers import fwd_bwd as _fwd_bwd
from gemm_gpu_helpers import median_ms as _median_ms
from gemm_gpu_helpers import operands as _operands
from gemm_gpu_helpers import sizes as _sizes

from gpurouter.reference.grouped_matmul import batched_ragged_dot, tiled_ragged_dot

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("routing", ["balanced", "skewed"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_tiled_equals_batched_at_the_full_shapes(name, routing):
    (t, e, k), lhs, rhs, dy = _operands(name)
    sizes = _sizes(t, e, k, routing == "skewed")
    got = _fwd_bwd(tiled_ragged_dot)(lhs, rhs, sizes, dy)
    want = _fwd_bwd(batched_ragged_dot)(lhs, rhs, sizes, dy)
    _assert_matches(got, want, f"{name} {routing}")


@pytest.mark.parametrize("name", list(SHAPES))
def test_tiled_skewed_routing_within_one_and_a_half_balanced(name):
    """The issue's "no cliff" target, forward + backward."""
    (t, e, k), lhs, rhs, dy = _operands(name)
    f = _fwd_bwd(tiled_ragged_dot)
    ms = {r: _median_ms(f, (lhs, rhs, _sizes(t, e, k, r == "skewed"), dy)) for r in ("balanced", "skewed")}
    g = _fwd_bwd(batched_ragged_dot)
    ref = {r: _median_ms(g, (lhs, rhs, _sizes(t, e, k, r == "skewed"), dy)) for r in ("balanced", "skewed")}
    print(f"{name} fwd+bwd ms: tiled {ms}, batched {ref} ({jax.devices()[0].device_kind})")
    assert ms["skewed"] <= 1.5 * ms["balanced"], ms
