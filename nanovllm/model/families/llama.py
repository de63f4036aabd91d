"""Llama 3.x: optional biases (`attention_bias` on q/k/v/o, `mlp_bias` on gate/up/down), Llama 3
rope scaling (3.1, 3.2), tied embeddings (3.2 1B / 3B), explicit `head_dim`."""

from __future__ import annotations

from nanovllm.model.decoder import DecoderForCausalLM, DecoderOptions, common_options


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama 3, 3.1, 3.2 and 3.3 text models; RoPE plain or of rope_type "llama3"."""

    @classmethod
    def options_from_config(cls, config) -> DecoderOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return common_options(config, qkv_bias=attention_bias, o_bias=attention_bias,
                              mlp_bias=bool(getattr(config, "mlp_bias", False)))
