"""Transport ``"ffi"``: XLA calls a compiled handler that launches a plan's kernels.

No Python and no GIL per call. One handler for every op, a ``numba.cfunc``
compiled once per process and registered with XLA's typed FFI as the CUDA
target ``gpurouter_plan``. Each traced call passes one attribute, ``plan``:
the address of its *launch record*, built here at trace time from the op's
kernel plan (``kernels._plan.Plan``) and kept for the life of the process:

    header   MAGIC, n_ins, n_rets, cuLaunchKernel, cuCtxGetCurrent,
             cuCtxPushCurrent, cuCtxPopCurrent, 5 messages, MAX_DEVICES device
             offsets (0: no kernels for that GPU), the element count of every
             array (ins, then outs and tmps)
    device   context, n_steps, then per step: kernel handle, grid, block,
             shared bytes, n_params, n_holes, the parameter block (8-byte
             slots, ``kernels._pointer.compile_steps``), (slot, array) holes

The handler answers XLA's metadata query, checks the call frame, the API
table and every buffer against the record, gets XLA's stream and device
ordinal, copies the device's parameter blocks to its own stack, writes the
buffers' addresses into the holes and calls ``cuLaunchKernel`` per step; a
failure comes back as an XLA error (``XLA_FFI_Error_Create``) whose message
names the op and the rule, never as a crash. Scratch arrays are extra XLA
outputs: nothing is allocated in the handler. Records are filled for every
GPU JAX sees (per-device tables for several GPUs in one process).

Not serialisable: a record's address is only valid in the process that
traced the call (``jax.export`` of these ops is not supported). So that JAX's
persistent compilation cache (``jax_compilation_cache_dir``) can never hand
one process a program compiled in another, each call also carries the
attribute ``process``, a number drawn once per process; the handler ignores it.
"""

from __future__ import annotations

import functools
import os
import warnings

import jax
import numpy as np

from .._vma import varying
from . import ffi_abi as abi
from ._shared import COMPILE_LOCK, plan_of, to_words, word_spec
from .ffi_record import (
    COUNTS,
    DEVICES,
    GET_CTX_FN,
    LAUNCH_FN,
    MAGIC,
    MAX_ARRAYS,
    MAX_DEVICES,
    MAX_PARAMS,
    MSG_ATTR,
    MSG_CALL,
    MSG_CONTEXT,
    MSG_DEVICE,
    MSG_FRAME,
    MSG_LAUNCH,
    MSG_MAJOR,
    MSG_SIZES,
    N_INS,
    N_RETS,
    POP_FN,
    PUSH_FN,
    _record,
)

TARGET = "gpurouter_plan"
#: The ``process`` attribute: a random 63-bit number of this process. Two processes'
#: programs differ in it, so a persistent compile cache never reuses one of them in
#: another process, where its ``plan`` address would point at something else.
PROCESS_SALT = np.int64(int.from_bytes(os.urandom(8), "little") >> 1)
#: XLA_FFI_Handler_Traits the handler declares: none. COMMAND_BUFFER_COMPATIBLE
#: (1) would let XLA capture its launches in a CUDA graph, where two independent
#: calls can run at once; the z-loss forward's counter (kernels/_plan.Counter,
#: one per plan and GPU here) needs a GPU's launches of a plan in stream order.
#: Declaring it changed no step time on an H200 (docs/transports.md).
TRAITS = 0


@functools.cache
def _handler():
    """The handler's entry point (``.address``): compiled once per process
    (about two seconds) or loaded from the kernel cache (``ffi_cache``)."""
    from . import ffi_cache

    return ffi_cache.cached_cfunc(_compile_handler)


