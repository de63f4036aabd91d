"""The adapter slots of one linear layer, and the batched LoRA product over them in plain torch
(every token's update from its own slot, tokens of different adapters and tokens of none in
one batch): the CPU path, and the reference of the CUDA kernels (kernels/lora.py), which read
the same `a` / `b` but gather each token's slot instead of multiplying every slot.

A layer packs P projections (q / k / v, gate / up); each slot holds, for every part p, its A
(rows p*R .. p*R + r of `a` [S * P * R, in]) and its B times the scaling (columns of `b`
[out, S * P * R], the part's output rows only: block-diagonal over the parts), zero where an
adapter has no update for a part or a slot is empty. R = max_lora_rank, S = max_loras. Then for
tokens x [T, in] with slot one-hot rows h [T, S]:

    delta = ((x @ a^T).view(T, S, P * R) * h[:, :, None]).view(T, S * P * R) @ b^T

Shapes depend on T only and nothing reads the host, so CUDA graphs can capture it. The cost is
every slot's shrink for every token: small next to the layer's own GEMM while S * P * R is a few
hundred. Tensor parallelism shards like the base layer: a column-parallel layer's B by output
rows (A whole), a row-parallel layer's A by input columns (B whole: its delta is a partial sum,
added before the all-reduce, like the layer's own).
"""

from __future__ import annotations

import torch

from nanovllm.features.lora.adapter import LoraWeights


class LoraStack:
    def __init__(self, slots: int, max_rank: int, in_features: int, part_sizes: list[int], tp_dim: int | None,
                 tp_rank: int, tp_size: int, dtype: torch.dtype, device):
        self.slots, self.rank, self.parts = slots, max_rank, list(part_sizes)
        self.tp_dim, self.tp_rank, self.tp_size = tp_dim, tp_rank, tp_size
        width = len(part_sizes) * max_rank
        self.a = torch.zeros(slots * width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(sum(part_sizes), slots * width, dtype=dtype, device=device)

    def clear(self, slot: int) -> None:
        width = len(self.parts) * self.rank
        self.a[slot * width:(slot + 1) * width].zero_()
        self.b[:, slot * width:(slot + 1) * width].zero_()

    def set(self, slot: int, parts: list[LoraWeights | None]) -> None:
        """Slot `slot` holds these updates (None: none for that part), this rank's share."""
        self.clear(slot)
        width, offset = len(self.parts) * self.rank, 0
        for p, (size, w) in enumerate(zip(self.parts, parts)):
            if w is not None:
                a, b = w.a, w.b * w.scaling
                if self.tp_dim == 1:  # row-parallel: this rank's input columns
                    cols = a.shape[1] // self.tp_size
                    a = a[:, self.tp_rank * cols:(self.tp_rank + 1) * cols]
                elif self.tp_dim == 0:  # column-parallel: this rank's output rows of the part
                    b = b[self.tp_rank * size:(self.tp_rank + 1) * size]
                if a.shape[1] != self.a.shape[1] or b.shape[0] != size:
                    raise ValueError(f"a LoRA update of shape A {tuple(w.a.shape)}, B {tuple(w.b.shape)} does not fit "
                                     f"the layer ({self.a.shape[1]} inputs, {size} outputs on this rank)")
                r, start = a.shape[0], slot * width + p * self.rank
                self.a[start:start + r] = a.to(self.a.dtype)
                self.b[offset:offset + size, start:start + r] = b.to(self.b.dtype)
            offset += size

    def delta(self, x: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
        """The LoRA update of tokens x [T, in] whose slots are the rows of onehot [T, S] (a row
        of zeros: no adapter), in x's dtype."""
        t = x.shape[0]
        xa = (x @ self.a.t()).view(t, self.slots, -1) * onehot[:, :, None].to(x.dtype)
        return xa.view(t, -1) @ self.b.t()
