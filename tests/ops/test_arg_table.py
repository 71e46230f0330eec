"""Every argument of every public function, checked the same way (docs/contract.md section 6).

One table: for each public function (``gpurouter.__all__`` and
``gpurouter.moe.__all__``; the two enum classes are tested in
tests/ops/test_errors.py) a valid call and, for each of its parameters, the
bad values of its kind: wrong type, wrong dtype, wrong rank, a non-finite
scalar, an empty array where one is not allowed. Each must raise a
``TypeError`` or ``ValueError`` whose message starts with the function's
name (the op it names: gpurouter's own check, never a traceback from inside
jax or numba) and names the argument; none may be accepted silently.

A parameter missing from the table fails ``test_table_covers_every_argument``
(the signatures are introspected): a new public argument needs its row.
All cases run on ``backend="jax"``: every check is shared by the backends
and runs before dispatch (tests/ops/test_errors.py pins the kernel-only ones,
float64 to numba).
"""

from __future__ import annotations

import inspect

import jax.numpy as jnp
import numpy as np
import pytest

import gpurouter as gr
from gpurouter import moe as gmoe

NAN, INF = float("nan"), float("inf")

X = jnp.linspace(-1, 1, 32, dtype=jnp.float32).reshape(4, 8)
TPE = jnp.full((8,), 2, jnp.int32)
BMAP = jnp.zeros((4, 8), bool).at[:, :2].set(True)


def bad_float_array(good, *, empty=None, rank=None, list_ok=False):
    """Wrong type (a list, a str), wrong dtype (int32), wrong rank, empty."""
    cases = [("str", "x", TypeError), ("int32 dtype", jnp.asarray(good).astype(jnp.int32), TypeError),
             ("complex dtype", jnp.asarray(good).astype(jnp.complex64), TypeError),
             ("rank", jnp.asarray(good)[None] if rank is None else rank, ValueError)]
    if not list_ok:
        cases.append(("list", np.asarray(good).tolist(), TypeError))
    if empty is not None:
        cases.append(("empty", empty, ValueError))
    return cases


def bad_int_array(good, *, rank=None, empty=None):
    cases = [("list", np.asarray(good).tolist(), TypeError), ("str", "x", TypeError),
             ("float32 dtype", jnp.asarray(good).astype(jnp.float32), TypeError),
             ("rank", jnp.asarray(good)[None] if rank is None else rank, ValueError)]
    if empty is not None:
        cases.append(("empty", empty, ValueError))
    return cases


def bad_int(*, low=None):
    cases = [("float", 2.0, TypeError), ("str", "2", TypeError), ("bool", True, TypeError),
             ("nan", NAN, TypeError), ("array", jnp.ones((2,), jnp.int32), TypeError)]
    if low is not None:
        cases.append(("too small", low, ValueError))
    return cases


def bad_float():
    return [("str", "0.1", TypeError), ("bool", True, TypeError), ("nan", NAN, ValueError),
            ("inf", INF, ValueError), ("-inf", -INF, ValueError), ("list", [0.1], TypeError)]


def bad_bool():
    return [("str", "no", TypeError), ("int", 1, TypeError), ("None", None, TypeError)]


def bad_choice():
    return [("unknown", "bogus", ValueError), ("int", 7, ValueError), ("None", None, ValueError)]


def bad_mask():
    return [("list", [True] * 4, TypeError), ("float dtype", jnp.ones((4,)), TypeError),
            ("shape", jnp.ones((3,), bool), ValueError), ("str", "x", TypeError)]


def bad_axis():
    return [("unbound", "nope", ValueError), ("unbound tuple", ("a", "b"), ValueError)]


def bad_enum():
    return [("unknown", "bogus", ValueError), ("float", 1.0, TypeError), ("None", None, TypeError),
            ("bool", True, TypeError), ("code", 9, ValueError)]