def _compile_handler():
    """The cfunc. Its code holds no address of this process (its static
    messages are written on its stack), so its machine code can be cached."""
    from numba import cfunc, njit, types

    ld8, ld32, ld64, st8, st32, st64, scratch, caller = abi.intrinsics()
    call_api = caller(("i64", "i64"))  # XLA_FFI_Error* fn(Args*)
    call1 = caller(("i32", "i64"))  # CUresult fn(void*)
    launch = caller(("i32", "i64", "i32", "i32", "i32", "i32", "i32", "i32", "i32", "i64", "i64", "i64"))
    frame_msg, attr_msg, major_msg = (tuple(m.rstrip(b"\0")) for m in (MSG_FRAME, MSG_ATTR, MSG_MAJOR))
    plan_name = int.from_bytes(b"plan", "little")

    @njit(inline="always")
    def fail(api, message, code):
        args = scratch(4)
        st64(args, abi.ERR_SIZE)
        st64(args + 8, 0)
        st64(args + abi.ERR_MESSAGE, message)
        st32(args + abi.ERR_ERRC, code)
        return call_api(ld64(api + abi.API_ERROR_CREATE), (args,))

    @njit(inline="always")
    def fail_static(api, codes, code):
        """``fail`` with a message given as its bytes (a constant tuple), copied
        to a stack buffer: XLA copies the message when it creates the error."""
        buf = scratch(32)  # 256 bytes: the messages are under 100
        for i in range(len(codes)):
            st8(buf + i, codes[i])
        st8(buf + len(codes), 0)
        return fail(api, buf, code)

    @njit(inline="always")
    def ask(api, function, args, size, ctx):
        """Calls the API function at offset ``function`` with an Args struct
        {struct_size, extension_start, ctx, out} at ``args`` (out zeroed)."""
        st64(args, size)
        st64(args + 8, 0)
        st64(args + abi.QUERY_CTX, ctx)
        st64(args + abi.QUERY_OUT, 0)
        return call_api(ld64(api + function), (args,))

    @njit
    def fail_code(api, message, code):
        """``message`` + " (CUresult <code>)" in a stack buffer."""
        buf = scratch(32)  # 256 bytes: messages are under 200
        n = 0
        while n < 200 and ld8(message + n) != 0:
            st8(buf + n, ld8(message + n))
            n += 1
        for ch in (32, 40, 67, 85, 114, 101, 115, 117, 108, 116, 32):  # " (CUresult "
            st8(buf + n, ch)
            n += 1
        digits = scratch(2)
        k, v = 0, code if code > 0 else 0
        while k == 0 or v > 0:
            st8(digits + k, 48 + v % 10)
            k += 1
            v //= 10
        while k > 0:
            k -= 1
            st8(buf + n, ld8(digits + k))
            n += 1
        st8(buf + n, 41)  # ")"
        st8(buf + n + 1, 0)
        return fail(api, buf, abi.ERROR_INTERNAL)

    def handler(frame):
        ext = ld64(frame + abi.CF_EXTENSION)
        if ext != 0 and ld32(ext + abi.EXT_TYPE) == abi.EXTENSION_METADATA:
            md = ld64(ext + abi.EXT_METADATA)
            if ld64(md + abi.MD_STRUCT_SIZE) >= abi.MD_TRAITS + 4:  # the fields written below
                st64(md + abi.MD_VERSION_STRUCT_SIZE, abi.VERSION_SIZE)
                st64(md + abi.MD_VERSION_STRUCT_SIZE + 8, 0)
                st32(md + abi.MD_VERSION_MAJOR, abi.DECLARED_VERSION[0])
                st32(md + abi.MD_VERSION_MINOR, abi.DECLARED_VERSION[1])
                st32(md + abi.MD_TRAITS, TRAITS)
            return 0
        api = ld64(frame + abi.CF_API)
        api_size = ld64(api + abi.API_STRUCT_SIZE)
        if ld64(frame + abi.CF_STRUCT_SIZE) < abi.CF_MIN_SIZE or api_size < abi.API_STREAM_GET + 8:
            return fail_static(api, frame_msg, abi.ERROR_FAILED_PRECONDITION)
        if ld32(api + abi.API_MAJOR) != abi.ABI_MAJOR:
            return fail_static(api, major_msg, abi.ERROR_FAILED_PRECONDITION)
        rec = 0
        for i in range(ld64(frame + abi.CF_ATTRS_SIZE)):
            name = ld64(ld64(frame + abi.CF_ATTRS_NAMES) + 8 * i)
            attr = ld64(ld64(frame + abi.CF_ATTRS_ATTRS) + 8 * i)
            if (ld64(name + abi.SPAN_LEN) == 4 and ld32(ld64(name + abi.SPAN_PTR)) == plan_name
                    and ld32(ld64(frame + abi.CF_ATTRS_TYPES) + 4 * i) == abi.ATTR_SCALAR
                    and ld32(attr + abi.SCALAR_DTYPE) == abi.DTYPE_S64):
                rec = ld64(ld64(attr + abi.SCALAR_VALUE))
        if rec == 0 or ld64(rec) != MAGIC:
            return fail_static(api, attr_msg, abi.ERROR_INVALID_ARGUMENT)
        n_ins, n_rets = ld64(rec + 8 * N_INS), ld64(rec + 8 * N_RETS)
        if ld64(frame + abi.CF_ARGS_SIZE) != n_ins or ld64(frame + abi.CF_RETS_SIZE) != n_rets:
            return fail(api, ld64(rec + 8 * MSG_CALL), abi.ERROR_INVALID_ARGUMENT)
        ptrs = scratch(MAX_ARRAYS)
        for a in range(n_ins + n_rets):
            if a < n_ins:
                kind = ld32(ld64(frame + abi.CF_ARGS_TYPES) + 4 * a)
                buf = ld64(ld64(frame + abi.CF_ARGS_ARGS) + 8 * a)
            else:
                kind = ld32(ld64(frame + abi.CF_RETS_TYPES) + 4 * (a - n_ins))
                buf = ld64(ld64(frame + abi.CF_RETS_RETS) + 8 * (a - n_ins))
            if kind != abi.ARG_BUFFER:
                return fail(api, ld64(rec + 8 * MSG_CALL), abi.ERROR_INVALID_ARGUMENT)
            count = 1
            dims = ld64(buf + abi.BUF_DIMS)
            for d in range(ld64(buf + abi.BUF_RANK)):
                count *= ld64(dims + 8 * d)
            if count != ld64(rec + 8 * (COUNTS + a)):
                return fail(api, ld64(rec + 8 * MSG_SIZES), abi.ERROR_INVALID_ARGUMENT)
            st64(ptrs + 8 * a, ld64(buf + abi.BUF_DATA))
        ctx = ld64(frame + abi.CF_CTX)
        query = scratch(4)  # the Args struct of the two context queries
        err = ask(api, abi.API_STREAM_GET, query, abi.STREAM_SIZE, ctx)
        if err != 0:
            return err
        stream = ld64(query + abi.QUERY_OUT)
        ordinal = 0
        if api_size >= abi.API_DEVICE_ORDINAL_GET + 8:
            err = ask(api, abi.API_DEVICE_ORDINAL_GET, query, abi.ORDINAL_SIZE, ctx)
            if err != 0:
                return err
            ordinal = ld32(query + abi.QUERY_OUT)
        if ordinal < 0 or ordinal >= MAX_DEVICES or ld64(rec + 8 * (DEVICES + ordinal)) == 0:
            return fail(api, ld64(rec + 8 * MSG_DEVICE), abi.ERROR_FAILED_PRECONDITION)
        dev = rec + 8 * ld64(rec + 8 * (DEVICES + ordinal))
        context = ld64(dev)
        current = scratch(1)
        st64(current, 0)
        call1(ld64(rec + 8 * GET_CTX_FN), (current,))
        pushed = ld64(current) != context
        if pushed and call1(ld64(rec + 8 * PUSH_FN), (context,)) != 0:
            return fail(api, ld64(rec + 8 * MSG_CONTEXT), abi.ERROR_INTERNAL)
        params = scratch(MAX_PARAMS)
        argv = scratch(MAX_PARAMS)
        w = dev + 16
        status = 0
        for _ in range(ld64(dev + 8)):
            n_params, n_holes = ld64(w + 32), ld64(w + 40)
            for j in range(n_params):
                st64(params + 8 * j, ld64(w + 48 + 8 * j))
                st64(argv + 8 * j, params + 8 * j)
            holes = w + 48 + 8 * n_params
            for h in range(n_holes):
                st64(params + 8 * ld64(holes + 16 * h), ld64(ptrs + 8 * ld64(holes + 16 * h + 8)))
            status = launch(ld64(rec + 8 * LAUNCH_FN),
                            (ld64(w), ld64(w + 8), 1, 1, ld64(w + 16), 1, 1, ld64(w + 24), stream, argv, 0))
            if status != 0:
                break
            w = holes + 16 * n_holes
        if pushed:
            call1(ld64(rec + 8 * POP_FN), (current,))
        if status != 0:
            return fail_code(api, ld64(rec + 8 * MSG_LAUNCH), status)
        return 0

    return cfunc(types.int64(types.int64), nopython=True)(handler)


