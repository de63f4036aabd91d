"""The decoder every supported family shares (a family, families/*.py, maps its config.json onto
`DecoderOptions`): embed -> [norm -> attention -> norm -> MLP | MoE] x L -> norm -> lm_head.
Under tensor parallelism o_proj, down_proj and the experts return this rank's partial sum, which
the next RMSNorm sums over the ranks with the residual add."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from nanovllm.model.attention import Attention, AttentionMetadata
from nanovllm.model.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.model.layers.layernorm import RMSNorm
from nanovllm.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.model.layers.rotary_embedding import RotaryEmbedding
from nanovllm.parallel.group import current_tp_group

if TYPE_CHECKING:
    from types import ModuleType

    from nanovllm.model.experts import MoeOptions, SparseMlpFactory
    from nanovllm.model.forward_chain import ForwardChain
    from nanovllm.model.rope_scaling import Llama3RopeScaling

# Filled by nanovllm/wiring/ at import; each loads its module at first use.
LLAMA3_ROPE_SCALING: Callable[[], type[Llama3RopeScaling]] | None = None  # model/rope_scaling.py
FUSED_QK_NORM_ROPE: Callable[[], ModuleType] | None = None  # the fused q/k norm + RoPE kernel's path
NORM_CHAIN: Callable[[], ModuleType] | None = None  # batch 1: norms folded into its GEMVs (norm_chain.py)


@dataclass(frozen=True)
class DecoderOptions:
    """What differs between the supported families, read from config.json once. `moe_layers`: the
    layers whose MLP is the MoE block (then `moe` is set). `qk_norm`: per-head q/k RMSNorm (Qwen3)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: Llama3RopeScaling | None = None
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    moe: MoeOptions | None = None
    moe_layers: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"config.json: num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"config.json: head_dim={self.head_dim} must be even (rotary embedding)")
        if bool(self.moe_layers) and self.moe is None:
            raise ValueError("moe_layers given without MoE options")
        if any(not 0 <= i < self.num_layers for i in self.moe_layers):
            raise ValueError(f"moe_layers {self.moe_layers} outside 0..{self.num_layers - 1}")
        if len(self.moe_layers) < self.num_layers and self.intermediate_size < 1:
            raise ValueError(f"config.json: intermediate_size must be >= 1 for the dense MLP layers, "
                             f"got {self.intermediate_size}")


def head_dim_of(config) -> int:
    """head_dim when config.json names it (Qwen3: not always hidden_size / num_heads), else that quotient."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


ROPE_TYPES = ("default", "llama3")


def rope_of(config) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, scaling) from a transformers 5.x (`rope_parameters`) or 4.x (`rope_theta` +
    `rope_scaling`) config; other rope types and partial rotary embeddings are a ValueError."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r} in config.json; supported: {', '.join(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only full rotary embeddings)")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("config.json has no rope_theta")
    scaling = LLAMA3_ROPE_SCALING().from_params(params) if rope_type == "llama3" else None
    return float(theta), scaling


def common_options(config, **choices) -> DecoderOptions:
    """The fields every family reads the same way, plus the family's `choices` (DecoderOptions fields)."""
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r} (SwiGLU with silu only)")
    theta, scaling = rope_of(config)
    fields = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim_of(config), intermediate_size=getattr(config, "intermediate_size", 0) or 0,
        rms_norm_eps=float(config.rms_norm_eps), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)))
    fields.update(choices)
    return DecoderOptions(**fields)


def reject_sliding_window(config) -> None:
    """Sliding-window attention is not implemented: refuse configs that switch it on."""
    layer_types = getattr(config, "layer_types", None) or ()
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in layer_types:
        raise ValueError(f"sliding-window attention is not supported (use_sliding_window=true, "
                         f"sliding_window={getattr(config, 'sliding_window', None)}, "
                         f"max_window_layers={getattr(config, 'max_window_layers', None)})")


# ----------------------------------------------------------------------------- layers


