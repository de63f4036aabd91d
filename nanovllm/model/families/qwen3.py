"""Qwen3 (dense): per-head q/k RMSNorm before RoPE, GQA, SwiGLU MLP, no biases by default."""

from __future__ import annotations

from nanovllm.model.decoder import DecoderForCausalLM, DecoderOptions, common_options, reject_sliding_window

__all__ = ["Qwen3ForCausalLM"]


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3-0.6B ... Qwen3-32B (`attention_bias`, set by no released checkpoint: q/k/v and o_proj biases)."""

    @classmethod
    def options_from_config(cls, config) -> DecoderOptions:
        reject_sliding_window(config)
        bias = bool(getattr(config, "attention_bias", False))
        return common_options(config, qk_norm=True, qkv_bias=bias, o_bias=bias)
