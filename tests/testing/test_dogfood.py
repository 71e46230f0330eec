"""gpurouter passes its own conformance suite: the reference (backend="jax") in CI,
the numba kernels on the CUDA simulator (tiny, few examples) and on a GPU (defaults)."""

from __future__ import annotations

import pytest

import gpurouter as gr
from gpurouter.testing import check_aux_loss, check_aux_scores, check_router_z_loss, check_topk


def _fns(backend):
    return {
        "topk": (check_topk, lambda *a: gr.fused_topk_with_score_function(*a, backend=backend)),
        "aux-scores": (check_aux_scores, lambda x, k, sf: gr.fused_topk_with_score_function(
            x, k, score_function=sf, compute_aux_scores=True, backend=backend)),
        "aux-loss": (check_aux_loss, lambda p, n, k, c: gr.fused_moe_aux_loss(p, n, k, c, backend=backend)),
        "z-loss": (check_router_z_loss, lambda x, c: gr.router_z_loss(x, c, backend="jax")),
    }


def test_reference_passes_cheap():
    check, fn = _fns("jax")["topk"]
    report = check(fn, max_examples=3, seed=0, properties=["values (tie-free)", "tie rule"])
    assert report.passed and report.examples == 6
    check, fn = _fns("jax")["aux-loss"]
    assert check(fn, max_examples=3, seed=0).passed


@pytest.mark.slow
@pytest.mark.parametrize("op", ["topk", "aux-scores", "aux-loss", "z-loss"])
def test_reference_passes_every_check(op):
    check, fn = _fns("jax")[op]
    report = check(fn, max_examples=10, seed=0)
    print(report)
    assert report.passed


@pytest.mark.cuda
def test_numba_kernels_pass_on_the_simulator():
    check, fn = _fns("numba")["aux-loss"]
    assert check(fn, max_examples=3, seed=0, dtypes=("float32",)).passed


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["topk", "aux-scores", "aux-loss", "z-loss"])
def test_numba_kernels_pass_every_check_on_a_gpu(op):
    check, fn = _fns("numba")[op]
    report = check(fn)  # the defaults: 100 examples per property
    print(report)
    assert report.passed
