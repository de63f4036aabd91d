"""EAGLE-3 draft heads as published (the `speculators` format and SGLang's / the EAGLE repo's):
their config, their weights, and their forward, on the model/ layers (paged attention).

A head is one Llama-style decoder layer over 2 x hidden inputs. At position t it takes the
embedding of token t + 1 and, for its first draft step, `fc` of the target's residual stream at
three layers for position t (the inputs of layers 2, L / 2 and L - 3 by default, concatenated
in that order); later steps feed back its own output before the final norm. Its logits cover a
draft vocabulary; `d2t` maps a draft id to the target's (target = draft + d2t[draft]).
eagle3.py runs it as a Proposer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.model.attention import AttentionMetadata
from nanovllm.model.decoder import DecoderAttention, DecoderOptions, DenseMLP
from nanovllm.model.layers.embed_head import VocabParallelEmbedding
from nanovllm.model.layers.layernorm import RMSNorm
from nanovllm.model.layers.linear import ReplicatedLinear, RowParallelLinear
from nanovllm.model.layers.rotary_embedding import RotaryEmbedding


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose inputs EAGLE-3 reads by default (vLLM's and the EAGLE repo's)."""
    return 2, num_layers // 2, num_layers - 3


@dataclass(frozen=True)
class Eagle3Config:
    """What a head checkpoint says: its layer's shapes (`layer`: DecoderOptions), the draft
    vocabulary, the target's hidden size, whether the residual is taken after hidden_norm, and
    the target layers it reads (inputs-of-layer ids; None: default_aux_layers)."""

    layer: DecoderOptions
    draft_vocab_size: int
    target_hidden_size: int
    norm_before_residual: bool
    aux_layers: tuple[int, ...] | None

    @classmethod
    def from_folder(cls, path: str) -> "Eagle3Config":
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        speculators = "transformer_layer_config" in raw
        layer = raw["transformer_layer_config"] if speculators else raw
        if layer.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"{layer['num_hidden_layers']} layers: an EAGLE-3 head has one")
        head_dim = layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"]
        opts = DecoderOptions(
            vocab_size=layer["vocab_size"], hidden_size=layer["hidden_size"], num_layers=1,
            num_heads=layer["num_attention_heads"], num_kv_heads=layer["num_key_value_heads"], head_dim=head_dim,
            intermediate_size=layer["intermediate_size"], rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
            rope_theta=float(layer.get("rope_theta", 10000.0)),
            max_position_embeddings=layer.get("max_position_embeddings", 2048))
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or raw.get("eagle_config", {}).get(
            "eagle_aux_hidden_state_layer_ids")
        if ids is not None and not speculators:
            ids = [i + 1 for i in ids]  # SGLang / EAGLE configs name the layer whose *output* is read
        return cls(opts, raw.get("draft_vocab_size") or opts.vocab_size,
                   raw.get("target_hidden_size") or opts.hidden_size,
                   # vLLM reads a speculators config without the key as True, the plain formats as False
                   bool(raw.get("norm_before_residual", speculators)), tuple(ids) if ids else None)


class Eagle3Head(nn.Module):
    """The head (see the module docstring); parameter names are the speculators format's."""

    def __init__(self, config: Eagle3Config, max_positions: int):
        super().__init__()
        o, h = config.layer, config.layer.hidden_size
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(o.vocab_size, h)
        self.fc = ReplicatedLinear(3 * config.target_hidden_size, h, bias=False)
        rotary = RotaryEmbedding(o.head_dim, max_positions, o.rope_theta)
        attn = DecoderAttention(replace(o, hidden_size=2 * h), rotary)  # q/k/v read [embedding, hidden]
        attn.o_proj = RowParallelLinear(o.num_heads * o.head_dim, h, bias=False, reduce_results=False)
        self.layers = nn.ModuleList([_Eagle3Layer(o, attn)])
        self.norm = RMSNorm(h, eps=o.rms_norm_eps)
        self.lm_head = ReplicatedLinear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))

    def forward(self, token_ids, positions, hidden, meta: AttentionMetadata) -> torch.Tensor:
        """The layer's output before the final norm [T, H] for the tokens `token_ids` (token
        t + 1 at position t) and `hidden`: the target's three hidden states [T, 3 x target
        hidden] (first step) or the head's previous output [T, H]."""
        if hidden.shape[-1] != self.config.layer.hidden_size:
            hidden = self.fc(hidden)
        return self.layers[0](positions, self.embed_tokens(token_ids), hidden, meta)

    def draft_tokens(self, out: torch.Tensor) -> torch.Tensor:
        """The greedy draft (a target token id) after each row of the forward's output."""
        draft = self.lm_head(self.norm(out)).argmax(dim=-1)
        return draft + self.d2t[draft]


class _Eagle3Layer(nn.Module):
    def __init__(self, o: DecoderOptions, attn: DecoderAttention):
        super().__init__()
        self.self_attn = attn
        self.mlp = DenseMLP(o.hidden_size, o.intermediate_size)
        self.input_layernorm = RMSNorm(o.hidden_size, eps=o.rms_norm_eps)
        self.hidden_norm = RMSNorm(o.hidden_size, eps=o.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(o.hidden_size, eps=o.rms_norm_eps)
        self.norm_before_residual = False

    def forward(self, positions, embeds, hidden, meta):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x = residual + self.self_attn(positions, x, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


# Checkpoint names -> the head's: SGLang's / the EAGLE repo's `midlayer` is the speculators
# format's `layers.0`; q/k/v and gate/up load into their packed parameters.
_PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def load_head(head: Eagle3Head, path: str, target_embedding: torch.Tensor | None = None) -> None:
    """Load a head checkpoint folder into `head`. `target_embedding` (the target's, when its
    shape fits) replaces the head's embedding, as in vLLM (heads are trained on the target's,
    frozen; SGLang's and the EAGLE repo's files leave it out)."""
    params = dict(head.named_parameters())
    seen = set()
    for file in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        with safe_open(os.path.join(path, file), "pt") as f:
            for name in f.keys():
                local = name.replace("midlayer.", "layers.0.")
                if not (local == "embed_tokens.weight" and target_embedding is not None):
                    _load_tensor(head, params, local, f.get_tensor(name))
                seen.add(local)
    if target_embedding is not None:
        share_embedding(head, target_embedding)
    elif "embed_tokens.weight" not in seen:
        raise ValueError(f"{path}: the head has no embed_tokens and the target's does not fit it")
    head.layers[0].norm_before_residual = head.config.norm_before_residual


def share_embedding(head: Eagle3Head, target_embedding: torch.Tensor) -> None:
    """The head reads the target's embedding tensor itself (no copy)."""
    head.embed_tokens.weight = torch.nn.Parameter(target_embedding, requires_grad=False)


def _load_tensor(head: Eagle3Head, params: dict, name: str, tensor: torch.Tensor) -> None:
    if name == "d2t":
        head.d2t.copy_(tensor.long())
        return
    if name == "t2d":
        return  # which target ids the draft vocabulary holds: not needed to draft
    module, _, leaf = name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    if proj in _PACKED:
        packed, shard = _PACKED[proj]
        param = params[f"{parent}.{packed}.{leaf}"]
        param.weight_loader(param, tensor, name, shard)
        return
    if name not in params:
        raise ValueError(f"EAGLE-3 head tensor {name!r} does not belong to the head")
    param = params[name]
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, tensor, name)
    else:
        param.data.copy_(tensor)
