"""The public surface: names, signatures (TE drop-in), enums, and import hygiene."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest

import gpurouter as gr
from gpurouter import reference as ref


def test_all():
    assert sorted(gr.__all__) == ["RouterConfig", "RoutingMapFormat", "ScoreFunction", "fused_moe_aux_loss",
                                  "fused_topk_with_score_function", "pack_routing_map", "qb_update_expert_bias",
                                  "router_z_loss", "tokens_per_expert", "unpack_routing_map",
                                  "update_expert_bias"]
    for name in ref.__all__:
        assert getattr(ref, name) is not None


def _params(fn):
    return [(p.name, p.default, p.kind) for p in inspect.signature(fn).parameters.values()]


def test_topk_signature_is_tes_plus_keyword_backend():
    # TE main's JAX router (routing_map_format, the tenth, since TE #3009)
    te = ["logits", "topk", "use_pre_softmax", "num_groups", "group_topk", "scaling_factor",
          "score_function", "expert_bias", "compute_aux_scores", "routing_map_format"]
    params = _params(gr.fused_topk_with_score_function)
    variants = ["group_score", "compact", "indices_dtype", "qb_histogram", "qb_bin_bounds", "qb_histogram_mode",
                "token_mask", "axis_name"]  # docs/contract.md sections 9-12
    assert [p[0] for p in params] == te + ["return_indices", "forced_indices", *variants, "backend", "transport"]
    defaults = {p[0]: p[1] for p in params}
    assert defaults["use_pre_softmax"] is False
    assert defaults["num_groups"] == -1 and defaults["group_topk"] == -1
    assert defaults["scaling_factor"] == 1.0 and defaults["expert_bias"] is None
    assert defaults["compute_aux_scores"] is False and defaults["backend"] == "auto"
    assert gr.ScoreFunction(defaults["score_function"]) == gr.ScoreFunction.SOFTMAX
    assert defaults["routing_map_format"] is gr.RoutingMapFormat.BYTEMAP
    assert all(p[2] is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params[:10])
    assert defaults["return_indices"] is False and defaults["forced_indices"] is None
    assert defaults["group_score"] == "sum_topk" and defaults["compact"] is False
    assert defaults["indices_dtype"] == "int32"
    assert all(defaults[name] is None for name in variants[3:])
    assert all(p[2] is inspect.Parameter.KEYWORD_ONLY for p in params[10:])
    assert _params(ref.fused_topk_with_score_function) == params[:-2]


def test_aux_loss_signature():
    params = _params(gr.fused_moe_aux_loss)
    assert [p[0] for p in params] == ["probs", "tokens_per_expert", "topk", "coeff",
                                      "total_num_tokens", "num_experts", "axis_name", "token_mask", "backend",
                                      "transport"]
    assert all(p[2] is inspect.Parameter.KEYWORD_ONLY for p in params[4:])
    assert _params(ref.fused_moe_aux_loss) == params[:-2]


def test_score_function_enum():
    assert (gr.ScoreFunction.SIGMOID, gr.ScoreFunction.SOFTMAX, gr.ScoreFunction.SQRTSOFTPLUS) == (0, 1, 2)
    assert gr.ScoreFunction("sigmoid") is gr.ScoreFunction.SIGMOID
    assert gr.ScoreFunction("sqrtsoftplus") is gr.ScoreFunction.SQRTSOFTPLUS
    assert gr.ScoreFunction(1) is gr.ScoreFunction.SOFTMAX
    with pytest.raises(ValueError):
        gr.ScoreFunction("tanh")


def test_routing_map_format_enum():
    """TE's codes and names; the name in any case, the int code, the member."""
    assert (gr.RoutingMapFormat.BYTEMAP, gr.RoutingMapFormat.BITMAP_U8) == (0, 1)
    for v in ("bitmap_u8", "BITMAP_U8", "Bitmap_U8", 1, gr.RoutingMapFormat.BITMAP_U8):
        assert gr.RoutingMapFormat(v) is gr.RoutingMapFormat.BITMAP_U8
    assert gr.RoutingMapFormat("bytemap") is gr.RoutingMapFormat.BYTEMAP
    with pytest.raises(ValueError):
        gr.RoutingMapFormat("bitmap")
    assert gr.reference.RoutingMapFormat is gr.RoutingMapFormat


def test_routing_map_format_positional_tenth():
    """TE code passes it positionally after compute_aux_scores."""
    import jax.numpy as jnp

    x = jnp.arange(24, dtype=jnp.float32).reshape(2, 12)
    _, m = gr.fused_topk_with_score_function(x, 2, False, -1, -1, 1.0, "softmax", None, False, 1)
    assert m.shape == (2, 2) and m.dtype == jnp.uint8
    assert m.tolist() == [[0, 12], [0, 12]]  # experts 10 and 11: bits 2 and 3 of byte 1


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)


def test_import_needs_no_numba():
    r = _run("""
        import sys
        sys.modules["numba"] = None  # any import of numba now fails
        import jax.numpy as jnp
        import gpurouter as gr
        x = jnp.zeros((3, 8))
        probs, rmap = gr.fused_topk_with_score_function(x, 2)  # auto -> jax
        assert int(rmap.sum()) == 6
        assert "numba" not in [m.split(".")[0] for m in sys.modules if sys.modules[m] is not None]
        try:
            gr.fused_topk_with_score_function(x, 2, backend="numba")
        except ImportError as e:
            print("IMPORT-ERROR:", e)
        """)
    assert r.returncode == 0, r.stderr
    assert "IMPORT-ERROR: backend=\"numba\" needs numba-cuda: pip install 'gpurouter[cuda13]'" in r.stdout


