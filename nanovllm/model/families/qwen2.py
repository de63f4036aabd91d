"""Qwen2 / Qwen2.5: biases on q/k/v (none on o_proj or the MLP), no q/k norm, tied embeddings in
the small checkpoints (0.5B-3B)."""

from __future__ import annotations

from nanovllm.model.decoder import DecoderForCausalLM, DecoderOptions, common_options, reject_sliding_window


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 and Qwen2.5 dense models. `use_sliding_window: true` is refused (not implemented;
    the released checkpoints leave it off)."""

    @classmethod
    def options_from_config(cls, config) -> DecoderOptions:
        reject_sliding_window(config)
        return common_options(config, qkv_bias=True)
