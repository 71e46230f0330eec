"""One router configuration: :class:`RouterConfig`.

A ``RouterConfig`` holds the static keyword arguments of
``fused_topk_with_score_function`` in TransformerEngine's names, with the
batch a demo, benchmark or test routes (``num_tokens``, ``dtype``) and the
aux-loss coefficient a training step uses. The same class serves three
users:

- the model presets (``gpurouter.presets.PRESETS``): a ``RouterConfig`` with
  a ``name`` and the public ``source`` it comes from;
- the hypothesis strategies (``gpurouter.testing.strategies.router_configs``),
  which draw ``RouterConfig`` values;
- the library itself: :meth:`RouterConfig.check` runs the top-k's validator
  (``gpurouter._checks.check_topk_args``, the one place the constraints are
  written) and returns its checked, per-call form (a ``TopkConfig``: the
  score function as an enum, plus the call's ``compute_aux_scores`` and
  routing-map format), the hashable key the kernels are cached by.

``expert_bias`` is a flag here (does the router have a bias?); the bias
values are an array argument of the op.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ._checks import check_topk_args
from ._checks.topk import TopkConfig


def _dtype_of(name: str):
    if name == "bfloat16":
        import ml_dtypes  # a jax dependency

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """A router's static configuration (TE's keyword names) and the batch it routes.

    >>> cfg = RouterConfig(num_experts=8, topk=2, score_function="sigmoid", expert_bias=True)
    >>> cfg.router_kwargs()["topk"], cfg.shape
    (2, (1, 8))
    >>> cfg.check().grouped
    False
    """

    num_experts: int
    topk: int
    score_function: str = "softmax"
    use_pre_softmax: bool = False
    num_groups: int = -1
    group_topk: int = -1
    scaling_factor: float = 1.0
    #: whether the router adds an expert bias (sigmoid and sqrtsoftplus only)
    expert_bias: bool = False
    #: the coefficient of the switch aux loss a training step uses
    aux_loss_coeff: float = 1e-3
    #: the tokens and the logits' dtype of the batch a demo, bench or test routes
    num_tokens: int = 1
    dtype: str = "float32"
    name: str = field(default="", compare=False)
    #: the public configuration a preset comes from
    source: str = field(default="", compare=False)

    @property
    def has_bias(self) -> bool:
        """Same as ``expert_bias`` (the name the strategies used first)."""
        return self.expert_bias

    @property
    def grouped(self) -> bool:
        """Group-limited routing is on iff ``group_topk > 0`` (TE's sentinel is -1)."""
        return self.group_topk > 0

    @property
    def shape(self) -> tuple[int, int]:
        """The logits' shape ``(num_tokens, num_experts)``."""
        return (self.num_tokens, self.num_experts)

    def router_kwargs(self) -> dict:
        """Keyword arguments of ``fused_topk_with_score_function`` (all but logits and expert_bias)."""
        return dict(topk=self.topk, use_pre_softmax=self.use_pre_softmax,
                    num_groups=self.num_groups, group_topk=self.group_topk,
                    scaling_factor=self.scaling_factor, score_function=self.score_function)

    def kwargs(self) -> dict:
        """Same as :meth:`router_kwargs` (the name the conformance checks use)."""
        return self.router_kwargs()

    def bwd_kwargs(self) -> dict:
        """Keyword arguments of the reference's top-k backward."""
        return dict(topk=self.topk, use_pre_softmax=self.use_pre_softmax,
                    scaling_factor=self.scaling_factor, score_function=self.score_function)

    def check(self, *, compute_aux_scores: bool = False) -> TopkConfig:
        """Runs the library's validator on this config; returns the checked form or
        raises the error the op would raise."""
        return check_topk_args(
            self.shape, _dtype_of(self.dtype), self.topk, self.use_pre_softmax,
            self.num_groups, self.group_topk, self.scaling_factor, self.score_function,
            (self.num_experts,) if self.expert_bias else None,
            np.float32 if self.expert_bias else None, compute_aux_scores)