def bad_ragged_dot():
    """The bad values of ``jax.lax.ragged_dot``'s operands (every grouped GEMM's rows)."""
    return {
        "lhs": bad_float_array(D),
        "rhs": bad_float_array(jnp.ones((2, 3, 5)), empty=jnp.zeros((0, 3, 5))),
        "group_sizes": bad_int_array(GS) + [("more rows than lhs", jnp.asarray([3, 3]), ValueError)],
        "precision": [("unknown", "bogus", ValueError), ("int", 3, TypeError)],
        "preferred_element_type": [("int dtype", jnp.int32, TypeError), ("not a dtype", "bogus", TypeError)],
    }


# (function, its op name, valid keyword arguments, {parameter: [(what, bad value, exception)]})
TABLE = [
    (gr.fused_topk_with_score_function, "fused_topk_with_score_function",
     dict(logits=X, topk=2, score_function="sigmoid"), {
         "logits": bad_float_array(X, rank=jnp.float32(1.0), empty=jnp.zeros((4, 0))),
         "topk": bad_int(low=0),
         "use_pre_softmax": bad_bool(),
         "num_groups": bad_int(),
         "group_topk": bad_int(),
         "scaling_factor": bad_float(),
         "score_function": bad_enum(),
         "expert_bias": bad_float_array(jnp.zeros((8,)), empty=jnp.zeros((0,))),
         "compute_aux_scores": bad_bool(),
         "routing_map_format": bad_enum(),
         "return_indices": bad_bool(),
         "forced_indices": bad_int_array(jnp.zeros((4, 2), jnp.int32), empty=jnp.zeros((4, 0), jnp.int32))
         + [("out of range", jnp.full((4, 2), 9, jnp.int32), ValueError)],
         "group_score": [("unknown", "top3", ValueError), ("int", 2, TypeError),
                         ("without groups", "max", ValueError)],
         "compact": bad_bool(),
         "indices_dtype": [("float", jnp.float32, TypeError), ("without indices", jnp.int16, ValueError)],
         "qb_histogram": [("without a bias", jnp.zeros((8, 5), jnp.int32), ValueError)],
         "qb_bin_bounds": [("without a histogram", jnp.asarray([-1.0, 1.0]), ValueError)],
         "qb_histogram_mode": [("unknown", "atomic", ValueError), ("int", 1, TypeError),
                               ("without QB", "two_kernel", ValueError)],
         "token_mask": [("without QB", jnp.ones((4,), bool), ValueError)],
         "axis_name": [("without QB", "nope", ValueError)],
         "backend": bad_choice(),
         "transport": bad_choice(),
     }),
    (gr.fused_moe_aux_loss, "fused_moe_aux_loss",
     dict(probs=jnp.full((4, 8), 0.25), tokens_per_expert=TPE, topk=2, coeff=0.1), {
         "probs": bad_float_array(jnp.full((4, 8), 0.25), empty=jnp.zeros((4, 0))),
         "tokens_per_expert": [("list", [2] * 8, TypeError), ("str", "x", TypeError),
                               ("bool dtype", jnp.ones((8,), bool), TypeError),
                               ("rank", TPE[None], ValueError), ("empty", jnp.zeros((0,), jnp.int32), ValueError)],
         "topk": bad_int(low=0),
         "coeff": bad_float(),
         "total_num_tokens": bad_int(low=-1),
         "num_experts": bad_int(low=0),
         "axis_name": bad_axis(),
         "token_mask": bad_mask(),
         "backend": bad_choice(),
         "transport": bad_choice(),
     }),
    (gr.router_z_loss, "router_z_loss", dict(logits=X, coeff=1e-3), {
        "logits": bad_float_array(X, rank=jnp.float32(1.0), empty=jnp.zeros((4, 0))),
        "coeff": bad_float(),
        "total_num_tokens": bad_int(low=-1),
        "axis_name": bad_axis(),
        "token_mask": bad_mask(),
        "backend": bad_choice(),
        "transport": bad_choice(),
    }),
    (gr.update_expert_bias, "update_expert_bias",
     dict(expert_bias=jnp.zeros((8,)), tokens_per_expert=TPE, rate=1e-3), {
         "expert_bias": bad_float_array(jnp.zeros((8,)), empty=jnp.zeros((0,))),
         "tokens_per_expert": [("list", [2] * 8, TypeError), ("str", "x", TypeError),
                               ("bool dtype", jnp.ones((8,), bool), TypeError),
                               ("rank", TPE[None], ValueError), ("empty", jnp.zeros((0,), jnp.int32), ValueError)],
         "rate": [("str", "0.1", TypeError), ("bool", True, TypeError), ("nan", NAN, ValueError),
                  ("inf", INF, ValueError), ("rank", jnp.ones((2,)), ValueError)],
         "axis_name": bad_axis(),
         "token_mask": [("with counts, not a map", jnp.ones((4,), bool), ValueError)],
     }),
    (gr.pack_routing_map, "pack_routing_map", dict(routing_map=BMAP), {
        "routing_map": [("list", np.asarray(BMAP).tolist(), TypeError), ("str", "x", TypeError),
                        ("float dtype", BMAP.astype(jnp.float32), TypeError),
                        ("rank", jnp.bool_(True), ValueError), ("empty", jnp.zeros((4, 0), bool), ValueError)],
    }),
    (gr.unpack_routing_map, "unpack_routing_map", dict(routing_map=gr.pack_routing_map(BMAP), num_experts=8), {
        "routing_map": [("list", [[3]] * 4, TypeError), ("str", "x", TypeError),
                        ("float dtype", jnp.zeros((4, 1)), TypeError),
                        ("rank", jnp.uint8(3), ValueError), ("empty", jnp.zeros((4, 0), jnp.uint8), ValueError)],
        "num_experts": bad_int(low=0),
    }),
    (gr.tokens_per_expert, "tokens_per_expert", dict(routing_map=BMAP), {
        "routing_map": [("list", np.asarray(BMAP).tolist(), TypeError), ("str", "x", TypeError),
                        ("float dtype", BMAP.astype(jnp.float32), TypeError),
                        ("rank", jnp.bool_(True), ValueError), ("empty", jnp.zeros((4, 0), bool), ValueError)],
        "num_experts": bad_int(low=0),
        "token_mask": bad_mask(),
    }),
    (gr.qb_update_expert_bias, "qb_update_expert_bias",
     dict(histogram=jnp.ones((8, 5), jnp.int32), bin_bounds=jnp.asarray([-1.0, 1.0]), topk=2), {
         "histogram": [("list", [[1] * 5] * 8, TypeError), ("str", "x", TypeError),
                       ("float dtype", jnp.ones((8, 5)), TypeError), ("rank", jnp.ones((8,), jnp.int32), ValueError),
                       ("empty", jnp.zeros((8, 0), jnp.int32), ValueError)],
         "bin_bounds": [("str", "x", TypeError), ("shape", jnp.asarray([-1.0, 0.0, 1.0]), ValueError),
                        ("inverted", jnp.asarray([1.0, -1.0]), ValueError),
                        ("nan", jnp.asarray([NAN, 1.0]), ValueError)],
         "topk": bad_int(low=0),
         "expert_bias": bad_float_array(jnp.zeros((8,)), empty=jnp.zeros((0,))),
     }),
]

