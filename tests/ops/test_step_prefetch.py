"""_ops/topk_kernels.py's router_step_calls: the kernels a router step submits to the background
workers when its top-k forward is traced are the kernels the step's other
calls then launch (else the speculation would be compile work for nothing).
Simulator: the plans are compared, nothing is compiled."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import gpurouter as gr

pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")
pytestmark = pytest.mark.cuda


def _kernels(plan) -> set:
    return {id(st.kernel) for st in plan.steps}


@pytest.mark.parametrize(("experts", "topk", "groups", "group_topk", "score"), [
    (256, 8, 8, 4, "sigmoid"),  # DeepSeek-V3's rule
    (64, 4, -1, -1, "softmax"),
])
def test_the_speculated_plans_are_the_steps_own(monkeypatch, experts, topk, groups, group_topk, score):
    from gpurouter._checks import check_topk_args
    from gpurouter._ops.topk_kernels import router_step_calls
    from gpurouter._transport import _shared

    built = []
    plan_of = _shared.plan_of

    def recording(planner, arrays):
        plan = plan_of(planner, arrays)
        built.append(plan)
        return plan

    monkeypatch.setattr(_shared, "plan_of", recording)
    for mod in ("host", "buffer", "ffi"):
        monkeypatch.setattr(f"gpurouter._transport.{mod}.plan_of", recording)
    x = jax.random.normal(jax.random.PRNGKey(0), (4, experts), jnp.float32).astype(jnp.bfloat16)
    kw = {"num_groups": groups, "group_topk": group_topk, "score_function": score}

    def loss(x):
        probs, _ = gr.fused_topk_with_score_function(x, topk, backend="numba", **kw)
        scores, aux_map = gr.fused_topk_with_score_function(
            x, topk, score_function=score, compute_aux_scores=True, backend="numba")
        aux = gr.fused_moe_aux_loss(scores, jnp.sum(aux_map, axis=0, dtype=jnp.int32), topk, 1e-2, backend="numba")
        return jnp.sum(probs.astype(jnp.float32)) + aux

    jax.block_until_ready(jax.value_and_grad(loss)(x))
    launched = set().union(*(_kernels(p) for p in built))
    cfg = check_topk_args(x.shape, x.dtype, topk, False, groups, group_topk, 1.0, score, None, None, False)
    speculated = [_shared.plan_of(planner, [jax.ShapeDtypeStruct(a.shape, jnp.uint16 if a.dtype == jnp.bfloat16
                                                                 else a.dtype) for a in arrays])
                  for planner, arrays in router_step_calls(x, cfg)]
    assert len(speculated) == 5
    for plan in speculated:
        assert _kernels(plan) <= launched, plan.op
