"""Kernel timing shared by the probes in tools/ (GPU only): CUDA events around
plan launches on raw pointers, queued behind a sleep kernel so that the
host's launch rate is not what is timed (as ``python -m gpurouter bench``)."""

from __future__ import annotations

import json
import statistics

import numpy as np
from numba import cuda, uint32

from gpurouter.kernels._base import launch as L
from gpurouter.kernels._base import pointer as _pointer


def preset_cases(names=None) -> dict:
    """``{name: (E, K, num_groups, group_topk, score-function code, bias, pre-softmax)}``
    of the model presets (``gpurouter.presets``: the probes time what the bench does),
    all of them or ``names``."""
    from gpurouter.presets import PRESETS

    return {n: (p.num_experts, p.topk, p.num_groups, p.group_topk,
                L.score_function_code(p.score_function, "preset_cases"), p.expert_bias, p.use_pre_softmax)
            for n, p in PRESETS.items() if names is None or n in names}


def spin_kernel():
    """A one-thread kernel that sleeps about ``n`` microseconds."""

    @cuda.jit
    def spin(n):
        for _ in range(n):
            cuda.nanosleep(uint32(1000))

    return spin


def ptr(a) -> int:
    """The device pointer of any array with ``__cuda_array_interface__``."""
    return int(a.__cuda_array_interface__["data"][0])


def median_us(launch, ptr_sets, repeats, spin) -> float:
    """Median microseconds of ``launch(ptrs, 0)`` over ``repeats`` launches,
    ``ptrs`` rotated over ``ptr_sets``; batches of 25 launches, each behind a
    ~2 ms sleep (longer than the host needs to queue them)."""
    launch(ptr_sets[0], 0)
    cuda.synchronize()
    times = []
    for c0 in range(0, repeats, 25):
        n = min(25, repeats - c0)
        events = [cuda.event() for _ in range(n + 1)]
        L.launch(spin, 1, 1, 0, 0, 2000)
        events[0].record()
        for i in range(n):
            launch(ptr_sets[(c0 + i) % len(ptr_sets)], 0)
            events[i + 1].record()
        events[-1].synchronize()
        times += [events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(n)]
    return statistics.median(times)


def floor_us(repeats, spin) -> float:
    """Median microseconds of an empty kernel timed the same way: the method's floor."""

    @cuda.jit
    def empty(x):
        pass

    dummy = cuda.device_array(1, np.float32)
    return median_us(lambda p, s: L.launch(empty, 1, 32, 0, 0, dummy), [[0]], repeats, spin)


def time_plan(plan, sets, repeats, spin):
    """``(median us, outputs)`` of a plan launched as the pointer transports launch it
    (``_pointer.PointerLaunch``), its inputs rotated over ``sets`` (lists of device
    arrays, the plan's inputs in order); the outputs (host arrays) are the first set's."""
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
