"""Every validation message of docs/contract.md section 6, pinned with ``match=``.

Each case runs through the public op (backend "jax": validation is shared by
every backend and happens before dispatch) and through the reference.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gpurouter as gr
from gpurouter import reference as ref

TOPK = "fused_topk_with_score_function"
AUX = "fused_moe_aux_loss"

X8 = jnp.zeros((4, 8), jnp.float32)
B8 = jnp.zeros((8,), jnp.float32)

TOPK_CASES = [
    # (args, kwargs, exception, message)
    ((X8, 0), {}, ValueError, f"{TOPK}: topk (0) must be >= 1."),
    ((X8, 9), {}, ValueError, f"{TOPK}: topk (9) must be <= num_experts (8)."),
    ((X8, 2.0), {}, TypeError, f"{TOPK}: topk (2.0) must be an int, got float."),
    ((X8, True), {}, TypeError, f"{TOPK}: topk (True) must be an int, got bool."),
    ((X8, 2), dict(num_groups=3, group_topk=1), ValueError,
     f"{TOPK}: num_experts (8) must be divisible by num_groups (3)."),
    ((X8, 2), dict(num_groups=-1, group_topk=1), ValueError,
     f"{TOPK}: num_groups (-1) must be >= 1 when group_topk (1) > 0."),
    ((X8, 3), dict(num_groups=4, group_topk=2), ValueError,
     f"{TOPK}: topk (3) must be divisible by group_topk (2)."),
    ((X8, 4), dict(num_groups=2, group_topk=4), ValueError,
     f"{TOPK}: group_topk (4) must be <= num_groups (2)."),
    ((X8, 6), dict(num_groups=4, group_topk=2), ValueError,
     f"{TOPK}: topk / group_topk (3) must be <= num_experts / num_groups (2)."),
    ((X8, 2), dict(expert_bias=B8), ValueError,
     f"{TOPK}: expert_bias (shape (8,)) must be None with score_function ('softmax'); "
     "the bias is for sigmoid and sqrtsoftplus only."),
    ((X8, 2), dict(score_function="sigmoid", expert_bias=jnp.zeros((7,))), ValueError,
     f"{TOPK}: expert_bias shape (7,) must be (num_experts,) = (8,)."),
    ((X8, 2), dict(score_function="sigmoid", expert_bias=jnp.zeros((1, 8))), ValueError,
     f"{TOPK}: expert_bias shape (1, 8) must be (num_experts,) = (8,)."),
    ((X8, 2), dict(score_function="sigmoid", expert_bias=jnp.zeros((8,), jnp.int32)), TypeError,
     f"{TOPK}: expert_bias must be float32, bfloat16 or float16 (or float64 with backend=\"jax\"), got int32."),
    ((jnp.float32(1.0), 1), {}, ValueError,
     f"{TOPK}: logits rank (0) must be >= 1 (logits are [..., num_experts])."),
    ((jnp.zeros((4, 0)), 1), {}, ValueError,
     f"{TOPK}: num_experts (logits.shape[-1] = 0) must be >= 1."),
    ((jnp.zeros((4, 8), jnp.int32), 2), {}, TypeError,
     f"{TOPK}: logits must be float32, bfloat16 or float16 (or float64 with backend=\"jax\"), got int32."),
    ((X8, 2), dict(score_function="relu"), ValueError,
     f"{TOPK}: score_function ('relu') must be one of 'softmax', 'sigmoid', 'sqrtsoftplus'"),
    ((X8, 2), dict(score_function=7), ValueError,
     f"{TOPK}: score_function (7) must be one of"),
    # a float is no score function (as topk=2.0 is no topk)
    ((X8, 2), dict(score_function=1.0), TypeError,
     f"{TOPK}: score_function (1.0) must be a str ('softmax', 'sigmoid', 'sqrtsoftplus'), an int code "
     "or a gpurouter.ScoreFunction, got float."),
    ((X8, 2), dict(score_function=True), TypeError, f"{TOPK}: score_function (True) must be a str"),
    ((X8, 2), dict(scaling_factor=float("inf")), ValueError, f"{TOPK}: scaling_factor (inf) must be finite."),
    ((X8, 2), dict(scaling_factor=float("nan")), ValueError, f"{TOPK}: scaling_factor (nan) must be finite."),
    ((X8, 2), dict(scaling_factor=-float("inf")), ValueError, f"{TOPK}: scaling_factor (-inf) must be finite."),
    (([[0.0, 1.0, 2.0]], 1), {}, TypeError,
     f"{TOPK}: logits must be an array (jax.Array or numpy.ndarray), got list; wrap it as jnp.asarray(logits)."),
    ((X8, 2), dict(score_function="sigmoid", expert_bias=[0.0] * 8), TypeError,
     f"{TOPK}: expert_bias must be an array (jax.Array or numpy.ndarray), got list"),
    ((X8, 2), dict(routing_map_format=2), ValueError,
     f"{TOPK}: routing_map_format (2) must be one of 'bytemap', 'bitmap_u8' or a gpurouter.RoutingMapFormat."),
    ((X8, 2), dict(routing_map_format="bitmap"), ValueError,
     f"{TOPK}: routing_map_format ('bitmap') must be one of 'bytemap', 'bitmap_u8'"),
    ((X8, 2), dict(routing_map_format=1.0), TypeError,
     f"{TOPK}: routing_map_format (1.0) must be a str ('bytemap', 'bitmap_u8'), an int code or a "
     "gpurouter.RoutingMapFormat, got float."),
    ((X8, 2), dict(routing_map_format=None), TypeError, f"{TOPK}: routing_map_format (None) must be a str"),
    ((X8, 2), dict(scaling_factor="2"), TypeError,
     f"{TOPK}: scaling_factor ('2') must be a Python int or float, got str."),
]


@pytest.mark.parametrize("fn", [gr.fused_topk_with_score_function, ref.fused_topk_with_score_function],
                         ids=["public", "reference"])
@pytest.mark.parametrize("args,kwargs,exc,msg", TOPK_CASES,
                         ids=[c[3].split(": ", 1)[1][:48] for c in TOPK_CASES])
def test_topk_errors(fn, args, kwargs, exc, msg):
    with pytest.raises(exc, match="^" + re.escape(msg)):
        fn(*args, **kwargs)


@pytest.mark.parametrize("fn", [gr.fused_topk_with_score_function, ref.fused_topk_with_score_function],
                         ids=["public", "reference"])
def test_traced_topk_must_be_static(fn):
    with pytest.raises(TypeError, match=re.escape(
            f"{TOPK}: topk must be a static Python int, got a traced value (under jax.jit pass it as a "
            "static argument")):
        jax.jit(lambda x, k: fn(x, k))(X8, 2)
    with pytest.raises(TypeError, match=re.escape(
            f"{TOPK}: scaling_factor must be a static Python int or float, got a traced value")):
        jax.jit(lambda x, s: fn(x, 2, scaling_factor=s))(X8, 2.0)


def test_topk_errors_raise_at_trace_time_under_jit():
    with pytest.raises(ValueError, match=re.escape(f"{TOPK}: topk (9) must be <= num_experts (8).")):
        jax.jit(lambda x: gr.fused_topk_with_score_function(x, 9)).lower(X8)


def test_bad_backend():
    with pytest.raises(ValueError, match=re.escape(
            f"{TOPK}: backend ('cuda') must be one of 'auto', 'jax', 'numba'.")):
        gr.fused_topk_with_score_function(X8, 2, backend="cuda")
    with pytest.raises(ValueError, match=re.escape(
            f"{AUX}: backend ('x') must be one of 'auto', 'jax', 'numba'.")):
        gr.fused_moe_aux_loss(X8, jnp.zeros((8,), jnp.int32), 2, 0.1, backend="x")


def test_group_checks_ignored_when_grouping_is_off():
    # group_topk <= 0 disables grouping: num_groups is then not checked (TE's sentinel).
    probs, rmap = gr.fused_topk_with_score_function(X8, 2, num_groups=3, group_topk=-1)
    assert probs.shape == (4, 8) and int(rmap.sum()) == 8


@pytest.mark.parametrize("kw,name", [
    (dict(num_groups=4, group_topk=2), "group_topk (2) does nothing with compute_aux_scores=True"),
    (dict(expert_bias=B8), "expert_bias (shape (8,)) does nothing with compute_aux_scores=True"),
    (dict(scaling_factor=2.5), "scaling_factor (2.5) does nothing with compute_aux_scores=True"),
    (dict(use_pre_softmax=True), "use_pre_softmax (True) does nothing with compute_aux_scores=True"),
])
def test_aux_scores_refuse_arguments_that_do_nothing(kw, name):
    # one rule for every op (contract section 6): an argument that does nothing is an error
    for backend in ("jax", "numba"):
        with pytest.raises(ValueError, match=re.escape(f"fused_topk_with_score_function: {name}")):
            gr.fused_topk_with_score_function(X8, 2, score_function="sigmoid", compute_aux_scores=True,
                                              backend=backend, **kw)


@pytest.mark.parametrize("sf", ["sigmoid", "sqrtsoftplus"])
def test_pre_softmax_without_softmax_is_an_error(sf):
    with pytest.raises(ValueError, match=re.escape(
            f"fused_topk_with_score_function: use_pre_softmax (True) does nothing with score_function ('{sf}')")):
        gr.fused_topk_with_score_function(X8, 2, use_pre_softmax=True, score_function=sf, backend="jax")


@pytest.mark.parametrize("name", ["use_pre_softmax", "compute_aux_scores", "return_indices"])
@pytest.mark.parametrize("value", ["no", 0, 1, None])
def test_flags_must_be_bools(name, value):
    # "no" would be truthy: a flag takes True or False only (contract section 6)
    for backend in ("jax", "numba"):
        with pytest.raises(TypeError, match=re.escape(
                f"fused_topk_with_score_function: {name} ({value!r}) must be a bool")):
            gr.fused_topk_with_score_function(X8, 2, backend=backend, **{name: value})
    with pytest.raises(TypeError, match=re.escape(f"fused_topk_with_score_function: {name} ({value!r})")):
        ref.fused_topk_with_score_function(X8, 2, **{name: value})


def test_aux_loss_of_no_tokens_is_zero():
    loss = gr.fused_moe_aux_loss(jnp.zeros((0, 8)), TPE, 2, 0.1)
    assert loss.shape == () and float(loss) == 0.0
    grad = jax.grad(lambda p: gr.fused_moe_aux_loss(p, TPE, 2, 0.1))(jnp.zeros((0, 8)))
    assert grad.shape == (0, 8)
    # an explicit count of 0 with no tokens is the same empty sum (contract section 6)
    for fn in (gr.fused_moe_aux_loss, ref.fused_moe_aux_loss):
        assert float(fn(jnp.zeros((0, 8)), TPE, 2, 0.1, total_num_tokens=0)) == 0.0
    for fn in (gr.router_z_loss, ref.router_z_loss):
        assert float(fn(jnp.zeros((0, 8)), 0.1, total_num_tokens=0)) == 0.0


@pytest.mark.parametrize("call", ["topk", "aux", "z"])
def test_numpy_float64_refused_by_the_kernels(call):
    # a NumPy float64 array is not cast to float32 silently by jnp.asarray first
    x64 = np.zeros((4, 8), np.float64)
    msg = 'dtype (float64) must be float32, bfloat16 or float16 with backend="numba"'
    with pytest.raises(TypeError, match=re.escape(msg)):
        if call == "topk":
            gr.fused_topk_with_score_function(x64, 2, backend="numba")
        elif call == "aux":
            gr.fused_moe_aux_loss(x64, TPE, 2, 0.1, backend="numba")
        else:
            gr.router_z_loss(x64, 0.1, backend="numba")


P = jnp.zeros((4, 8), jnp.float32)
TPE = jnp.zeros((8,), jnp.int32)

AUX_CASES = [
    ((jnp.zeros((4, 2, 8)), TPE, 2, 0.1), {}, ValueError,
     f"{AUX}: probs shape (4, 2, 8) must have rank 2 ([num_tokens, num_cols])."),
    ((jnp.zeros((4, 8), jnp.int32), TPE, 2, 0.1), {}, TypeError,
     f"{AUX}: probs must be float32, bfloat16 or float16 (or float64 with backend=\"jax\"), got int32."),
    ((P, jnp.zeros((7,), jnp.int32), 2, 0.1), {}, ValueError,
     f"{AUX}: tokens_per_expert shape (7,) must be (num_cols,) = (8,)."),
    ((P, jnp.zeros((8,), jnp.float16), 2, 0.1), {}, TypeError,
     f"{AUX}: tokens_per_expert must be int32, int64, float32 or bfloat16, got float16."),
    ((P, TPE, 0, 0.1), {}, ValueError, f"{AUX}: topk (0) must be >= 1."),
    ((P, TPE, 9, 0.1), {}, ValueError, f"{AUX}: topk (9) must be <= num_experts (8)."),
    ((jnp.zeros((4, 16)), jnp.zeros((16,), jnp.int32), 5, 0.1), dict(num_experts=4), ValueError,
     f"{AUX}: topk (5) must be <= num_experts (4)."),
    (([[0.1] * 8], TPE, 2, 0.1), {}, TypeError,
     f"{AUX}: probs must be an array (jax.Array or numpy.ndarray), got list; wrap it as jnp.asarray(probs)."),
    ((P, [1] * 8, 2, 0.1), {}, TypeError,
     f"{AUX}: tokens_per_expert must be an array (jax.Array or numpy.ndarray), got list"),
    ((P, TPE, 2, 0.1), dict(num_experts=3), ValueError,
     f"{AUX}: num_cols (probs.shape[1] = 8) must be a multiple of num_experts (3)."),
    ((P, TPE, 2, 0.1), dict(num_experts=0), ValueError, f"{AUX}: num_experts (0) must be >= 1."),
    ((P, TPE, 2, 0.1), dict(total_num_tokens=0), ValueError,
     f"{AUX}: total_num_tokens (0) must be > 0 (or 0 with no tokens; there are 4)."),
    ((P, TPE, 2, 0.1), dict(total_num_tokens=-5), ValueError,
     f"{AUX}: total_num_tokens (-5) must be > 0 (or 0 with no tokens; there are 4)."),
    ((P, TPE, 2, float("nan")), {}, ValueError, f"{AUX}: coeff (nan) must be finite."),
    ((P, TPE, 2, float("-inf")), {}, ValueError, f"{AUX}: coeff (-inf) must be finite."),
    ((jnp.zeros((4, 0)), jnp.zeros((0,), jnp.int32), 2, 0.1), {}, ValueError,
     f"{AUX}: num_cols (probs.shape[1] = 0) must be >= 1."),
    ((P, TPE, 2, "0.1"), {}, TypeError, f"{AUX}: coeff ('0.1') must be a Python int or float, got str."),
]


@pytest.mark.parametrize("fn", [gr.fused_moe_aux_loss, ref.fused_moe_aux_loss], ids=["public", "reference"])
@pytest.mark.parametrize("args,kwargs,exc,msg", AUX_CASES,
                         ids=[c[3].split(": ", 1)[1][:48] for c in AUX_CASES])
def test_aux_loss_errors(fn, args, kwargs, exc, msg):
    with pytest.raises(exc, match="^" + re.escape(msg)):
        fn(*args, **kwargs)


def test_float64_rejected_by_the_kernel_backend():
    from gpurouter import _backend

    if not _backend.numba_usable():
        pytest.skip("backend='numba' needs numba-cuda and a GPU or NUMBA_ENABLE_CUDASIM=1")
    with jax.enable_x64(True):
        x = jnp.zeros((4, 8), jnp.float64)
        with pytest.raises(TypeError, match=re.escape(
                f"{TOPK}: logits dtype (float64) must be float32, bfloat16 or float16 with backend=\"numba\"")):
            gr.fused_topk_with_score_function(x, 2, backend="numba")
        with pytest.raises(TypeError, match=re.escape(
                f"{AUX}: probs dtype (float64) must be float32, bfloat16 or float16 with backend=\"numba\"")):
            gr.fused_moe_aux_loss(x, TPE, 2, 0.1, backend="numba")
        # The jax backend takes float64 (used by check_grads in the tests).
        probs, _ = gr.fused_topk_with_score_function(x, 2, backend="jax")
        assert probs.dtype == np.float64


def test_bad_transport():
    with pytest.raises(ValueError, match=re.escape(
            f"{TOPK}: transport ('gpu') must be one of 'auto', 'callback', 'ffi', 'zero-copy'.")):
        gr.fused_topk_with_score_function(X8, 2, backend="numba", transport="gpu")


def test_zero_copy_needs_jax_on_a_gpu():
    import jax

    from gpurouter import _backend

    if jax.default_backend() == "gpu":
        pytest.skip("JAX runs on a GPU here: zero-copy is available")
    if not _backend.numba_usable():
        pytest.skip("backend='numba' needs numba-cuda and a GPU or NUMBA_ENABLE_CUDASIM=1")
    with pytest.raises(RuntimeError, match=re.escape(
            f'{AUX}: transport="zero-copy" needs JAX on a CUDA GPU')):
        gr.fused_moe_aux_loss(P, TPE, 2, 0.1, backend="numba", transport="zero-copy")


def test_kernel_limits_say_the_limit_and_the_way_out():
    from gpurouter import _backend

    if not _backend.numba_usable():
        pytest.skip("backend='numba' needs numba-cuda and a GPU or NUMBA_ENABLE_CUDASIM=1")
    from gpurouter.kernels._base import limits as _limits

    x = jax.ShapeDtypeStruct((2, _limits.MAX_EXPERTS + 1), jnp.float32)
    with pytest.raises(NotImplementedError, match=re.escape(
            f"{TOPK} (numba): num_experts ({_limits.MAX_EXPERTS + 1}) exceeds the kernel limit of "
            f'{_limits.MAX_EXPERTS}; use backend="jax".')):
        jax.eval_shape(lambda x: gr.fused_topk_with_score_function(x, 2, backend="numba"), x)
    x = jax.ShapeDtypeStruct((2, 128), jnp.float32)
    with pytest.raises(NotImplementedError, match=re.escape(
            f"{TOPK} (numba): topk ({_limits.MAX_TOPK + 1}) exceeds the kernel limit of {_limits.MAX_TOPK}")):
        jax.eval_shape(lambda x: gr.fused_topk_with_score_function(x, _limits.MAX_TOPK + 1, backend="numba"), x)


RM = "unpack_routing_map"


@pytest.mark.parametrize("args,exc,msg", [
    ((jnp.zeros((4, 2), jnp.uint8), None), ValueError,
     f"{RM}: num_experts must be given with a uint8 routing_map (BITMAP_U8): its byte count only bounds it."),
    ((jnp.zeros((4, 2), jnp.uint8), 17), ValueError,
     f"{RM}: routing_map shape (4, 2) (uint8, a BITMAP_U8) must end in ceil(num_experts / 8) = 3 "
     "for num_experts (17)."),
    ((jnp.zeros((4, 8), bool), 7), ValueError,
     f"{RM}: routing_map shape (4, 8) (bool, a BYTEMAP) must end in num_experts (7)."),
    ((jnp.zeros((4, 8), jnp.int32), 8), TypeError,
     f"{RM}: routing_map must be bool (BYTEMAP) or uint8 (BITMAP_U8), got int32."),
    ((jnp.zeros((4, 1), jnp.uint8), 0), ValueError, f"{RM}: num_experts (0) must be >= 1."),
    ((jnp.zeros((4, 1), jnp.uint8), 8.0), TypeError, f"{RM}: num_experts (8.0) must be an int, got float."),
    (([[True, False]], 2), TypeError, f"{RM}: routing_map must be an array (jax.Array or numpy.ndarray), got list"),
    ((jnp.zeros((), bool), 1), ValueError, f"{RM}: routing_map rank (0) must be >= 1"),
])
def test_routing_map_helper_errors(args, exc, msg):
    with pytest.raises(exc, match="^" + re.escape(msg)):
        gr.unpack_routing_map(*args)


def test_pack_takes_a_bytemap_only():
    with pytest.raises(TypeError, match="^" + re.escape(
            "pack_routing_map: routing_map must be bool [..., num_experts] (BYTEMAP), got uint8.")):
        gr.pack_routing_map(jnp.zeros((4, 1), jnp.uint8))
    with pytest.raises(ValueError, match="^" + re.escape(
            "tokens_per_expert: num_experts must be given with a uint8 routing_map")):
        gr.tokens_per_expert(jnp.zeros((4, 1), jnp.uint8))


# ----------------------------------------------------------------------------
# The router variants (docs/contract.md sections 9-12)
# ----------------------------------------------------------------------------

H8 = jnp.zeros((8, 5), jnp.int32)
BOUNDS = jnp.array([-1.0, 1.0], jnp.float32)
QB = dict(score_function="sigmoid", expert_bias=B8, qb_histogram=H8, qb_bin_bounds=BOUNDS)

VARIANT_CASES = [
    ((X8, 2), dict(group_score="top3"), ValueError,
     f"{TOPK}: group_score ('top3') must be one of 'sum_topk', 'top2_sum', 'max'."),
    ((X8, 2), dict(group_score=2), TypeError, f"{TOPK}: group_score (2) must be a str"),
    ((X8, 2), dict(group_score="max"), ValueError,
     f"{TOPK}: group_score ('max') needs grouping on (group_topk > 0); without groups it would do nothing."),
    ((X8, 2), dict(group_score="max", compute_aux_scores=True), ValueError,
     f"{TOPK}: group_score ('max') must be 'sum_topk' with compute_aux_scores=True"),
    ((X8, 2), dict(group_score="top2_sum", num_groups=8, group_topk=2), ValueError,
     f"{TOPK}: group_score ('top2_sum') needs num_experts / num_groups (1) >= 2."),
    ((X8, 2), dict(compact=True, return_indices=True), ValueError,
     f"{TOPK}: return_indices must be False with compact=True"),
    ((X8, 2), dict(compact=True, compute_aux_scores=True), ValueError,
     f"{TOPK}: compact must be False with compute_aux_scores=True"),
    ((X8, 2), dict(compact=True, routing_map_format="bitmap_u8"), ValueError,
     f"{TOPK}: routing_map_format must be BYTEMAP with compact=True"),
    ((X8, 2), dict(compact=1), TypeError, f"{TOPK}: compact (1) must be a bool, got int."),
    ((X8, 2), dict(indices_dtype="int16"), ValueError,
     f"{TOPK}: indices_dtype (int16) needs an index output (compact=True or return_indices=True)"),
    ((X8, 2), dict(indices_dtype="int64"), TypeError, f"{TOPK}: indices_dtype (int64) must be int32 or int16."),
    ((jnp.zeros((1, 40000)), 2), dict(indices_dtype="int16", compact=True), ValueError,
     f"{TOPK}: indices_dtype int16 needs num_experts (40000) <= 32768; use int32."),
    ((X8, 2), dict(score_function="sigmoid", expert_bias=B8, qb_histogram=H8), ValueError,
     f"{TOPK}: qb_histogram needs qb_bin_bounds too"),
    ((X8, 2), dict(score_function="sigmoid", qb_histogram=H8, qb_bin_bounds=BOUNDS), ValueError,
     f"{TOPK}: qb_histogram needs expert_bias"),
    ((X8, 2), dict(qb_histogram=H8, qb_bin_bounds=BOUNDS), ValueError,
     f"{TOPK}: qb_histogram needs score_function 'sigmoid' (or 'sqrtsoftplus'), got 'softmax'."),
    ((X8, 8), QB, ValueError, f"{TOPK}: topk (8) must be < num_experts (8) with qb_histogram"),
    ((X8, 2), dict(QB, compute_aux_scores=True), ValueError,  # QB's bias does nothing there (one rule)
     f"{TOPK}: expert_bias (shape (8,)) does nothing with compute_aux_scores=True"),
    ((X8, 2), dict(QB, forced_indices=jnp.tile(jnp.arange(2, dtype=jnp.int32), (4, 1))), ValueError,
     f"{TOPK}: qb_histogram must be None with forced_indices"),
    ((X8, 4), dict(QB, num_groups=4, group_topk=2), ValueError,
     f"{TOPK}: group_topk * num_experts / num_groups (4) must be >= topk + 1 (5) with qb_histogram"),
    ((X8, 2), dict(QB, qb_histogram=H8.astype(jnp.float32)), TypeError,
     f"{TOPK}: qb_histogram must be int32, got float32."),
    ((X8, 2), dict(QB, qb_histogram=jnp.zeros((7, 5), jnp.int32)), ValueError,
     f"{TOPK}: qb_histogram shape (7, 5) must be (num_experts, num_bins) = (8, B), B >= 1."),
    ((X8, 2), dict(QB, qb_bin_bounds=jnp.array([1.0, -1.0])), ValueError,
     f"{TOPK}: qb_bin_bounds ([1.0, -1.0]) must be finite with lower < upper."),
    ((X8, 2), dict(QB, qb_bin_bounds=jnp.array([0.0, jnp.inf])), ValueError,
     f"{TOPK}: qb_bin_bounds ([0.0, inf]) must be finite with lower < upper."),
    ((X8, 2), dict(QB, qb_bin_bounds=jnp.zeros(3)), ValueError,
     f"{TOPK}: qb_bin_bounds shape (3,) must be (2,) ([lower, upper])."),
    ((X8, 2), dict(QB, token_mask=jnp.ones((4,), jnp.int32)), TypeError,
     f"{TOPK}: token_mask must be bool (True = a valid token), got int32."),
    ((X8, 2), dict(QB, token_mask=jnp.ones((5,), bool)), ValueError,
     f"{TOPK}: token_mask shape (5,) must be the tokens' shape (4,) or (4,)."),
    ((X8, 2), dict(token_mask=jnp.ones((4,), bool)), ValueError,
     f"{TOPK}: token_mask needs qb_histogram"),
    ((X8, 2), dict(axis_name="data"), ValueError, f"{TOPK}: axis_name needs qb_histogram"),
]


@pytest.mark.parametrize("fn", [gr.fused_topk_with_score_function, ref.fused_topk_with_score_function])
@pytest.mark.parametrize("args,kwargs,exc,msg", VARIANT_CASES)
def test_variant_errors(fn, args, kwargs, exc, msg):
    with pytest.raises(exc, match=re.escape(msg)):
        fn(*args, **kwargs)


LOSS_MASK_CASES = [
    (lambda m: gr.fused_moe_aux_loss(jnp.ones((4, 8)), jnp.ones((8,), jnp.int32), 2, 1.0, token_mask=m),
     "fused_moe_aux_loss"),
    (lambda m: gr.router_z_loss(X8, 1.0, token_mask=m), "router_z_loss"),
    (lambda m: gr.tokens_per_expert(jnp.zeros((4, 8), bool), token_mask=m), "tokens_per_expert"),
]


@pytest.mark.parametrize("call,op", LOSS_MASK_CASES)
def test_loss_mask_errors(call, op):
    msg = f"{op}: token_mask must be bool (True = a valid token), got float32."
    with pytest.raises(TypeError, match=re.escape(msg)):
        call(jnp.ones((4,), jnp.float32))
    with pytest.raises(ValueError, match=re.escape(f"{op}: token_mask shape (2, 3) must be the tokens' shape")):
        call(jnp.ones((2, 3), bool))


def test_traced_total_num_tokens_errors():
    probs, tpe = jnp.ones((4, 8)), jnp.ones((8,), jnp.int32)
    with pytest.raises(ValueError, match=re.escape("fused_moe_aux_loss: total_num_tokens shape (2,) must be ()")):
        jax.jit(lambda t: gr.fused_moe_aux_loss(probs, tpe, 2, 1.0, total_num_tokens=t))(jnp.ones(2, jnp.int32))
    with pytest.raises(TypeError, match=re.escape("router_z_loss: total_num_tokens must be an int or float scalar, "
                                                  "got bool.")):
        jax.jit(lambda t: gr.router_z_loss(X8, 1.0, total_num_tokens=t))(jnp.bool_(True))
    with pytest.raises(ValueError, match=re.escape(
            "fused_moe_aux_loss: total_num_tokens (0) must be > 0 (or 0 with no tokens; there are 4).")):
        gr.fused_moe_aux_loss(probs, tpe, 2, 1.0, total_num_tokens=0)


QB_UPDATE_CASES = [
    ((H8.astype(jnp.float32), BOUNDS, 2), TypeError, "qb_update_expert_bias: histogram must be int32, got float32."),
    ((jnp.zeros((8,), jnp.int32), BOUNDS, 2), ValueError, "qb_update_expert_bias: histogram shape (8,) must be"),
    ((H8, BOUNDS, 8), ValueError, "qb_update_expert_bias: topk (8) must be in [1, num_experts) = [1, 8)."),
    ((H8, BOUNDS, 0), ValueError, "qb_update_expert_bias: topk (0) must be in [1, num_experts) = [1, 8)."),
    ((H8, jnp.array([2.0, 2.0]), 1), ValueError,
     "qb_update_expert_bias: bin_bounds ([2.0, 2.0]) must be finite with lower < upper."),
    ((H8, jnp.array([1, 2]), 1), TypeError, "qb_update_expert_bias: bin_bounds must be float"),
]


@pytest.mark.parametrize("args,exc,msg", QB_UPDATE_CASES)
def test_qb_update_errors(args, exc, msg):
    with pytest.raises(exc, match=re.escape(msg)):
        gr.qb_update_expert_bias(*args)
# The MoE block in its own terms, and the token ops' concrete values (issue 40's U6-U10)
# ----------------------------------------------------------------------------

MOE = "moe"
MX = jnp.ones((4, 8), jnp.float32)
MG = jnp.ones((8, 4), jnp.float32) * 0.1
MW = dict(wi_0=jnp.ones((4, 8, 6)) * 0.1, wi_1=jnp.ones((4, 8, 6)) * 0.1, wo=jnp.ones((4, 6, 8)) * 0.1)


def _moe(x=MX, gate=MG, **kw):
    from gpurouter.moe import moe

    return moe(x, gate, MW["wi_0"], MW["wi_1"], MW["wo"], num_experts=4, num_experts_per_tok=2,
               **{"backend": "jax", **kw})


MOE_CASES = [
    (dict(grouped_matmul=None), TypeError, f"{MOE}: grouped_matmul (None) must be a function"),
    (dict(x=[[1.0] * 8] * 4), TypeError, f"{MOE}: x must be an array (jax.Array or numpy.ndarray), got list"),
    (dict(gate=MG.astype(jnp.int32)), TypeError, f"{MOE}: gate_kernel must be float32, bfloat16 or float16"),
    (dict(aux_loss_coeff=-0.1), ValueError, f"{MOE}: aux_loss_coeff (-0.1) must be >= 0 (0: no aux loss)."),
    (dict(aux_loss_coeff=float("nan")), ValueError, f"{MOE}: aux_loss_coeff (nan) must be finite."),
    (dict(group_topk=1), ValueError, f"{MOE}: num_groups (None) must be given (>= 1) when group_topk (1) > 0."),
    (dict(transport="fast"), ValueError, f"{MOE}: transport ('fast') must be one of"),
]


@pytest.mark.parametrize("kw,exc,msg", MOE_CASES, ids=[c[2].split(": ", 1)[1][:40] for c in MOE_CASES])
def test_moe_errors_in_its_own_terms(kw, exc, msg):
    with pytest.raises(exc, match="^" + re.escape(msg)):
        _moe(**kw)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["jax", "numba"])
def test_moe_of_no_tokens_is_empty(backend):
    if backend == "numba":
        from gpurouter import _backend

        if not _backend.numba_usable():
            pytest.skip("backend='numba' needs numba-cuda and a GPU or NUMBA_ENABLE_CUDASIM=1")
    out, loss = _moe(x=jnp.zeros((0, 8)), backend=backend, aux_loss_coeff=0.1)
    assert out.shape == (0, 8) and float(loss) == 0.0


TOKEN_CASES = [
    ("compute_grouped_dbias_dscales", (jnp.zeros((4, 3)), jnp.zeros((4,)), jnp.zeros((2, 3)),
                                       jnp.asarray([0, 2, 9])), ValueError,
     "compute_grouped_dbias_dscales: offsets ([0, 2, 9]) must lie in [0, dy.shape[0]] = [0, 4]."),
    ("compute_grouped_dbias", (jnp.zeros((4, 3)), jnp.asarray([-1, 2, 4]), 2), ValueError,
     "compute_grouped_dbias: offsets ([-1, 2, 4]) must lie in [0, dy.shape[0]] = [0, 4]."),
    ("grouped_scaled_bias_add", (jnp.zeros((4, 3)), jnp.zeros((2, 3)), jnp.zeros((4,)), jnp.asarray([3, 3])),
     ValueError, "grouped_scaled_bias_add: group_sizes ([3, 3]) must be >= 0 and sum to at most y.shape[0] (4)."),
    ("token_combine", (jnp.zeros((4, 3)), jnp.asarray([[0, -1], [7, 1]])), ValueError,
     "token_combine: row_id_map entries must be -1 (not routed) or a row of inp in [0, inp.shape[0]) = [0, 4), "
     "got 7."),
    ("token_combine", (jnp.zeros((4, 3)), jnp.asarray([[0, 1], [1, 2]])), ValueError,
     "token_combine: row_id_map must name each row of inp at most once, got row 1 twice."),
    ("token_combine", (jnp.zeros((4, 3)), jnp.asarray([[0, 1], [2, 3]]), None, jnp.asarray([0, -2])), ValueError,
     "token_combine: pad_offsets ([0, -2]) must be >= 0."),
]


@pytest.mark.parametrize("name,args,exc,msg", TOKEN_CASES, ids=[c[3][:60] for c in TOKEN_CASES])
def test_token_ops_refuse_concrete_values_out_of_range(name, args, exc, msg):
    from gpurouter import moe as mo
    from gpurouter.reference import moe_ops as ref_mo

    for module in (mo, ref_mo):
        with pytest.raises(exc, match="^" + re.escape(msg)):
            getattr(module, name)(*args)
