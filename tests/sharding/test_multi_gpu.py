"""Two or more GPUs in one process (issue #19 runs these on 2 x H200): the ffi
transport's launch records hold one entry per GPU, so the same op runs on
each GPU, and one jitted step runs on all of them at once; the aux path too.
Sharded routing and expert parallelism over the GPUs: tests/sharding/test_sharding.py
and tests/ops/test_moe.py (they use every device JAX has)."""

from __future__ import annotations

import ctypes
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gpurouter as gr
from gpurouter import reference as ref
from gpurouter.presets import PRESETS

GPUS = jax.devices("gpu") if jax.default_backend() == "gpu" else []
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(len(GPUS) < 2, reason=f"needs >= 2 GPUs, have {len(GPUS)}")]
KW = PRESETS["deepseek-v3"].router_kwargs()
E = PRESETS["deepseek-v3"].num_experts


def _inputs(t=512, seed=0):
    x = jax.random.normal(jax.random.PRNGKey(seed), (t, E), jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(seed + 1), (t, E), jnp.float32)
    return x, w, jnp.linspace(-0.05, 0.05, E, dtype=jnp.float32)


def _step(backend, transport="ffi"):
    def loss(x, w, b):
        probs, _ = gr.fused_topk_with_score_function(x, **KW, expert_bias=b, backend=backend,
                                                     transport=transport if backend == "numba" else "auto")
        return jnp.sum(probs * w)
    return jax.jit(jax.value_and_grad(loss))


@pytest.mark.parametrize("transport", ["ffi", "zero-copy"])
def test_each_transport_runs_on_each_gpu(transport):
    """The zero-copy transport takes a call's GPU from XLA's stream (on 2 x H200
    the buffers' pointer attribute named GPU 0 for GPU 1's buffers)."""
    x, w, b = _inputs()
    want = jax.device_get(_step("numba", transport)(x, w, b))
    for d in GPUS:
        args = jax.device_put((x, w, b), d)
        got = _step("numba", transport)(*args)
        assert got[1].devices() == {d}
        for g, v in zip(jax.device_get(got), want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(v))
    ref_value, ref_grad = jax.value_and_grad(
        lambda x: jnp.sum(ref.fused_topk_with_score_function(x, **KW, expert_bias=b)[0] * w))(x)
    np.testing.assert_allclose(float(want[0]), float(ref_value), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(want[1]), np.asarray(ref_grad), atol=1e-5, rtol=1e-4)


def test_one_jitted_step_on_every_gpu_at_once():
    """shard_map over the GPUs, each routing its tokens through the ffi handler
    concurrently, repeated in a loop: the same bits as one GPU, no hang."""
    n = len(GPUS)
    mesh = jax.sharding.Mesh(np.array(GPUS), ("data",))
    x, w, b = _inputs(t=512 * n, seed=3)

    def local(x, w):
        probs, rmap = gr.fused_topk_with_score_function(x, **KW, expert_bias=b, backend="numba", transport="ffi")
        g = jax.grad(lambda x: jnp.sum(gr.fused_topk_with_score_function(
            x, **KW, expert_bias=b, backend="numba", transport="ffi")[0] * w))(x)
        return probs, rmap, g

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P("data")),
                              out_specs=(P("data"), P("data"), P("data"))))
    spec = NamedSharding(mesh, P("data", None))
    xs, ws = jax.device_put(x, spec), jax.device_put(w, spec)
    outs = [f(xs, ws) for _ in range(20)]
    jax.block_until_ready(outs)
    want = jax.jit(local)(x, w)
    for out in (outs[0], outs[-1]):
        for g, v in zip(out, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(v))


def test_on_gpu_gives_the_caller_its_context_back():
    """``_context.on_gpu`` (compiles, counters) leaves the calling thread's current
    context as it found it, from each GPU's context to each other GPU, and from
    none; a stream's GPU is its context's device."""
    from gpurouter.kernels._base import context as _context

    ctxs = [_context.primary_context(d.local_hardware_id) for d in GPUS]
    lib = _context.libcuda()
    for outer in [None, *ctxs]:
        if outer is not None:
            assert lib.cuCtxPushCurrent_v2(outer) == 0
        before = _context.current_context()
        for d in GPUS:
            with _context.on_gpu(d.local_hardware_id):
                assert _context.current_context() == ctxs[GPUS.index(d)]
            assert _context.current_context() == before
        if outer is not None:
            lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    from numba import cuda

    for d in GPUS:
        with _context.on_gpu(d.local_hardware_id):
            stream = cuda.stream()
        handle = int(stream.handle)
        try:
            assert _context.stream_ordinal(handle) == d.local_hardware_id
        finally:  # the cache is for XLA's streams, which live as long as the process
            _context._STREAM_ORDINAL.pop(handle, None)


def test_aux_path_on_each_gpu():
    x, _, _ = _inputs(t=256, seed=5)

    def aux(x):
        scores, rmap = gr.fused_topk_with_score_function(x, 8, score_function="sigmoid", compute_aux_scores=True,
                                                         backend="numba", transport="ffi")
        tpe = jnp.sum(rmap, axis=0, dtype=jnp.int32)
        return gr.fused_moe_aux_loss(scores, tpe, 8, 1e-2, backend="numba", transport="ffi")

    want = jax.device_get(jax.jit(jax.value_and_grad(aux))(x))
    for d in GPUS:
        got = jax.device_get(jax.jit(jax.value_and_grad(aux))(jax.device_put(x, d)))
        for g, v in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(v))


EXIT_SCRIPT = """
import jax
import gpurouter as gr
from gpurouter.presets import PRESETS

kw = PRESETS["deepseek-v3"].router_kwargs()
x = jax.random.normal(jax.random.PRNGKey(0), (64, 256))
for d in jax.devices("gpu"):
    for t in ("ffi", "zero-copy"):
        f = jax.jit(lambda x: gr.fused_topk_with_score_function(x, **kw, backend="numba", transport=t)[0])
        jax.block_until_ready(f(jax.device_put(x, d)))
print("routed on", len(jax.devices("gpu")), "GPUs")
"""


def test_a_process_that_used_every_gpu_exits_cleanly():
    """Both transports on every GPU, then the interpreter's exit: numba's module
    unloads ran twice on one library (one per GPU) and ended such processes in
    a glibc abort (exit status 134) before ``_context.hold_numba_frees_at_exit``."""
    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
               PYTHONFAULTHANDLER="1")
    run = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], cwd=root, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and f"routed on {len(GPUS)} GPUs" in run.stdout, run.stderr[-3000:]