D, S, B = jnp.ones((4, 3)), jnp.ones((4,)), jnp.ones((2, 3))
OFF, GS = jnp.asarray([0, 2, 4], jnp.int32), jnp.asarray([2, 2], jnp.int32)
RID = jnp.asarray([[0, -1], [1, -1], [-1, 2], [-1, 3]], jnp.int32)
MX, MG = jnp.ones((4, 8)), jnp.ones((8, 4)) * 0.1
W0, WO = jnp.ones((4, 8, 6)) * 0.1, jnp.ones((4, 6, 8)) * 0.1

TABLE += [
    (gmoe.compute_grouped_dbias_dscales, "compute_grouped_dbias_dscales", dict(dy=D, scales=S, bias=B, offsets=OFF), {
        "dy": bad_float_array(D),
        "scales": bad_float_array(S),
        "bias": bad_float_array(B, empty=jnp.zeros((0, 3))),
        "offsets": bad_int_array(OFF, empty=jnp.zeros((0,), jnp.int32))
        + [("decreasing", jnp.asarray([0, 3, 2]), ValueError), ("past the rows", jnp.asarray([0, 2, 9]), ValueError)],
        "dbias": bad_float_array(jnp.zeros((2, 3))) + [("bf16 accumulator", jnp.zeros((2, 3), jnp.bfloat16),
                                                        TypeError)],
        "dscales": bad_float_array(jnp.zeros((4,))),
        "backend": bad_choice(),
        "transport": bad_choice(),
    }),
    (gmoe.compute_grouped_dbias, "compute_grouped_dbias", dict(dy=D, offsets=OFF, num_groups=2), {
        "dy": bad_float_array(D),
        "offsets": bad_int_array(OFF, empty=jnp.zeros((0,), jnp.int32))
        + [("past the rows", jnp.asarray([0, 2, 9]), ValueError)],
        "num_groups": bad_int(low=0),
        "dbias": bad_float_array(jnp.zeros((2, 3))),
        "backend": bad_choice(),
        "transport": bad_choice(),
    }),
    (gmoe.grouped_scaled_bias_add, "grouped_scaled_bias_add", dict(y=D, bias=B, scales=S, group_sizes=GS), {
        "y": bad_float_array(D),
        "bias": bad_float_array(B, empty=jnp.zeros((0, 3))),
        "scales": bad_float_array(S),
        "group_sizes": bad_int_array(GS, empty=jnp.zeros((0,), jnp.int32))
        + [("more rows than y", jnp.asarray([3, 3]), ValueError), ("negative", jnp.asarray([3, -1]), ValueError)],
        "backend": bad_choice(),
        "transport": bad_choice(),
    }),
    (gmoe.token_dispatch, "token_dispatch", dict(inp=D, routing_map=BMAP[:, :5], num_out_tokens=8), {
        "inp": bad_float_array(D),
        "routing_map": [("list", np.asarray(BMAP[:, :5]).tolist(), TypeError), ("str", "x", TypeError),
                        ("float dtype", BMAP[:, :5].astype(jnp.float32), TypeError),
                        ("rank", BMAP[0, :5], ValueError), ("empty", jnp.zeros((4, 0), bool), ValueError)],
        "num_out_tokens": bad_int(low=0),
        "probs": bad_float_array(jnp.ones((4, 5))),
        "align_size": bad_int(low=0),
        "num_experts": bad_int(low=0),
        "backend": bad_choice(),
        "transport": bad_choice(),
    }),
    (gmoe.token_combine, "token_combine", dict(inp=D, row_id_map=RID), {
        "inp": bad_float_array(D),
        "row_id_map": bad_int_array(RID, empty=jnp.zeros((4, 0), jnp.int32))
        + [("out of range", RID.at[0, 0].set(9), ValueError), ("a row twice", RID.at[1, 0].set(0), ValueError)],
        "merging_probs": bad_float_array(jnp.ones((4, 2))),
        "pad_offsets": bad_int_array(jnp.zeros((2,), jnp.int32)) + [("negative", jnp.asarray([0, -1]), ValueError)],
        "backend": bad_choice(),
        "transport": bad_choice(),
    }),
    (gmoe.batched_ragged_dot, "batched_ragged_dot",
     dict(lhs=D, rhs=jnp.ones((2, 3, 5)), group_sizes=GS), {
         **bad_ragged_dot(),
         "capacity": bad_int(low=0),
     }),
    (gmoe.tiled_ragged_dot, "tiled_ragged_dot",
     dict(lhs=D, rhs=jnp.ones((2, 3, 5)), group_sizes=GS), {
         **bad_ragged_dot(),
         "capacity": bad_int(low=-1),
         "tile": bad_int(low=0),
         "chunk": bad_int(low=0),
     }),
    (gmoe.pallas_ragged_dot, "pallas_ragged_dot",
     dict(lhs=D, rhs=jnp.ones((2, 3, 5)), group_sizes=GS), {
         **bad_ragged_dot(),
         "group_offset": [("an array", jnp.zeros((1,), jnp.int32), ValueError)],
         "block_m": bad_int(low=24),
         "block_n": bad_int(low=8),
         "block_k": bad_int(low=0),
         "num_warps": bad_int(low=0),
         "num_stages": bad_int(low=0),
         "interpret": [("str", "no", TypeError), ("int", 1, TypeError)],
     }),
    (gmoe.mosaic_ragged_dot, "mosaic_ragged_dot",
     dict(lhs=D, rhs=jnp.ones((2, 3, 5)), group_sizes=GS), {
         **bad_ragged_dot(),
         "group_offset": [("an array", jnp.zeros((1,), jnp.int32), ValueError)],
     }),
    (gmoe.moe, "moe", dict(x=MX, gate_kernel=MG, wi_0=W0, wi_1=W0, wo=WO, num_experts=4, num_experts_per_tok=2,
                           backend="jax"), {
        "x": bad_float_array(MX, rank=jnp.float32(1.0)),
        "gate_kernel": bad_float_array(MG),
        "wi_0": bad_float_array(W0),
        "wi_1": bad_float_array(W0),
        "wo": bad_float_array(WO),
        "wi_0_bias": bad_float_array(jnp.zeros((4, 6))),
        "wi_1_bias": bad_float_array(jnp.zeros((4, 6))),
        "wo_bias": bad_float_array(jnp.zeros((4, 8))),
        "expert_bias": bad_float_array(jnp.zeros((4,))),
        "num_experts": bad_int(low=0),
        "num_experts_per_tok": bad_int(low=0),
        "activation_type": [("unknown", "tanh", ValueError), ("None", None, ValueError)],
        "score_function": bad_enum(),
        "use_pre_softmax": bad_bool(),
        "num_groups": bad_int(),
        "group_topk": bad_int(),
        "scaling_factor": bad_float(),
        "aux_loss_coeff": bad_float() + [("negative", -0.1, ValueError)],
        "apply_topk_weights_early": bad_bool(),
        "ep_axis": bad_axis(),
        "align_size": bad_int(low=-1),
        "grouped_matmul": [("None", None, TypeError), ("str", "ragged_dot", TypeError)],
        "backend": bad_choice(),
        "transport": bad_choice(),
    }),
]

