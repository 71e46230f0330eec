"""The MoE block with expert parallelism over several processes (one or more
hosts): one copy of this script per process, ``jax.distributed`` joining them.

Every process builds the same inputs (a seeded NumPy generator), places its
share of the tokens and of the experts' weights on its own devices (the
``ep`` mesh axis spans every device of every process, process-major), and
runs one jitted forward + backward of ``gpurouter.moe.moe(..., ep_axis="ep")``
inside ``jax.shard_map``: loss ``sum(out^2) + aux``, the gradients of the
tokens, the router kernel, the three expert weights and their biases.
Process 0 writes the inputs, the output, the loss and the gradients,
gathered from every process, to ``--out`` (``.npz``), so that they can be
checked against the block on one process (tests/sharding/test_ep_processes.py does).

Two processes on this machine, CPU devices and the gloo collectives (what CI
runs; ``XLA:CPU`` has no ``ragged_all_to_all``, so the block's exact stand-in
exchange runs there: docs/moe.md)::

    python tools/ci/ep_processes.py --coordinator localhost:12345 --num-processes 2 --process-id 0 --cpu &
    python tools/ci/ep_processes.py --coordinator localhost:12345 --num-processes 2 --process-id 1 --cpu

Several GPU hosts (one process per host, all its GPUs; the real
``ragged_all_to_all``): the same command on each host, ``--coordinator`` the
address of process 0's host and a port open between the hosts, ``--process-id``
the host's rank (docs/sharding.md, "Expert parallelism over several hosts").
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--coordinator", required=True, help="HOST:PORT of process 0 (the same on every process)")
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--cpu", action="store_true",
                   help="CPU devices and the gloo collectives (no GPU needed; how CI runs it)")
    p.add_argument("--local-devices", type=int, default=1, help="CPU devices per process with --cpu (default 1)")
    p.add_argument("--tokens-per-device", type=int, default=8, help="T per device (default 8)")
    p.add_argument("--hidden", type=int, default=8)
    p.add_argument("--experts-per-device", type=int, default=2, help="E / P (default 2)")
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--ffn", type=int, default=6, help="M, the experts' inner width (default 6)")
    p.add_argument("--early", action="store_true", help="apply_topk_weights_early=True")
    p.add_argument("--grouped-matmul", choices=("ragged_dot", "batched"), default="ragged_dot")
    p.add_argument("--backend", default="auto", help="the block's backend (default auto)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=120, help="seconds to wait for every process to join")
    p.add_argument("--out", help="process 0 writes the inputs, output, loss and gradients here (.npz)")
    return p.parse_args(argv)


def _setup_cpu(local_devices: int) -> None:
    """CPU devices only, ``local_devices`` of them, before JAX starts."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={local_devices}"])
    os.environ["JAX_PLATFORMS"] = "cpu"


def inputs(seed: int, t: int, h: int, e: int, m: int):
    """The block's inputs, the same on every process: ``name -> float32 array``."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    return dict(x=normal(t, h), gate_kernel=normal(h, e), wi_0=normal(e, h, m, scale=0.4),
                wi_1=normal(e, h, m, scale=0.4), wo=normal(e, m, h, scale=0.4), wi_0_bias=normal(e, m, scale=0.3),
                wi_1_bias=normal(e, m, scale=0.3), wo_bias=normal(e, h, scale=0.3))


#: the inputs split over the ``ep`` axis (tokens and experts); the rest are whole on every device
SHARDED = ("x", "wi_0", "wi_1", "wo", "wi_0_bias", "wi_1_bias", "wo_bias")


def block_kwargs(e: int, k: int, early: bool, grouped_matmul: str, backend: str) -> dict:
    import jax

    from gpurouter import moe as gmoe

    gmm = {"ragged_dot": jax.lax.ragged_dot, "batched": gmoe.batched_ragged_dot}[grouped_matmul]
    return dict(num_experts=e, num_experts_per_tok=k, aux_loss_coeff=1e-2, apply_topk_weights_early=early,
                grouped_matmul=gmm, backend=backend)


def main(argv) -> int:
    args = _parse(argv)
    if args.cpu:
        _setup_cpu(args.local_devices)
    import jax

    if args.cpu:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    t0 = time.perf_counter()
    jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id,
                               initialization_timeout=args.timeout)
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from gpurouter import moe as gmoe

    shards = jax.device_count()
    print(f"process {jax.process_index()}/{jax.process_count()}: {jax.local_device_count()} local of {shards} "
          f"devices ({jax.devices()[0].platform}), joined in {time.perf_counter() - t0:.1f} s", flush=True)
    t, e = args.tokens_per_device * shards, args.experts_per_device * shards
    p = inputs(args.seed, t, args.hidden, e, args.ffn)
    kw = block_kwargs(e, args.topk, args.early, args.grouped_matmul, args.backend)
    mesh = jax.make_mesh((shards,), ("ep",))  # every device of every process, process-major
    names = list(p)
    specs = [P("ep") if n in SHARDED else P() for n in names]

    def local(*vals):  # one device: its tokens, its experts, the whole router kernel
        q = dict(zip(names, vals, strict=True))
        out, aux = gmoe.moe(q["x"], q["gate_kernel"], q["wi_0"], q["wi_1"], q["wo"], q["wi_0_bias"],
                            q["wi_1_bias"], q["wo_bias"], ep_axis="ep", **kw)
        return out, jax.lax.psum(aux, "ep")

    block = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=(P("ep"), P()))

    def loss(*vals):
        out, aux = block(*vals)
        return jnp.sum(out ** 2) + aux, (out, aux)

    step = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(names))), has_aux=True))
    # each process fills its own devices' shards of the global arrays
    args_global = [jax.make_array_from_callback(p[n].shape, NamedSharding(mesh, s), lambda idx, n=n: p[n][idx])
                   for n, s in zip(names, specs, strict=True)]
    with jax.set_mesh(mesh):
        t1 = time.perf_counter()
        (value, (out, aux)), grads = step(*args_global)
        jax.block_until_ready(grads)
    print(f"process {jax.process_index()}: forward + backward (with compile) {time.perf_counter() - t1:.1f} s",
          flush=True)
    got = dict(value=value, out=out, aux=aux, **{f"d_{n}": g for n, g in zip(names, grads, strict=True)})
    host = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in got.items()}
    if args.out and jax.process_index() == 0:
        np.savez(args.out, **{f"in_{n}": v for n, v in p.items()}, **host)
    multihost_utils.sync_global_devices("ep_processes: done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