_REGISTERED: list = []


def _register() -> None:
    if not _REGISTERED:
        with COMPILE_LOCK:
            if not _REGISTERED:
                handler = _handler()
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler.address), platform="CUDA")
                _REGISTERED.append(handler)  # XLA keeps the raw address: keep the cfunc alive


def _unbatched_call(planner, out_specs, n_token: int, args):
    """One call on unbatched arrays. Token-parallel calls (``n_token`` > 0:
    every result has the tokens of ``args[0]`` on axis 0, the vmap rule may
    have folded a batch into them) split over a token-sharded mesh by
    ``partition.token_parallel`` when JAX has several devices and the call
    is not inside ``shard_map``."""
    if not n_token:
        return _launch(planner, out_specs, args)

    def per_token(*xs):
        t = xs[0].shape[0]
        return _launch(planner, [jax.ShapeDtypeStruct((t, *s.shape[1:]), s.dtype) for s in out_specs], xs)

    if len(jax.devices()) > 1 and not any(varying(a) for a in args):
        from .partition import token_parallel

        t = args[0].shape[0]
        return token_parallel(per_token, n_token, args,
                              [word_spec(jax.ShapeDtypeStruct((t, *s.shape[1:]), s.dtype)) for s in out_specs])
    return per_token(*args)


