"""Hypothesis strategies of VALID loss inputs: the aux loss (configs and inputs) and the router z-loss.

Re-exported by :mod:`gpurouter.testing.strategies`; the aux-loss constraints live once,
in :func:`gpurouter._checks.check_aux_loss_args`, which every drawn config runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
import numpy as np
from hypothesis.extra import numpy as hnp

from gpurouter._checks import check_aux_loss_args

from ._dtypes import DTYPES, np_dtype

# ----------------------------------------------------------------------------
# Aux loss
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class AuxLossConfig:
    num_tokens: int
    num_experts: int
    seq_blocks: int  # C = seq_blocks * num_experts
    topk: int
    coeff: float
    total_num_tokens: int | None
    pass_num_experts: bool
    dtype: str
    tpe_dtype: str

    @property
    def num_cols(self) -> int:
        return self.seq_blocks * self.num_experts

    def kwargs(self) -> dict:
        return dict(topk=self.topk, coeff=self.coeff, total_num_tokens=self.total_num_tokens,
                    num_experts=self.num_experts if self.pass_num_experts else None)

    def check(self):
        return check_aux_loss_args(
            (self.num_tokens, self.num_cols), np_dtype(self.dtype), (self.num_cols,),
            np_dtype(self.tpe_dtype), self.topk, self.coeff, self.total_num_tokens,
            self.num_experts if self.pass_num_experts else None)


@st.composite
def aux_loss_configs(draw, *, tpe_dtypes=("int32", "float32", "bfloat16")) -> AuxLossConfig:
    """Valid aux-loss configs: T 1..8, E 1..16, C = B*E (B 1..3 only with num_experts)."""
    num_tokens = draw(st.integers(1, 8))
    num_experts = draw(st.integers(1, 16))
    pass_num_experts = draw(st.booleans())
    seq_blocks = draw(st.integers(1, 3)) if pass_num_experts else 1
    cfg = AuxLossConfig(
        num_tokens=num_tokens, num_experts=num_experts, seq_blocks=seq_blocks,
        topk=draw(st.integers(1, num_experts)),
        coeff=draw(st.sampled_from([1e-2, 1.0, 0.5])),
        total_num_tokens=draw(st.one_of(st.none(), st.integers(1, 64))),
        pass_num_experts=pass_num_experts,
        dtype=draw(st.sampled_from(DTYPES)), tpe_dtype=draw(st.sampled_from(tpe_dtypes)))
    cfg.check()
    return cfg


@st.composite
def aux_loss_inputs(draw, cfg: AuxLossConfig):
    """``(probs [T, C] float32 exact in cfg.dtype, tokens_per_expert [C] float32 counts)``."""
    probs = draw(hnp.arrays(np.float32, (cfg.num_tokens, cfg.num_cols),
                            elements=st.floats(0, 1, width=16, allow_subnormal=False)))
    probs = probs.astype(np_dtype(cfg.dtype)).astype(np.float32)
    tpe = draw(hnp.arrays(np.int32, (cfg.num_cols,), elements=st.integers(0, 64)))
    return probs, tpe.astype(np.float32)


@st.composite
def z_loss_logits(draw, *, max_tokens: int = 6, max_experts: int = 32, dtypes=DTYPES):
    """``(logits [T, E] float32, dtype name, coeff)`` for the router z-loss.

    Invariants: T in 1..max_tokens, E in 1..max_experts; values are float32
    in [-20, 20] exactly representable in the drawn dtype, with ``-inf`` masks
    (never NaN) and, whenever T > 1, one row of all ``-inf`` (it contributes 0
    and gets no gradient); coeff in {1e-3, 0.1, 1.0}.
    """
    num_tokens = draw(st.integers(1, max_tokens))
    num_experts = draw(st.integers(1, max_experts))
    dtype = draw(st.sampled_from(dtypes))
    elements = st.one_of(st.floats(-20, 20, width=32, allow_nan=False, allow_subnormal=False),
                         st.just(-np.inf))
    x = draw(hnp.arrays(np.float32, (num_tokens, num_experts), elements=elements))
    if num_tokens > 1:
        x[draw(st.integers(0, num_tokens - 1))] = -np.inf
    x = x.astype(np_dtype(dtype)).astype(np.float32)
    return x, dtype, draw(st.sampled_from([1e-3, 0.1, 1.0]))
