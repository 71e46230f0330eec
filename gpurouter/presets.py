"""Router configurations of real MoE models, each a :class:`~gpurouter.config.RouterConfig`
with a ``name`` and the public ``source`` (a launch script or model config) it comes from.

One table, used by ``python -m gpurouter`` (demo, bench, coldstart) and by the
tests. The demo and the benchmark pick their own token counts.
"""

from __future__ import annotations

from .config import RouterConfig

#: a preset is a named ``RouterConfig`` (kept as a name for older imports)
Preset = RouterConfig

PRESETS: dict[str, RouterConfig] = {
    p.name: p
    for p in [
        RouterConfig(name="deepseek-v3", num_experts=256, topk=8, score_function="sigmoid",
                     num_groups=8, group_topk=4, scaling_factor=2.5, expert_bias=True,
                     aux_loss_coeff=1e-4, source="Megatron-LM DeepSeek-R1.sh; DeepSeek-V3 inference/model.py"),
        RouterConfig(name="deepseek-v4", num_experts=256, topk=6, score_function="sqrtsoftplus",
                     scaling_factor=1.5, expert_bias=True,
                     source="transformers configuration_deepseek_v4.py (Flash default)"),
        RouterConfig(name="qwen3", num_experts=128, topk=8, score_function="softmax",
                     source="Megatron-LM Qwen3-*.sh (post-softmax = softmax, top-k, renormalise)"),
        RouterConfig(name="mixtral", num_experts=8, topk=2, score_function="softmax",
                     aux_loss_coeff=1e-2, source="Megatron-LM train_mixtral_8x7b_distributed.sh"),
        RouterConfig(name="llama-4", num_experts=128, topk=1, score_function="sigmoid",
                     source="Megatron-LM Llama-4-Maverick.sh (K=1: no normalisation)"),
        RouterConfig(name="kimi-k2", num_experts=384, topk=8, score_function="sigmoid",
                     scaling_factor=2.827, expert_bias=True, source="Megatron-LM Kimi-K2-Instruct.sh"),
        RouterConfig(name="nemotron-3-super", num_experts=512, topk=22, score_function="sigmoid",
                     scaling_factor=5.0, expert_bias=True,
                     source="Megatron-LM NVIDIA-Nemotron-3-Super-120B-A12B-BF16.sh"),
    ]
}

# The presets the demo routes: every one ("make demo routes every model preset").
DEMO_PRESETS = tuple(PRESETS)
