"""Expert parallelism across processes: the MoE block with ``ep_axis`` over
two processes joined by ``jax.distributed`` (localhost, one CPU device each,
the gloo collectives) gives the values and gradients of the block on one
process. The two processes run ``tools/ci/ep_processes.py``; this test compares
what process 0 gathered with the block computed here, without EP."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from gpurouter import moe as gmoe
from gpurouter import reference as ref

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "ci" / "ep_processes.py"
TIMEOUT = 240  # seconds for both processes, start to finish (25 s on 2 busy cores, 80 s on 2 overloaded ones)


def _script():
    spec = importlib.util.spec_from_file_location("ep_processes", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_processes(tmp_path, extra: list[str], num: int = 2) -> pathlib.Path:
    """Runs ``num`` copies of the script, joined on a free localhost port;
    returns process 0's ``.npz``. Fails with every process's output if one
    fails or they outlive :data:`TIMEOUT` (all are then killed)."""
    out = tmp_path / "ep.npz"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(SCRIPT), "--coordinator", f"localhost:{_free_port()}", "--num-processes", str(num),
           "--cpu", "--timeout", str(TIMEOUT), *extra]
    logs = [open(tmp_path / f"process{i}.log", "w+") for i in range(num)]
    procs = [subprocess.Popen([*cmd, "--process-id", str(i)] + (["--out", str(out)] if i == 0 else []),
                              env=env, cwd=ROOT, stdout=logs[i], stderr=subprocess.STDOUT) for i in range(num)]
    try:
        codes = [p.wait(timeout=TIMEOUT) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = []
    for i, f in enumerate(logs):
        f.seek(0)
        text.append(f"--- process {i} ---\n{f.read()[-3000:]}")
        f.close()
    assert codes is not None, f"the processes outlived {TIMEOUT} s:\n" + "\n".join(text)
    assert codes == [0] * num, f"exit codes {codes}:\n" + "\n".join(text)
    return out


def test_ep_over_two_processes_equals_one_process(tmp_path):
    """Late weighting, ``ragged_dot``, biases and the aux loss; the gradients of
    every input, the router kernel's included (an ``early`` / ``batched``
    pair more than doubles the time: the one-process EP tests in
    tests/ops/test_moe.py cover those on 8 CPU devices)."""
    mod = _script()
    got = dict(np.load(_run_processes(tmp_path, [])))
    p = {n[3:]: jnp.asarray(v) for n, v in got.items() if n.startswith("in_")}
    e = p["wi_0"].shape[0]
    kw = mod.block_kwargs(e, 2, False, "ragged_dot", "auto")  # the script's defaults
    names = list(p)

    def loss(*vals):
        q = dict(zip(names, vals, strict=True))
        out, aux = gmoe.moe(q["x"], q["gate_kernel"], q["wi_0"], q["wi_1"], q["wo"], q["wi_0_bias"],
                            q["wi_1_bias"], q["wo_bias"], **kw)
        return jnp.sum(out ** 2) + aux, (out, aux)

    with jax.default_matmul_precision("float32"):
        (value, (out, aux)), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(names))),
                                                                has_aux=True))(*p.values())
    assert got["out"].shape == out.shape == p["x"].shape
    np.testing.assert_allclose(got["out"], np.asarray(out), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["aux"], np.asarray(aux), rtol=1e-5)
    np.testing.assert_allclose(got["value"], np.asarray(value), rtol=1e-5)
    for n, g in zip(names, grads, strict=True):
        assert got[f"d_{n}"].shape == g.shape, n
        np.testing.assert_allclose(got[f"d_{n}"], np.asarray(g), rtol=1e-4, atol=1e-5, err_msg=n)
    # not a trivial split: each process routed some of its tokens to the other's experts
    _, routing_map = ref.fused_topk_with_score_function(p["x"] @ p["gate_kernel"], 2)
    t = p["x"].shape[0]
    assert routing_map[: t // 2, e // 2:].any() and routing_map[t // 2:, : e // 2].any()
