"""Router top-k with a score function: the backward's launcher and plan
(docs/contract.md section 3).

The plan picks the warp-per-token kernel (``warp/bwd.py``) when
``use_warp_bwd`` takes the shape (a map outside softmax-pre, E a multiple of
128 up to 512; under "auto" on a GPU), else the quad kernel
(``bwd_quad.py``, E a multiple of 4), else the streaming one
(``bwd_stream.py``).
"""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np

from .._base.access import array_views, map_view
from .._base.launch import (
    BITMAP_U8,
    F32,
    SOFTMAX,
    SQRTSOFTPLUS,
    any_on_device,
    device_input,
    map_format_code,
    map_input,
    resolve_stream,
    score_function_code,
)
from .._base.plan import In, Out, Plan, Spec, Step, execute, map_spec, spec_of
from .bwd_quad import quad_bwd_kernel
from .bwd_stream import stream_bwd_kernel
from .bwd_tiling import quad_tiling, stream_tiling
from .tiling import TOPK_TILING, TopkTiling
from .warp.bwd import warp_bwd_launch, warp_topk_bwd_kernel
from .warp_paths import use_warp_bwd

OP = "topk_with_score_function"


def topk_with_score_function_bwd(
    routing_map,
    saved_scores,
    grad_probs,
    topk,
    use_pre_softmax=False,
    scaling_factor=1.0,
    score_function="softmax",
    *,
    path="auto",
    tiling=None,
    out=None,
    stream=0,
):
    """Router backward: ``grad_probs`` -> ``grad_logits`` (docs/contract.md section 3).

    Args:
      routing_map: from the forward, either format (told by its dtype): (T, E)
        bool (BYTEMAP) or (T, ceil(E/8)) uint8 (BITMAP_U8; padding bits ignored).
      saved_scores: (T, E) float32, from the forward.
      grad_probs: (T, E) float32 | bfloat16 | float16.
      topk, use_pre_softmax, scaling_factor, score_function: as in the forward.
      path: the kernel: ``"auto"``, ``"warp"`` (a warp a token: a map
        outside softmax-pre, E a multiple of 128 up to 512; else a
        ValueError) or ``"quad"`` (the quad kernel; the streaming one where
        E % 4 != 0).  Every path gives the contract's gradients; the bits of
        the token's sums may differ between paths in the last place.
      tiling: a ``TopkTiling`` (None: the library's; its ``bwd`` is read).
      out: optional device array for grad_logits.
      stream: numba stream or int CUDA stream handle.

    Returns:
      grad_logits (T, E), dtype of grad_probs.
    """
    op = OP + "_bwd"
    score_fn = score_function_code(score_function, op)
    s = resolve_stream(stream)
    d_saved, skind = device_input(saved_scores, "saved_scores", op, s, ndim=2)
    if skind != F32:
        raise TypeError(f"{op}: saved_scores must be float32, got {d_saved.dtype}.")
    d_grad, kind = device_input(grad_probs, "grad_probs", op, s, ndim=2)
    shape = tuple(int(v) for v in d_saved.shape)
    to_host = not any_on_device(routing_map, saved_scores, grad_probs) and out is None
    if tuple(d_grad.shape) != shape:
        raise ValueError(f"{op}: grad_probs shape {tuple(d_grad.shape)} != saved_scores {shape}.")
    d_map, fmt = map_input(routing_map, "routing_map", op, s, shape)
    plan = topk_with_score_function_bwd_plan(spec_of(shape, kind), int(topk), bool(use_pre_softmax),
                                             np.float32(scaling_factor), score_fn, fmt, path, tiling)
    return execute(plan, [d_map, d_saved, d_grad], out, s, to_host)[0]



@functools.cache
def topk_with_score_function_bwd_plan(grad_probs: Spec, topk: int, pre_softmax: bool, scale: np.float32,
                                      score_fn: int, map_format: int = 0, path: str = "auto",
                                      tiling: TopkTiling | None = None) -> Plan:
    """The launches of the backward (inputs: map, saved, grad_probs; output:
    grad_logits).  The map's Spec: ``bool [T, E]`` (``map_format`` 0) or
    ``uint8 [T, ceil(E/8)]`` (1, BITMAP_U8).  ``path``, ``tiling``: the launcher's."""
    bwd = (tiling or TOPK_TILING).bwd
    fmt = map_format_code(map_format, OP + "_bwd_plan", "map_format")
    bitmap = fmt == BITMAP_U8
    shape = grad_probs.shape
    ins = (map_spec(shape[0], shape[1], fmt), spec_of(shape, F32), grad_probs)
    outs = (grad_probs,)
    warp = use_warp_bwd(path, OP + "_bwd", shape[1], int(score_fn), bool(pre_softmax))
    if shape[0] == 0:
        return Plan(OP + "_bwd", ins, outs)
    if warp:
        words, quads, flat = array_views(grad_probs.kind, shape)
        step = Step(warp_topk_bwd_kernel(grad_probs.kind, shape[1], int(score_fn), bitmap),
                    *warp_bwd_launch(shape[0], bwd), 0,
                    (In(0, map_view(ins[0], quads)), In(1, flat), In(2, words), Out(0, words),
                     shape[0], int(topk), np.float32(scale)))
        return Plan(OP + "_bwd", ins, outs, (), (step,))
    if shape[1] % 4 == 0:
        dense = bool(pre_softmax) and score_fn == SOFTMAX
        grid, threads, lanes = quad_tiling(shape[0], shape[1], dense, bwd)
        words, quads, flat = array_views(grad_probs.kind, shape)
        listed = bwd.quad_list if score_fn == SQRTSOFTPLUS else 0  # quad_bwd_kernel's docstring
        step = Step(quad_bwd_kernel(grad_probs.kind, grad_probs.kind, True, int(score_fn), dense, 0, bitmap,
                                    listed),
                      grid, threads, (8 + 8 * listed) * threads,
                      (In(0, map_view(ins[0], quads)), In(1, flat), In(2, words), Out(0, words),
                       shape[0], shape[1], int(topk), np.float32(scale), lanes))
        return Plan(OP + "_bwd", ins, outs, (), (step,))
    grid, threads, lanes = stream_tiling(shape[0], shape[1], bwd)
    step = Step(stream_bwd_kernel(grad_probs.kind, grad_probs.kind, True, bitmap), grid, threads, 8 * threads,
                  (In(0), In(1), In(2), Out(0), int(topk), int(score_fn), bool(pre_softmax),
                   np.float32(scale), lanes))
    return Plan(OP + "_bwd", ins, outs, (), (step,))