def test_auto_is_jax_without_a_gpu(monkeypatch):
    from gpurouter import _backend

    assert _backend.resolve("op", "auto") == "jax"  # no predicate: jax on any machine
    monkeypatch.setattr(_backend, "zero_copy_available", lambda: False)  # JAX not on a GPU
    assert _backend.resolve("op", "auto", faster=lambda: True) == "jax"


def test_auto_picks_numba_only_where_it_measured_faster(monkeypatch):
    """gpurouter/_auto.py: with a device transport available (faked), numba from
    AUTO_MIN_ELEMENTS logits on (twice as many for zero-copy), for a top-k with
    K <= AUTO_MAX_TOPK, the aux scores and the aux loss; never indices,
    replays or float64; jax below the threshold and for the z-loss."""
    import jax.numpy as jnp

    from gpurouter import _auto, _backend, _transport

    monkeypatch.setattr(_backend, "zero_copy_available", lambda: True)
    assert _backend.resolve("op", "auto", faster=lambda: True) == "numba"
    assert _backend.resolve("op", "auto", faster=lambda: False) == "jax"
    assert _backend.resolve("op", "auto") == "jax"  # the z-loss passes no predicate
    for transport, n in _auto.AUTO_MIN_ELEMENTS.items():
        monkeypatch.setattr(_transport, "resolve_transport", lambda op, t, transport=transport: transport)
        assert _auto.kernels_faster("op", "auto", n // 256, 256)
        assert not _auto.kernels_faster("op", "auto", n // 256 - 1, 256)
        assert not _auto.kernels_faster("op", "auto", n, 256, topk=_auto.AUTO_MAX_TOPK + 1)
    monkeypatch.setattr(_transport, "resolve_transport", lambda op, t: "callback")
    assert not _auto.kernels_faster("op", "callback", 1 << 30, 256)

    asked = []
    monkeypatch.setattr(_backend, "resolve", lambda op, b, faster=None: asked.append(
        faster is not None and faster()) or "jax")
    monkeypatch.setattr(_transport, "resolve_transport", lambda op, t: "ffi")
    big = _auto.AUTO_MIN_ELEMENTS["ffi"] // 64
    x = jnp.zeros((big, 64), jnp.float32)
    gr.fused_topk_with_score_function(x, 8)
    gr.fused_topk_with_score_function(x[:-1], 8)  # one token short
    gr.fused_topk_with_score_function(x, _auto.AUTO_MAX_TOPK + 1)
    gr.fused_topk_with_score_function(x, 2, return_indices=True)
    gr.fused_topk_with_score_function(x, 2, compute_aux_scores=True)
    gr.fused_moe_aux_loss(x, jnp.ones((64,), jnp.int32), 2, 0.1)
    if _backend.numba_usable():
        assert asked == [True, False, False, False, True, True]
    else:  # no kernel layer: "auto" never asks for numba
        assert asked[1:4] == [False, False, False]


def test_bindings_reach_kernels_only_through_the_callback_helper():
    """HOUSE_STYLE: ops never call pure_callback/buffer_callback or move arrays themselves."""
    import pathlib
    import re

    pkg = pathlib.Path(gr.__file__).parent
    for path in pkg.rglob("*.py"):
        if {"_transport", "kernels", "bench"} & set(path.relative_to(pkg).parts[:-1]):
            continue  # the transports call them; the kernels and the benches move arrays
        src = path.read_text()
        assert not re.search(r"\b(pure_callback|buffer_callback|ffi_call|to_device|copy_to_host)\(", src), path.name


def _run_env(code: str, **env) -> subprocess.CompletedProcess:
    import os

    full = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    full.update(env)
    return subprocess.run([sys.executable, "-W", "always", "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, env=full)


def test_simulator_raises_xla_cpu_collective_timeouts_before_jax_starts():
    """Without it XLA:CPU ended the process when a sharded jit waited for the
    simulator (docs/testing.md); the flags must be in place before JAX starts."""
    from gpurouter._backend import SIMULATOR_XLA_FLAGS

    r = _run_env("""
        import os
        import gpurouter
        import jax
        jax.devices()
        print("FLAGS:", os.environ.get("XLA_FLAGS", ""))
        """, NUMBA_ENABLE_CUDASIM="1")
    assert r.returncode == 0, r.stderr
    for flag in SIMULATOR_XLA_FLAGS:
        assert flag in r.stdout
    r = _run_env("""
        import os
        import gpurouter
        print("FLAGS:", os.environ.get("XLA_FLAGS", ""))
        """, NUMBA_ENABLE_CUDASIM="0")
    assert "collective" not in r.stdout  # only with the simulator


def test_simulator_warns_when_jax_started_first():
    from gpurouter import _backend

    if not (_backend.simulator_enabled() and _backend.numba_usable()):
        pytest.skip("needs numba-cuda's simulator (NUMBA_ENABLE_CUDASIM=1 with gpurouter[sim])")
    r = _run_env("""
        import jax, jax.numpy as jnp
        jax.devices()                    # JAX's CPU backend starts without the flags
        import gpurouter as gr
        gr.fused_topk_with_score_function(jnp.zeros((2, 8)), 2, backend="numba")
        """, NUMBA_ENABLE_CUDASIM="1")
    assert r.returncode == 0, r.stderr
    assert "RuntimeWarning: gpurouter: the CUDA simulator is on" in r.stderr
    assert "--xla_cpu_collective_call_terminate_timeout_seconds=3600" in r.stderr
