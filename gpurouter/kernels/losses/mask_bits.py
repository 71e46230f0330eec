"""Token masks as bitwise selects (device functions only; the masked loss kernels
``column_sums.py``, ``aux_loss_bwd.py`` and ``z_loss_unit.py`` use them):

- ``all_ones_if(bit)``: ``0xFFFFFFFF`` for 1, 0 for 0;
- ``keep_if(v, m)``: fp32 ``v`` where ``m`` is all ones, +0.0 where it is 0,
  whatever ``v`` is (NaN and inf too): a select on the bits, no branch, so no
  load is made to wait on a mask byte;
- ``opaque_byte_loader()``: a mask byte's load that LLVM cannot move, for the
  loops that load their flags trips ahead of their use.

Until 2026-11-29 the aux loss forward staged its block's mask here as bits in
shared memory; a mask byte loaded with each row's values (``column_sums``) is
faster on an H200 once ptxas keeps the loads in flight (docs/kernels.md,
"Token masks in the loss kernels").
"""

from __future__ import annotations

import functools

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import numpy as np
from numba import cuda

from .._base.launch import simulator_enabled

#: every bit of a uint32 (``all_ones_if``)
ALL_ONES = np.uint32(0xFFFFFFFF)


@cuda.jit(device=True)
def all_ones_if(bit):
    """``0xFFFFFFFF`` for ``bit`` 1, 0 for 0 (a uint32 0 or 1)."""
    return np.uint32(ALL_ONES * np.uint32(bit))


@cuda.jit(device=True)
def keep_if(v, m):
    """fp32 ``v`` where ``m`` is ``0xFFFFFFFF``, +0.0 where it is 0: a select on
    the bits (no branch, so no load is made conditional on the mask; a masked
    NaN or inf becomes +0.0, what a zeroed row adds)."""
    return np.uint32(np.float32(v).view(np.uint32) & m).view(np.float32)


@functools.cache
def opaque_byte_loader():
    """``load(mask, i) -> uint8``: byte ``i`` of a 1-d bool / uint8 device array,
    loaded by volatile inline PTX (``ld.global.u8``), which LLVM sees as an opaque call.

    Why: a loop that loads the next trip's flags before this trip's stores
    carries the loaded values in a phi, and LLVM's InstCombine folds a phi of
    loads into one load of a phi of addresses, placed where the values are
    used: the prefetch is undone and every trip waits on its loads (seen in
    the masked aux backward's PTX, 2026-11-29).  A volatile asm call is neither
    folded nor moved (a pure one was moved to its use the same way).  The
    simulator (no PTX): the plain read."""
    if simulator_enabled():

        @cuda.jit(device=True)
        def load_plain(mask, i):
            return np.uint8(mask[i])

        return load_plain
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def load_byte(typingctx, mask, i):
        sig = types.uint8(mask, i)

        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
            ptr = builder.gep(data, [context.cast(builder, args[1], sig.args[1], types.uint64)])
            i64, i32 = ir.IntType(64), ir.IntType(32)
            # side_effect: volatile, so LLVM neither moves nor merges it (a pure asm call is rematerialised
            # at its use like any pure value, the prefetch undone again)
            asm = ir.InlineAsm(ir.FunctionType(i32, [i64]), "ld.global.u8 $0, [$1];", "=r,l", side_effect=True)
            return builder.trunc(builder.call(asm, [builder.ptrtoint(ptr, i64)]), ir.IntType(8))

        return sig, codegen

    return load_byte