def _launch(planner, out_specs, args):
    plan = plan_of(planner, args)
    results = tuple(word_spec(s) for s in out_specs) + tuple(
        jax.ShapeDtypeStruct(t.shape, t.dtype) for t in plan.tmps)
    if not _REGISTERED:  # a cold process: the handler compiles in a worker while the kernels compile here
        from ..kernels._base.parallel import worker_argv
        from . import ffi_cache

        ffi_cache.compile_in_worker(worker_argv(__name__))
    record = _record(plan)
    _register()
    call = jax.ffi.ffi_call(TARGET, results, vmap_method="sequential")
    return call(*args, plan=np.int64(record), process=PROCESS_SALT)[: len(out_specs)]


def _batched(planner, out_specs, n_token: int):
    """The call as a function of its arrays, with a vmap rule: a batch of
    per-token arrays folds into the token axis (one launch, a plan for the
    larger T) when no per-call array is batched; otherwise ``lax.map``
    runs the unbatched call once per batch element."""
    from jax import lax

    @jax.custom_batching.custom_vmap
    def call(*args):
        return _unbatched_call(planner, out_specs, n_token, args)

    @call.def_vmap
    def rule(axis_size, in_batched, *args):
        full = [a if b else jax.numpy.broadcast_to(a, (axis_size, *a.shape))
                for a, b in zip(args, in_batched, strict=True)]
        if n_token and not any(in_batched[n_token:]):
            tokens = [a.reshape((-1, *a.shape[2:])) for a in full[:n_token]]
            outs = call(*tokens, *args[n_token:])
            return tuple(o.reshape((axis_size, -1, *o.shape[1:])) for o in outs), (True,) * len(outs)
        outs = lax.map(lambda xs: tuple(call(*xs)), tuple(full))
        return tuple(outs), (True,) * len(outs)

    return call


def ffi_call(planner, out_specs, token_args, call_args) -> tuple[jax.Array, ...]:
    """The plan of ``planner`` run by the handler on XLA's buffers and stream."""
    from jax import lax

    args = [to_words(jax.numpy.asarray(a)) for a in (*token_args, *call_args)]
    specs = tuple(out_specs)
    outs = _batched(planner, specs, len(token_args))(*args)
    return tuple(lax.bitcast_convert_type(o, jax.numpy.bfloat16) if s.dtype == jax.numpy.bfloat16 else o
                 for o, s in zip(outs, specs, strict=True))


@functools.cache
def unavailable_reason() -> str | None:
    """Why the handler cannot run with this jaxlib, or None when it can: the
    installed jaxlib's c_api.h must match ``ffi_abi``'s declarations."""
    if not all(hasattr(jax.ffi, n) for n in ("ffi_call", "register_ffi_target", "pycapsule")):
        return "jax.ffi lacks ffi_call, register_ffi_target or pycapsule."
    path = abi.header_path()
    if path is None:
        return "the installed jaxlib ships no include/xla/ffi/api/c_api.h to check the ABI against."
    bad = abi.header_mismatches(path.read_text())
    if bad:
        return f"its XLA FFI ABI differs from the one gpurouter reads ({'; '.join(bad[:3])})."
    return None


_WARNED: list[bool] = []


def available() -> bool:
    """True when the ABI checks out; warns once (and the caller falls back to
    ``"zero-copy"``) when it does not."""
    reason = unavailable_reason()
    if reason is not None and not _WARNED:
        _WARNED.append(True)
        warnings.warn(f"gpurouter: transport \"ffi\" is off: {reason} transport=\"auto\" uses "
                      "\"zero-copy\" instead.", RuntimeWarning, stacklevel=4)
    return reason is None


if __name__ == "__main__":  # the handler's worker (ffi_cache.compile_in_worker): compile it into the cache
    _handler()
