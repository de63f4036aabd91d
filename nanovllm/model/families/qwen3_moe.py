"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention with routed SwiGLU experts.

Layer i is a MoE layer unless it is listed in `mlp_only_layers`, when num_experts > 0 and
(i + 1) is a multiple of `decoder_sparse_step` (transformers' rule); other layers keep a dense
MLP of `intermediate_size`. Experts load from the Hub's per-expert tensors
(`mlp.experts.<e>.{gate,up,down}_proj.weight`) or from transformers' fused 3-D ones
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`).
"""

from __future__ import annotations

from nanovllm.model.decoder import DecoderForCausalLM, DecoderOptions, common_options, reject_sliding_window
from nanovllm.model.experts import ExpertTensors, MoeOptions


def moe_layer_indices(config) -> tuple[int, ...]:
    """The layers whose MLP is the sparse MoE block, as transformers' Qwen3MoeDecoderLayer decides."""
    step = getattr(config, "decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    if config.num_experts <= 0:
        return ()
    return tuple(i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Qwen3's MoE models; the router is `mlp.gate` (no bias)."""

    # "<layer>.mlp.experts.<e>.gate_proj.weight" -> ("<layer>.mlp.experts.w13", (e, 0)), ...
    expert_tensors = ExpertTensors({"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)},
                                   {"gate_up_proj": "w13", "down_proj": "w2"})

    @classmethod
    def options_from_config(cls, config) -> DecoderOptions:
        reject_sliding_window(config)
        bias = bool(getattr(config, "attention_bias", False))
        layers = moe_layer_indices(config)
        moe = MoeOptions(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                         intermediate_size=config.moe_intermediate_size,
                         norm_topk_prob=bool(config.norm_topk_prob)) if layers else None
        return common_options(config, qk_norm=True, qkv_bias=bias, o_bias=bias, moe=moe, moe_layers=layers)
