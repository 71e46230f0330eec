"""Router configurations of real MoE models (each ``source``: the public config it comes from).

One table, used by ``python -m gpurouter`` (demo and bench) and by the tests.
``num_tokens`` is the demo batch; the benchmark picks its own token counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class Preset:
    """A model's router: the keyword arguments of ``fused_topk_with_score_function``."""

    name: str
    num_experts: int
    topk: int
    score_function: str
    use_pre_softmax: bool = False
    num_groups: int = -1
    group_topk: int = -1
    scaling_factor: float = 1.0
    expert_bias: bool = False
    aux_loss_coeff: float = 1e-3
    source: str = field(default="", compare=False)

    def router_kwargs(self) -> dict:
        """Keyword arguments for ``fused_topk_with_score_function`` (bias excluded)."""
        return dict(
            topk=self.topk,
            use_pre_softmax=self.use_pre_softmax,
            num_groups=self.num_groups,
            group_topk=self.group_topk,
            scaling_factor=self.scaling_factor,
            score_function=self.score_function,
        )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(name="deepseek-v3", num_experts=256, topk=8, score_function="sigmoid",
               num_groups=8, group_topk=4, scaling_factor=2.5, expert_bias=True,
               aux_loss_coeff=1e-4, source="Megatron-LM DeepSeek-R1.sh; DeepSeek-V3 inference/model.py"),
        Preset(name="deepseek-v4", num_experts=256, topk=6, score_function="sqrtsoftplus",
               scaling_factor=1.5, expert_bias=True,
               source="transformers configuration_deepseek_v4.py (Flash default)"),
        Preset(name="qwen3", num_experts=128, topk=8, score_function="softmax",
               source="Megatron-LM Qwen3-*.sh (post-softmax = softmax, top-k, renormalise)"),
        Preset(name="mixtral", num_experts=8, topk=2, score_function="softmax",
               aux_loss_coeff=1e-2, source="Megatron-LM train_mixtral_8x7b_distributed.sh"),
        Preset(name="llama-4", num_experts=128, topk=1, score_function="sigmoid",
               source="Megatron-LM Llama-4-Maverick.sh (K=1: no normalisation)"),
        Preset(name="kimi-k2", num_experts=384, topk=8, score_function="sigmoid",
               scaling_factor=2.827, expert_bias=True, source="Megatron-LM Kimi-K2-Instruct.sh"),
        Preset(name="nemotron-3-super", num_experts=512, topk=22, score_function="sigmoid",
               scaling_factor=5.0, expert_bias=True,
               source="Megatron-LM NVIDIA-Nemotron-3-Super-120B-A12B-BF16.sh"),
    ]
}

# The presets the demo routes: every one ("make demo routes every model preset").
DEMO_PRESETS = tuple(PRESETS)
