"""Qwen3 (dense) built from tensor-parallel layers: q/k RMSNorm, GQA, NeoX RoPE, SwiGLU MLP."""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.utils.context import AttentionMetadata
from nanovllm.distributed.group import current_tp_group


def head_dim_of(config) -> int:
    """Qwen3 configs name head_dim explicitly (it is not always hidden_size / num_heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r} (only plain RoPE is implemented)")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("config.json has no rope_theta")
    return float(theta)


class Qwen3Attention(nn.Module):
    """Packed qkv projection, per-head q/k RMSNorm, RoPE, paged attention, output projection."""

    def __init__(self, config, rotary_emb: RotaryEmbedding):
        super().__init__()
        tp = current_tp_group().size
        self.head_dim = head_dim_of(config)
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = config.num_key_value_heads // tp
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias)
        # Its partial sums are all-reduced by the post-attention norm (fused there).
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False,
                                        reduce_results=False)
        self.rotary_emb = rotary_emb  # one cos/sin table shared by all layers
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if qkv.is_cuda:
            from nanovllm.kernels.fused_ops import qk_norm_rope

            # One kernel for q/k RMSNorm + RoPE of every head (instead of ~15 small ones).
            q, k, v = qk_norm_rope(qkv, self.q_norm.weight, self.k_norm.weight, self.rotary_emb.cos_sin, positions,
                                   self.num_heads, self.num_kv_heads, self.head_dim, self.q_norm.eps)
            return self.o_proj(self.attn(q, k, v, meta).reshape(-1, self.q_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v, meta)
        return self.o_proj(o.reshape(-1, self.q_size))


class Qwen3MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up packed in one GEMM."""

    def __init__(self, config):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        # Its partial sums are all-reduced by the next layer's input norm (or the final norm).
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, reduce_results=False)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm block; the residual add is fused into the next norm (hence the residual pair).

    Under tensor parallelism `hidden` leaves the block as this rank's partial sum of down_proj,
    and each norm that takes a residual first sums its input over the ranks (all_reduce=True):
    two all-reduces per layer, each fused with the norm after it.
    """

    def __init__(self, config, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.self_attn = Qwen3Attention(config, rotary_emb)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden, residual, meta):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, all_reduce=True)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual, all_reduce=True)
        return self.mlp(hidden), residual


class Qwen3Model(nn.Module):
    """Embedding, decoder layers and the final norm: token ids -> hidden states."""

    def __init__(self, config, max_positions: int | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(head_dim_of(config), max_positions or config.max_position_embeddings, rope_theta(config))
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, rotary) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual, all_reduce=True)
        return hidden


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 with its LM head; parameter names match Hugging Face checkpoints (after packing)."""

    # Checkpoint tensor name part -> (packed parameter name part, shard id).
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, max_positions: int | None = None):
        """`max_positions` bounds the RoPE table (the engine passes max_model_len)."""
        super().__init__()
        self.model = Qwen3Model(config, max_positions)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [tokens, hidden] for packed `input_ids` at `positions`."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [rows, vocab] in the model dtype (rank 0; None on other ranks) for the given
        rows only. Left unconverted: the sampler reads them once and computes in fp32."""
        return self.lm_head(hidden)

    def compute_logit_shard(self, hidden: torch.Tensor) -> tuple[torch.Tensor, int]:
        """This rank's slice of the logits and its first token id (see ParallelLMHead)."""
        return self.lm_head.shard_logits(hidden)