class DecoderAttention(nn.Module):
    """Packed qkv projection, optional per-head q/k RMSNorm, RoPE, paged attention, o_proj."""

    def __init__(self, opts: DecoderOptions, rotary_emb: RotaryEmbedding):
        super().__init__()
        tp = current_tp_group().size
        self.head_dim = opts.head_dim
        self.num_heads = opts.num_heads // tp
        self.num_kv_heads = opts.num_kv_heads // tp
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(opts.hidden_size, self.head_dim, opts.num_heads, opts.num_kv_heads,
                                          bias=opts.qkv_bias)
        # Its partial sums are all-reduced by the post-attention norm (fused there).
        self.o_proj = RowParallelLinear(opts.num_heads * self.head_dim, opts.hidden_size, bias=opts.o_bias,
                                        reduce_results=False)
        self.rotary_emb = rotary_emb  # one cos/sin table shared by all layers
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads)
        self.q_norm = RMSNorm(self.head_dim, eps=opts.rms_norm_eps) if opts.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=opts.rms_norm_eps) if opts.qk_norm else None
        # The fused kernel (fused_qk_norm_rope.py) handles power-of-two head sizes; it runs on CUDA
        # tensors (use_kernels None; tests set True to run it in Triton's interpreter).
        self.fused_rope = self.head_dim & (self.head_dim - 1) == 0
        self.use_kernels: bool | None = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(hidden), meta))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The attention output [tokens, heads x head_dim] from the packed qkv projection (o_proj's input)."""
        stored = False
        if self.fused_rope and (qkv.is_cuda if self.use_kernels is None else self.use_kernels):
            q, k, v, stored = FUSED_QK_NORM_ROPE().qkv_heads(self, qkv, positions, meta)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(-1, self.num_heads, self.head_dim)
            k = k.reshape(-1, self.num_kv_heads, self.head_dim)
            v = v.reshape(-1, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
        return self.attn(q, k, v, meta, kv_stored=stored).reshape(-1, self.q_size)


class DenseMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up packed in one GEMM."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_mul(x))


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual add (and the TP all-reduce) is fused into the next norm."""

    def __init__(self, opts: DecoderOptions, layer: int, rotary_emb: RotaryEmbedding,
                 sparse_mlp: SparseMlpFactory | None = None):
        super().__init__()
        self.self_attn = DecoderAttention(opts, rotary_emb)
        if layer in opts.moe_layers:
            if sparse_mlp is None:
                raise ValueError("this model has mixture-of-experts layers: build it with sparse_mlp= "
                                 "(features/moe.py's SparseMoeBlock.from_options)")
            self.mlp = sparse_mlp(opts.hidden_size, opts.moe)
        else:
            self.mlp = DenseMLP(opts.hidden_size, opts.intermediate_size, bias=opts.mlp_bias)
        self.input_layernorm = RMSNorm(opts.hidden_size, eps=opts.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(opts.hidden_size, eps=opts.rms_norm_eps)

    def forward(self, positions, hidden, residual, meta):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, all_reduce=True)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual, all_reduce=True)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers and the final norm: token ids -> hidden states."""

    def __init__(self, opts: DecoderOptions, max_positions: int | None = None,
                 sparse_mlp: SparseMlpFactory | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(opts.vocab_size, opts.hidden_size)
        rotary = RotaryEmbedding(opts.head_dim, max_positions or opts.max_position_embeddings, opts.rope_theta,
                                 opts.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(opts, i, rotary, sparse_mlp) for i in range(opts.num_layers))
        self.norm = RMSNorm(opts.hidden_size, eps=opts.rms_norm_eps)
        self.use_kernels: bool | None = None  # the forward chains: CUDA (tests: True, the interpreter)
        self.chains: list[ForwardChain] = []  # features' (model/forward_chain.py), after NORM_CHAIN's

    def forward(self, input_ids, positions, meta):
        hidden = self.embed_tokens(input_ids)
        if hidden.is_cuda if self.use_kernels is None else self.use_kernels:
            for chain in (NORM_CHAIN(), *self.chains):
                if (ops := chain.operands(self, hidden, meta)) is not None:
                    return chain.forward(self, ops, hidden, positions, meta)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual, all_reduce=True)
        return hidden


class DecoderForCausalLM(nn.Module):
    """A decoder with its LM head; parameter names match Hugging Face checkpoints after packing. A
    family implements `options_from_config`, which refuses an unsupported config (ValueError)."""

    # Checkpoint tensor name part -> (packed parameter name part, shard id); see loader.py.
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    expert_tensors = None  # MoE families: their ExpertTensors (model/experts.py)

    @classmethod
    def options_from_config(cls, config) -> DecoderOptions:
        raise NotImplementedError

    def __init__(self, config, max_positions: int | None = None, sparse_mlp: SparseMlpFactory | None = None):
        """`max_positions` bounds the RoPE table (max_model_len); `sparse_mlp` builds the MoE layers' MLP."""
        super().__init__()
        self.options = self.options_from_config(config)
        self.model = DecoderModel(self.options, max_positions, sparse_mlp)
        self.lm_head = ParallelLMHead(self.options.vocab_size, self.options.hidden_size)
        self.tie_word_embeddings = self.options.tie_word_embeddings
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [tokens, hidden] for packed `input_ids` at `positions`."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [rows, vocab] in the model dtype (rank 0; None on other ranks)."""
        return self.lm_head(hidden)
