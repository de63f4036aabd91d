"""INT4 MoE experts (Qwen3-MoE GPTQ / AWQ / compressed-tensors checkpoints): an `ExpertsMethod`
(features/moe.py) that loads every expert's gate / up / down projection in its stored format
into per-stack tensors with a leading expert dimension, converts them to the kernels' layout
once loaded, and multiplies them with kernels/fused_moe_int4.py (plain torch on the CPU).

Checkpoint names: `<p>.experts.<e>.gate_proj.qweight` and the like (the format's tensor names
after the projection's); the loader maps them to `<p>.experts.w13_qweight` with shard (e, 0)
(up_proj: (e, 1); down_proj: `w2_qweight`, (e, 0)). Tensor parallelism splits each expert's
intermediate dimension as for the 16-bit experts: gate / up by output features, down by input
features (whole groups: Int4Config.check_model).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from nanovllm.features.moe import moe_torch
from nanovllm.features.quantization.int4_formats import dequantize
from nanovllm.features.quantization.int4_loading import CONVERTERS, fill_dummy, load_part, tensor_specs
from nanovllm.kernels.fused_moe_int4 import Int4Stack, fused_moe_int4


@dataclass
class _StackView:
    """What load_part reads of a linear layer, for one stack of experts: its features on this
    rank (int4_shape: in, out), the whole part's (int4_full_shape: out, in), the split and the
    packed parts' sizes (gate and up of w13)."""

    name: str
    int4_shape: tuple[int, int]
    int4_full_shape: tuple[int, int]
    tp_dim: int
    tp_size: int
    tp_rank: int
    sizes: tuple[int, ...] | None

    def packed_sizes(self) -> tuple[int, ...]:
        return self.sizes


def _views(experts) -> list[_StackView]:
    h, tp, rank = experts.hidden_size, experts.tp_size, experts.tp_rank
    n = experts.intermediate_size // tp
    return [_StackView("w13", (h, 2 * n), (2 * n * tp, h), 0, tp, rank, (n, n)),
            _StackView("w2", (n, h), (h, n * tp), 1, tp, rank, None)]


def _unstack(stack: Int4Stack) -> torch.Tensor:
    """A stack's weights [E, in, out] in fp32, input features in their original order."""
    w = dequantize(stack)
    if stack.perm is None:
        return w
    out = torch.empty_like(w)
    return out.scatter_(1, stack.perm.long()[:, :, None].expand_as(w), w)


def moe_int4_torch(hidden: torch.Tensor, w13: Int4Stack, w2: Int4Stack, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> torch.Tensor:
    """The INT4 experts' weighted sum in plain torch: the dequantized weights (exact, rounded to
    hidden's dtype as the kernel's are) through features/moe.py's moe_torch."""
    gate_up = _unstack(w13).transpose(1, 2).to(hidden.dtype)
    down = _unstack(w2).transpose(1, 2).to(hidden.dtype)
    return moe_torch(hidden, gate_up, down, topk_weights, topk_ids)


class Int4Experts:
    """MoeExperts whose weights load in an INT4 checkpoint's format (module docstring)."""

    def __init__(self, config):
        self.config = config

    def _specs(self, view: _StackView):
        c = self.config
        return tensor_specs(c.format, c.sym, c.desc_act, *view.int4_shape, c.group_size)

    def create(self, experts, name: str) -> None:
        """The format's tensors, stacked over the experts, in place of the 16-bit w13 / w2."""
        device, experts.int4_dtype = experts.w13.device, experts.w13.dtype
        del experts.w13, experts.w2
        for view in _views(experts):
            for spec in self._specs(view):
                param = nn.Parameter(torch.empty((experts.num_experts, *spec.shape), device=device,
                                                 dtype=spec.dtype or experts.int4_dtype), requires_grad=False)
                param.weight_loader = self._loader(experts, view, spec)
                setattr(experts, f"{view.name}_{spec.name}", param)

    @staticmethod
    def _loader(experts, view: _StackView, spec):
        slices: dict[int, SimpleNamespace] = {}  # an expert's slice, which keeps what load_part notes

        def load(param, loaded: torch.Tensor, name: str = "", shard_id=None) -> None:
            if not isinstance(shard_id, tuple):
                raise ValueError(f"{name}: INT4 experts load from per-expert tensors (<p>.experts.<e>.<proj>.*)")
            e = experts._expert_index(shard_id, name)
            part = slices.setdefault(e, SimpleNamespace(data=param.data[e]))
            load_part(view, spec, part, loaded, name, shard_id[1] if view.sizes else None)

        return load

    def init_dummy(self, experts, gen: torch.Generator) -> None:
        for view in _views(experts):
            for spec in self._specs(view):
                fill_dummy(getattr(experts, f"{view.name}_{spec.name}").data, spec.role, self.config,
                           view.int4_full_shape, gen)

    def after_loading(self, experts) -> None:
        """Each expert's tensors -> the kernels' layout, stacked again (experts.int4_w13 / _w2)."""
        for view in _views(experts):
            loaded = {}
            for spec in self._specs(view):
                loaded[spec.role] = getattr(experts, f"{view.name}_{spec.name}").data
                delattr(experts, f"{view.name}_{spec.name}")
            convert = CONVERTERS[self.config.format]
            parts = [convert({role: t[e] for role, t in loaded.items()}, self.config, experts.int4_dtype)
                     for e in range(experts.num_experts)]
            perm = None
            if any(p.perm is not None for p in parts):
                k = view.int4_shape[0]
                perm = torch.stack([p.perm if p.perm is not None else torch.arange(k, device=p.qweight.device)
                                    for p in parts]).to(torch.int32)
            setattr(experts, f"int4_{view.name}", Int4Stack(
                torch.stack([p.qweight for p in parts]), torch.stack([p.scales for p in parts]),
                torch.stack([p.zeros for p in parts]), parts[0].group_size, perm))

    def apply(self, experts, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if hidden.is_cuda and hidden.dtype != torch.float32:
            return fused_moe_int4(hidden, experts.int4_w13, experts.int4_w2, topk_weights, topk_ids)
        return moe_int4_torch(hidden, experts.int4_w13, experts.int4_w2, topk_weights, topk_ids)
