"""A mixture-of-experts model's routed experts: their options (MoeOptions, in DecoderOptions.moe)
and how a checkpoint's expert tensors map onto the stacked expert parameters (`<layer>.mlp.experts.w13`,
`w2`: loader.py asks a model's `expert_tensors`). Only the MoE families import this module.

The Hub stores one tensor per expert and projection, transformers' in-memory (and, in some
versions, saved) form stacks all experts of a projection in one 3-D tensor. Beside or instead of
`weight`, FP8 checkpoints have `weight_scale_inv` (fused: `<part>_scale_inv`), INT4 ones
`qweight`, `scales`, ...: they load into the stacked parameter's siblings (`w13_qweight`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch import nn

_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<part>\w+)\.(?P<kind>\w+)$")
_FUSED_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<part>\w+?)(?P<kind>_scale_inv)?$")
_SCALE = "_scale_inv"
_KIND_SUFFIX = {"weight": "", "weight" + _SCALE: _SCALE}  # a per-expert tensor's kind -> the parameter's suffix
_SUFFIX_KIND = {v: k for k, v in _KIND_SUFFIX.items()}


@dataclass(frozen=True)
class MoeOptions:
    """Routed experts of the MoE layers: `num_experts` SwiGLU experts of `intermediate_size`
    (moe_intermediate_size), `top_k` of them per token (num_experts_per_tok), their softmax
    weights renormalised to sum to 1 when `norm_topk_prob`."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]")


class SparseMlpFactory(Protocol):
    """Builds the MLP of a mixture-of-experts layer (features/moe.py's SparseMoeBlock.from_options):
    a module [T, H] -> this rank's partial sum [T, H], like decoder.py's DenseMLP."""

    def __call__(self, hidden_size: int, moe: MoeOptions) -> nn.Module: ...


class ExpertTensors:
    """`experts` maps a per-expert part to (parameter part, shard): "gate_proj" -> ("w13", 0)
    loads "<p>.experts.<e>.gate_proj.weight" into "<p>.experts.w13" with shard (e, 0) (and
    ".weight_scale_inv" into "<p>.experts.w13_scale_inv"). `fused` maps a stacked part to a
    parameter part: "gate_up_proj" -> "w13" loads "<p>.experts.gate_up_proj" with shard "fused"
    (and "gate_up_proj_scale_inv" into "w13_scale_inv")."""

    def __init__(self, experts: dict, fused: dict):
        self.experts, self.fused = experts, fused

    def resolve(self, params: dict, name: str):
        """(parameter name, parameter, shard id) of an expert tensor, or None for other tensors."""
        m = _EXPERT_TENSOR.match(name)
        if m and m["part"] in self.experts:
            part, shard = self.experts[m["part"]]
            pname = f"{m['prefix']}.{part}" + _KIND_SUFFIX.get(m["kind"], f"_{m['kind']}")
            if pname in params:
                return pname, params[pname], (int(m["expert"]), shard)
        m = _FUSED_EXPERT_TENSOR.match(name)
        if m and m["part"] in self.fused:
            pname = f"{m['prefix']}.{self.fused[m['part']]}" + (m["kind"] or "")
            if pname in params:
                return pname, params[pname], "fused"
        return None

    def names(self, pname: str, param) -> set[str] | None:
        """The per-expert checkpoint names behind an expert parameter ("<p>.experts.w13", its block
        scales "<p>.experts.w13_scale_inv", an INT4 tensor "<p>.experts.w13_qweight"), else None."""
        prefix, _, name = pname.rpartition(".")
        if not prefix.endswith(".experts"):
            return None
        for ours in dict.fromkeys(ours for ours, _ in self.experts.values()):
            suffix = name[len(ours):] if name.startswith(ours) else "?"  # "", "_scale_inv", "_qweight", ...
            kind = _SUFFIX_KIND.get(suffix, suffix[1:] if suffix[:1] == "_" else None)
            if kind is not None:
                parts = [ckpt for ckpt, (p, _) in self.experts.items() if p == ours]
                return {f"{prefix}.{e}.{ckpt}.{kind}" for e in range(param.shape[0]) for ckpt in parts}
        return None
