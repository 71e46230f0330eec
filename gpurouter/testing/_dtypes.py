"""The dtypes and score functions the strategies and checks draw, and NumPy <-> jax casts."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

DTYPES = ("float32", "bfloat16", "float16")
SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")


def np_dtype(name: str):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name).type


def as_jnp(x: np.ndarray, dtype: str):
    """A NumPy float array as a jax array of ``dtype`` (values assumed representable)."""
    return jnp.asarray(np.asarray(x, np.float32).astype(np_dtype(dtype)))
