"""EAGLE-3 heads for the tests: tiny random heads written as the published formats store them,
and a plain-torch forward written from the formats' description (independent of the engine's
layers, paged attention and kernels: full causal attention recomputed over every position)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch
from safetensors.torch import save_file


@dataclass(frozen=True)
class HeadShape:
    hidden: int = 32
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    intermediate: int = 48
    vocab: int = 64  # the target's
    draft_vocab: int = 24
    target_hidden: int = 32


def write_head(path, fmt: str, seed: int, shape: HeadShape = HeadShape(), aux_ids=None, embed: bool = None) -> dict:
    """A random head in `fmt` ("speculators" or "sglang": `midlayer.`, no embedding unless
    `embed`) in the folder `path`; its tensors. `aux_ids`: the config's
    eagle_aux_hidden_state_layer_ids (in the format's own convention), or None."""
    s, g = shape, torch.Generator().manual_seed(seed)

    def r(*size):
        return torch.randn(*size, generator=g) * 0.2

    h = s.hidden
    w = {"self_attn.q_proj.weight": r(s.heads * s.head_dim, 2 * h), "self_attn.k_proj.weight": r(s.kv_heads * s.head_dim, 2 * h),
         "self_attn.v_proj.weight": r(s.kv_heads * s.head_dim, 2 * h), "self_attn.o_proj.weight": r(h, s.heads * s.head_dim),
         "mlp.gate_proj.weight": r(s.intermediate, h), "mlp.up_proj.weight": r(s.intermediate, h),
         "mlp.down_proj.weight": r(h, s.intermediate)}
    w |= {f"{n}.weight": 1 + r(h) for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
    prefix = "layers.0." if fmt == "speculators" else "midlayer."
    tensors = {prefix + k: v for k, v in w.items()}
    tensors |= {"fc.weight": r(h, 3 * s.target_hidden), "norm.weight": 1 + r(h), "lm_head.weight": r(s.draft_vocab, h),
                "d2t": torch.randint(0, s.vocab - s.draft_vocab + 1, (s.draft_vocab,), generator=g),
                "t2d": torch.zeros(s.vocab, dtype=torch.bool)}
    if embed if embed is not None else fmt == "speculators":
        tensors["embed_tokens.weight"] = r(s.vocab, h)
    llama = {"vocab_size": s.vocab, "hidden_size": h, "intermediate_size": s.intermediate,
             "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim,
             "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512}
    common = {"draft_vocab_size": s.draft_vocab}
    if s.target_hidden != h:
        common["target_hidden_size"] = s.target_hidden
    if fmt == "speculators":
        config = {"speculators_model_type": "eagle3", "transformer_layer_config": llama, "norm_before_residual": True,
                  **common}
        if aux_ids is not None:
            config["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
    else:
        config = {**llama, "architectures": ["LlamaForCausalLMEagle3"], **common}
        if aux_ids is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_ids)}
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return tensors


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, head_dim: int):
    half = head_dim // 2
    inv = 1.0 / 10000.0 ** (torch.arange(half, dtype=torch.float32, device=x.device) * 2 / head_dim)
    ang = pos[:, None].float() * inv[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


def head_forward(t: dict, prefix: str, embed, ids, hidden, norm_before_residual: bool, shape: HeadShape = HeadShape()):
    """The head's output before the final norm at positions 0..n-1: token ids[t] (the token
    after position t) and hidden[t] (fc of the target's states, or a fed-back output), with
    causal attention over all of them and RoPE at those positions."""
    w = {k[len(prefix):]: v for k, v in t.items() if k.startswith(prefix)}
    s, n = shape, len(ids)
    normed = rms(hidden, w["hidden_norm.weight"])
    x = torch.cat([rms(embed[ids], w["input_layernorm.weight"]), normed], -1)
    q = (x @ w["self_attn.q_proj.weight"].T).view(n, s.heads, s.head_dim)
    k = (x @ w["self_attn.k_proj.weight"].T).view(n, s.kv_heads, s.head_dim)
    v = (x @ w["self_attn.v_proj.weight"].T).view(n, s.kv_heads, s.head_dim)
    pos = torch.arange(n, device=x.device)
    q, k = rope(q, pos, s.head_dim), rope(k, pos, s.head_dim)
    k, v = k.repeat_interleave(s.heads // s.kv_heads, 1), v.repeat_interleave(s.heads // s.kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(s.head_dim)
    scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), 1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, s.heads * s.head_dim)
    out = (normed if norm_before_residual else hidden) + attn @ w["self_attn.o_proj.weight"].T
    mlp_in = rms(out, w["post_attention_layernorm.weight"])
    gate, up = mlp_in @ w["mlp.gate_proj.weight"].T, mlp_in @ w["mlp.up_proj.weight"].T
    return out + (torch.nn.functional.silu(gate) * up) @ w["mlp.down_proj.weight"].T


def draft_ids(t: dict, out):
    """The greedy draft after each row of `out`, as a target id (d2t)."""
    draft = (rms(out, t["norm.weight"]) @ t["lm_head.weight"].T).argmax(-1)
    return draft + t["d2t"][draft]


def reference_drafts(t: dict, prefix: str, embed, tokens: list[int], aux, k: int, norm_before_residual: bool,
                     shape: HeadShape = HeadShape()) -> list[int]:
    """EAGLE-3's k drafts after `tokens` from the target's states `aux` [len(tokens), 3 x target
    hidden]: position t < len - 1 reads token t + 1 and fc(aux[t]); each draft j then sits at the
    next position, reading draft j and the head's previous output; recomputed from scratch each time."""
    ids = list(tokens[1:])
    hidden = aux[:len(tokens) - 1] @ t["fc.weight"].T
    drafts = []
    for _ in range(k):
        out = head_forward(t, prefix, embed, torch.tensor(ids, device=aux.device), hidden, norm_before_residual, shape)
        drafts.append(int(draft_ids(t, out[-1:])[0]))
        ids.append(drafts[-1])
        hidden = torch.cat([hidden, out[-1:]])
    return drafts
