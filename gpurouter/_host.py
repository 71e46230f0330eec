"""Host-side float32 arithmetic shared by the reference and the kernels (NumPy only)."""

from __future__ import annotations

import numpy as np


def aux_loss_coeff(num_experts, coeff, topk, total_num_tokens) -> np.float32:
    """``C = num_experts * coeff / (topk * T * T)`` in float32, divided in TE's order.

    ``f32(E) * f32(coeff) / f32(K) / f32(T) / f32(T)``, each step rounded to
    float32 on the host (correctly rounded, so the reference and the kernels
    agree bit for bit; XLA:GPU's float32 division may differ by an ulp).
    """
    f = np.float32
    t = f(total_num_tokens)
    return f(f(f(f(f(num_experts) * f(coeff)) / f(topk)) / t) / t)