CASES = [(fn, op, base, name, what, bad, exc) for fn, op, base, params in TABLE
         for name, bads in params.items() for what, bad, exc in bads]


def test_table_covers_every_argument():
    """Every public function and every one of its parameters has a row."""
    listed = {fn: params for fn, _, _, params in TABLE}
    public = [getattr(gr, n) for n in gr.__all__] + [getattr(gmoe, n) for n in gmoe.__all__]
    for fn in public:
        if inspect.isclass(fn):  # the enums: ScoreFunction, RoutingMapFormat (tests/ops/test_errors.py)
            continue
        assert fn in listed, f"{fn.__name__} is public but not in the table"
        missing = set(inspect.signature(fn).parameters) - set(listed[fn])
        assert not missing, f"{fn.__name__}: parameters {sorted(missing)} are not in the table"
        for name, bads in listed[fn].items():
            assert bads, f"{fn.__name__}: {name} has no bad values"


# pallas_ragged_dot on a GPU: jax 0.11 warns that Pallas's Triton backend is deprecated
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_every_valid_call_runs():
    """The base call of each row is valid (so each bad value is the only fault)."""
    for fn, _, base, _ in TABLE:
        fn(**base)


@pytest.mark.parametrize("fn,op,base,name,what,bad,exc", CASES,
                         ids=[f"{c[1]}-{c[3]}-{c[4]}" for c in CASES])
def test_bad_argument_is_a_clear_error(fn, op, base, name, what, bad, exc):
    with pytest.raises((TypeError, ValueError)) as info:
        fn(**{**base, name: bad})
    msg = str(info.value)
    assert isinstance(info.value, exc), f"{type(info.value).__name__}, not {exc.__name__}: {msg}"
    assert msg.startswith(f"{op}: "), f"not gpurouter's message for {op}: {msg}"
