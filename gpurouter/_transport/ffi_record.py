"""The ``"ffi"`` transport's launch records: what the handler (``ffi.py``) reads.

A record is an int64 array built at trace time from an op's kernel plan and
kept for the life of the process; the call passes its address as the ``plan``
attribute. Layout (int64 words)::

    header   MAGIC, n_ins, n_rets, cuLaunchKernel, cuCtxGetCurrent,
             cuCtxPushCurrent, cuCtxPopCurrent, 5 message addresses,
             MAX_DEVICES device offsets (0: no kernels for that GPU), the
             element count of every array (ins, then outs and tmps)
    device   context, n_steps, then per step: kernel handle, grid, block,
             shared bytes, n_params, n_holes, the parameter block (8-byte
             slots, ``kernels._pointer.compile_steps``), (slot, array) holes
"""

from __future__ import annotations

import functools
import threading

import jax
import numpy as np

from ._shared import COMPILE_LOCK

MAGIC = 0x67707572_6F757465  # "gpuroute"
MAX_DEVICES = 64
#: parameter slots a step may have (the handler's stack copy), arrays a call may have
MAX_PARAMS = 256
MAX_ARRAYS = 32

# header word indices
N_INS, N_RETS, LAUNCH_FN, GET_CTX_FN, PUSH_FN, POP_FN = 1, 2, 3, 4, 5, 6
MSG_CALL, MSG_DEVICE, MSG_LAUNCH, MSG_CONTEXT, MSG_SIZES = 7, 8, 9, 10, 11
DEVICES = 12
COUNTS = DEVICES + MAX_DEVICES
# errors the handler raises before it has a record
MSG_FRAME = b"gpurouter ffi: XLA's call frame or API table is older than the handler reads\0"
MSG_ATTR = b"gpurouter ffi: the call has no int64 'plan' attribute (not a gpurouter call)\0"
MSG_MAJOR = b"gpurouter ffi: XLA's FFI API major version is not 0; use transport=\"zero-copy\"\0"


def _message(text: str) -> np.ndarray:
    return np.frombuffer(text.encode() + b"\0", np.uint8).copy()


@functools.cache
def _driver() -> tuple[int, int, int, int]:
    """Addresses of cuLaunchKernel, cuCtxGetCurrent, cuCtxPushCurrent_v2, cuCtxPopCurrent_v2."""
    import ctypes

    from ..kernels._base.context import libcuda

    lib = libcuda()
    return tuple(ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in
                 ("cuLaunchKernel", "cuCtxGetCurrent", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2"))


_RECORDS: dict = {}  # id(plan) -> (record, messages, plan): alive for the process
_RECORDS_LOCK = threading.Lock()




def _gpu_ordinals() -> list[int]:
    """The CUDA ordinals of the GPUs JAX runs on in this process."""
    return sorted({int(d.local_hardware_id) for d in jax.local_devices(backend="gpu")})


def build_record(plan, ordinals, compiled: dict, context: dict, driver) -> tuple[np.ndarray, list]:
    """The launch record of ``plan`` (see the module docstring): ``compiled``
    maps each ordinal to ``kernels._pointer.compile_steps(plan, ordinal)``,
    ``context`` to its CUDA context. Returns ``(record, messages)``; both must
    outlive every call that names the record."""
    op = plan.op
    specs = (*plan.ins, *plan.outs, *plan.tmps)
    if len(specs) > MAX_ARRAYS:
        raise NotImplementedError(f"{op}: a plan of {len(specs)} arrays (the ffi handler takes {MAX_ARRAYS})")
    seen = ", ".join(map(str, ordinals))
    messages = [
        _message(f"gpurouter ffi ({op}): XLA passed other arguments than the traced call "
                 f"({len(plan.ins)} inputs, {len(plan.outs) + len(plan.tmps)} results, all arrays)"),
        _message(f"gpurouter ffi ({op}): no kernels for this GPU (traced for CUDA devices {seen}); "
                 "trace the call again in this process"),
        _message(f"gpurouter ffi ({op}): cuLaunchKernel failed"),
        _message(f"gpurouter ffi ({op}): cuCtxPushCurrent failed"),
        _message(f"gpurouter ffi ({op}): an array's size differs from the traced call's "
                 f"({', '.join(str(s.shape) for s in specs)})"),
    ]
    header = [MAGIC, len(plan.ins), len(plan.outs) + len(plan.tmps), *driver,
              *(int(m.ctypes.data) for m in messages)]
    body, offsets = [], [0] * MAX_DEVICES
    start = len(header) + MAX_DEVICES + len(specs)
    for ordinal in ordinals:
        if ordinal >= MAX_DEVICES:
            raise NotImplementedError(f"{op}: CUDA device {ordinal} (the ffi handler takes {MAX_DEVICES})")
        offsets[ordinal] = start + len(body)
        steps = compiled[ordinal]
        body += [context[ordinal], len(steps)]
        for st in steps:
            params = np.frombuffer(st.params, np.int64)
            if len(params) > MAX_PARAMS:
                raise NotImplementedError(f"{op}: kernel {st.name} takes {len(params)} parameter words "
                                          f"(the ffi handler copies {MAX_PARAMS})")
            body += [st.handle, st.grid, st.block, st.shared, len(params), len(st.holes), *params.tolist()]
            body += [v for hole in st.holes for v in hole]
    counts = [int(np.prod(s.shape, dtype=np.int64)) for s in specs]
    record = np.array(header + offsets + counts + body, np.int64)
    return record, messages


def _record(plan) -> int:
    """The address of ``plan``'s launch record, built on first use."""
    hit = _RECORDS.get(id(plan))
    if hit is None:
        from ..kernels._base.context import primary_context
        from ..kernels._base.plan import counter_array, plan_counters
        from ..kernels._base.pointer import compile_steps

        with COMPILE_LOCK, _RECORDS_LOCK:
            hit = _RECORDS.get(id(plan))
            if hit is None:
                ordinals = _gpu_ordinals()
                # A plan's counters (kernels._plan.Counter): one per GPU, written into
                # the parameter blocks.  Right while XLA runs a GPU's launches of one
                # plan one after another (its one compute stream, stream order; a CUDA
                # graph of them is launched on it too); two at once on two streams
                # would share the counter.
                counters = {o: {id(c): int(counter_array(c, o, "ffi").__cuda_array_interface__["data"][0])
                                for c in plan_counters(plan)} for o in ordinals}
                compiled = {o: compile_steps(plan, o, counters[o]) for o in ordinals}
                context = {o: primary_context(o) for o in ordinals}
                record, messages = build_record(plan, ordinals, compiled, context, _driver())
                hit = _RECORDS[id(plan)] = (record, messages, plan)  # the plan keeps its id unique
    return int(hit[0].ctypes.data)
