"""The one kernel timer of ``python -m gpurouter bench`` and of the probes in
``tools/probes`` (GPU only): CUDA events around launches, queued behind a sleep
kernel so that the host's launch rate is not what is timed.

The probes use this module's API (``time_plan``, ``median_us``, ``floor_us``,
``preset_cases``, ``report``) rather than kernel privates."""

from __future__ import annotations

import json
import statistics
import time

import numpy as np


def preset_cases(names=None) -> dict:
    """``{name: (E, K, num_groups, group_topk, score-function code, bias, pre-softmax)}``
    of the model presets (``gpurouter.presets``: the probes time what the bench does),
    all of them or ``names``."""
    from ..kernels._base import launch as L
    from ..presets import PRESETS

    return {n: (p.num_experts, p.topk, p.num_groups, p.group_topk,
                L.score_function_code(p.score_function, "preset_cases"), p.expert_bias, p.use_pre_softmax)
            for n, p in PRESETS.items() if names is None or n in names}


def spin_kernel():
    """A one-thread kernel that sleeps about ``n`` microseconds: queued before a
    batch of timed launches, it keeps the GPU busy while the host queues them,
    so that the events time the kernels alone, not the host's launch rate."""
    from numba import cuda, uint32

    @cuda.jit
    def spin(n):
        for _ in range(n):
            cuda.nanosleep(uint32(1000))

    return spin


def ptr(a) -> int:
    """The device pointer of any array with ``__cuda_array_interface__``."""
    return int(a.__cuda_array_interface__["data"][0])


def launch_times(call, arg_sets, repeats: int, spin, stream=0) -> tuple[list[float], list[float]]:
    """``(kernel seconds, host seconds)`` of ``repeats`` calls of ``call(args)``,
    ``args`` rotated over ``arg_sets`` (the first call, untimed, compiles and warms).

    Kernel seconds: CUDA events recorded on ``stream`` around each call, in
    batches of 25 queued behind a ~2 ms sleep kernel (longer than the host needs
    to queue them). Host seconds: the Python time of each call."""
    from numba import cuda

    from ..kernels._base import launch as L

    call(arg_sets[0])
    cuda.synchronize()
    kernel, host = [], []
    for c0 in range(0, repeats, 25):
        n = min(25, repeats - c0)
        events = [cuda.event() for _ in range(n + 1)]
        L.launch(spin, 1, 1, stream, 0, 2000)
        events[0].record(stream)
        for i in range(n):
            t = time.perf_counter()
            call(arg_sets[(c0 + i) % len(arg_sets)])
            host.append(time.perf_counter() - t)
            events[i + 1].record(stream)
        events[-1].synchronize()
        kernel += [events[i].elapsed_time(events[i + 1]) * 1e-3 for i in range(n)]
    return kernel, host


def median_us(launch, ptr_sets, repeats, spin) -> float:
    """Median microseconds of ``launch(ptrs, 0)`` over ``repeats`` launches,
    ``ptrs`` rotated over ``ptr_sets`` (``launch_times`` on the default stream)."""
    kernel, _ = launch_times(lambda ptrs: launch(ptrs, 0), ptr_sets, repeats, spin)
    return statistics.median(kernel) * 1e6


def floor_us(repeats, spin) -> float:
    """Median microseconds of an empty kernel timed the same way: the method's floor."""
    from numba import cuda

    from ..kernels._base import launch as L

    @cuda.jit
    def empty(x):
        pass

    dummy = cuda.device_array(1, np.float32)
    return median_us(lambda p, s: L.launch(empty, 1, 32, 0, 0, dummy), [[0]], repeats, spin)


def time_plan(plan, sets, repeats, spin):
    """``(median us, outputs)`` of a plan launched as the pointer transports launch it
    (``_pointer.PointerLaunch``), its inputs rotated over ``sets`` (lists of device
    arrays, the plan's inputs in order); the outputs (host arrays) are the first set's."""
    from numba import cuda

    from ..kernels._base import pointer as _pointer

    outs = [cuda.device_array(s.shape, dtype=s.dtype) for s in plan.outs]
    tmps = [cuda.device_array(s.shape, dtype=s.dtype) for s in plan.tmps]
    launch = _pointer.PointerLaunch(plan, 0)
    ptr_sets = [[ptr(a) for a in [*arrays, *outs, *tmps]] for arrays in sets]
    us = median_us(launch, ptr_sets, repeats, spin)
    launch(ptr_sets[0], 0)
    cuda.synchronize()
    return us, [o.copy_to_host() for o in outs]


def sass_counts(kern, path=None) -> dict | str:
    """A compiled kernel's registers and SASS instruction counts (needs
    nvdisasm): in all, local-memory loads and stores, shuffles, and the ten
    commonest opcodes; with ``path`` the SASS is written there too."""
    try:
        sass = kern.inspect_sass()
    except Exception as exc:  # noqa: BLE001  (a diagnostic only)
        return f"unavailable: {exc}"
    text = next(iter(sass.values())) if isinstance(sass, dict) else sass
    if path:
        with open(path, "w") as f:
            f.write(text)
    lines = [ln for ln in text.splitlines() if "/*" in ln and ";" in ln]
    try:
        regs = kern.get_regs_per_thread()
        regs = next(iter(regs.values())) if isinstance(regs, dict) else regs
    except Exception:  # noqa: BLE001
        regs = None
    ops: dict[str, int] = {}
    for ln in lines:
        words = ln.split("*/", 1)[-1].replace("{", " ").split()
        words = [w for w in words if not w.startswith("@")]
        if words:
            op = words[0].split(".")[0]
            ops[op] = ops.get(op, 0) + 1
    local = sum(("LDL" in ln) or ("STL" in ln) for ln in lines)
    top = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:10])
    return {"registers": regs, "instructions": len(lines), "local (LDL/STL)": local,
            "SHFL": sum("SHFL" in ln for ln in lines), "top opcodes": top}


def report(rows: list, row: dict) -> None:
    """Keeps a probe's result row and prints it as one JSON line (the run's progress)."""
    rows.append(row)
    print(json.dumps(row), flush=True)


def save_rows(path, rows: list) -> None:
    """Writes a probe's rows as JSON to ``path`` (nothing when ``path`` is empty)."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
