"""The three INT4 weight-only checkpoint formats, as stored, and their conversion to one layout.

Every format stores 4-bit integers q in [0, 15] eight to an int32 (value j of a word in bits
4j..4j+3, but AWQ's order below), with per-group scales s and zero points z over `group_size`
consecutive input features (one group for "channel" / group_size -1): w = (q - z) * s.

- GPTQ (AutoGPTQ / GPTQModel): `qweight` int32 [in / 8, out] (packed along the input),
  `qzeros` int32 [groups, out / 8] (packed along the output), `scales` [groups, out], `g_idx`
  int32 [in] (each input feature's group; with desc_act not in order). checkpoint_format "gptq"
  (v1) stores z - 1 in qzeros, "gptq_v2" stores z.
- AWQ (AutoAWQ, version "gemm"): `qweight` int32 [in, out / 8] and `qzeros` int32 [groups, out / 8],
  both packed along the output in the order 0, 2, 4, 6, 1, 3, 5, 7 (word nibble i holds output
  column ORDER[i] of its eight), `scales` [groups, out].
- compressed-tensors "pack-quantized" (llm-compressor's W4A16): `weight_packed` int32
  [out, in / 8] (packed along the input), `weight_scale` [out, groups], values stored + 8 (the
  signed range [-8, 7] made unsigned); asymmetric schemes add `weight_zero_point` int32
  [out / 8, groups] (packed along the output, also + 8), symmetric ones mean z = 8;
  `weight_shape` [2] = (out, in); `weight_g_idx` [in] with an activation order.

The layout the kernels read (Int4Weights): q packed along the input, [in / 8, out] words, with
groups in order (an act-order checkpoint's input features are sorted by group, and the
activations permuted to match: `perm`), scales and zero points [groups, out] in the model's dtype.
Within each block of 32 input rows the words hold their rows in the order of a tensor-core
fragment (pack_kernel_order): nibble j = 4c + 2a + b of word t (0..3) is row 16a + 8b + 2t + c.
wgmma takes its A operand from registers in fragments where a thread holds rows {2l, 2l + 1,
2l + 8, 2l + 9, ...} (l = lane % 4), in pairs of consecutive rows (c = 0, 1) a 32-bit register;
stored so, a word unpacks into exactly the values its thread feeds the MMA, nibbles j and j + 4
(the pair the unpacking makes in one register) being one such pair, and the unpacked tile needs
no shuffle, neither through shared memory nor between registers (kernels/w4a16_mma.py). A
block lies in one group (groups are whole multiples of 32 rows); a K that is not whole blocks
(only possible with one group per column) keeps its last 8-24 rows in plain order, for the
torch path (no kernel tiles such a K).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column held by each nibble of an AWQ word
_NATURAL = tuple(range(8))


def unpack_int4(packed: torch.Tensor, dim: int, order: tuple[int, ...] = _NATURAL) -> torch.Tensor:
    """int32 words -> their eight 4-bit values (int32, 0..15), `dim` growing 8-fold; value e of a
    word's eight comes from the nibble that `order` gives it (order[nibble] = e)."""
    shifts = torch.tensor([4 * order.index(e) for e in range(8)], dtype=torch.int32, device=packed.device)
    words = packed.to(torch.int32).unsqueeze(dim + 1)
    view = [1] * words.dim()
    view[dim + 1] = 8
    values = (words >> shifts.view(view)) & 0xF
    shape = list(packed.shape)
    shape[dim] *= 8
    return values.reshape(shape)


def _in_blocks(rows: torch.Tensor, fn) -> torch.Tensor:
    """fn applied to the whole 32-row blocks of rows [..., R, N] (R a multiple of 8); a last
    partial block (K % 32 of 8, 16 or 24 rows: no kernel tiles such a K, only the torch path
    reads it) stays in plain order."""
    whole = rows.shape[-2] - rows.shape[-2] % 32
    if whole == rows.shape[-2]:
        return fn(rows)
    return torch.cat([fn(rows[..., :whole, :]), rows[..., whole:, :]], dim=-2)


def _to_fragment(q: torch.Tensor) -> torch.Tensor:
    """Rows of whole blocks in the order the words hold them: row 16a + 8b + 2t + c of a block
    (viewed [.., a, b, t, c]) moves to 8t + 4c + 2a + b (nibble 4c + 2a + b of word t)."""
    *lead, r, n = q.shape
    return q.reshape(*lead, r // 32, 2, 2, 4, 2, n).movedim((-3, -2), (-5, -4)).reshape(q.shape)  # (t, c) first


def _from_fragment(v: torch.Tensor) -> torch.Tensor:
    """The inverse of _to_fragment."""
    *lead, r, n = v.shape
    return v.reshape(*lead, r // 32, 4, 2, 2, 2, n).movedim((-3, -2), (-5, -4)).reshape(v.shape)  # (a, b) first


def pack_kernel_order(q: torch.Tensor) -> torch.Tensor:
    """Values q [..., in, out] (0..15; `in` a multiple of 8) -> the kernels' words [..., in / 8,
    out] (module docstring): word t of a 32-row block holds its rows 2t + {0, 8, 16, 24, 1, 9, 17,
    25}."""
    return pack_int4(_in_blocks(q, _to_fragment), q.dim() - 2)


def unpack_kernel_order(words: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_kernel_order: words [..., in / 8, out] -> values [..., in, out]."""
    return _in_blocks(unpack_int4(words, words.dim() - 2), _from_fragment)


def pack_int4(values: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of unpack_int4 in the natural order: eight values (0..15) per int32 word."""
    shape = list(values.shape)
    shape[dim : dim + 1] = [shape[dim] // 8, 8]
    v = values.to(torch.int32).reshape(shape)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=values.device)
    view = [1] * v.dim()
    view[dim + 1] = 8
    return (v << shifts.view(view)).sum(dim=dim + 1, dtype=torch.int32)


@dataclass
class Int4Weights:
    """One linear layer's (this rank's) weights in the kernels' layout (module docstring)."""

    qweight: torch.Tensor  # int32 [in / 8, out], rows in fragment order within blocks of 32
    scales: torch.Tensor  # [groups, out]
    zeros: torch.Tensor  # [groups, out], integer-valued
    group_size: int
    perm: torch.Tensor | None  # long [in]: activations' columns in group order, None when in order


def to_kernel_layout(q: torch.Tensor, scales, zeros, g_idx: torch.Tensor | None, group_size: int,
                     dtype: torch.dtype) -> Int4Weights:
    """From unpacked values q [in, out], scales / zeros [groups, out] and each input feature's
    group (None: in order): sorted by group when they are not, packed along the input."""
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(torch.long)
        in_order = torch.arange(q.shape[0], device=q.device) // group_size
        if not torch.equal(g_idx, in_order):
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], in_order):
                raise ValueError("g_idx does not give every group exactly group_size input features")
            q = q[perm]
    return Int4Weights(pack_kernel_order(q), scales.to(dtype).contiguous(), zeros.to(dtype).contiguous(),
                       group_size, perm)


def dequantize(w: Int4Weights) -> torch.Tensor:
    """The weight [in, out] in fp32 (rows in group order: apply `perm` to the activations); a
    stack of experts' ([E, in / 8, out] words) gives [E, in, out]."""
    q = unpack_kernel_order(w.qweight).float()
    groups = torch.arange(q.shape[-2], device=q.device) // w.group_size
    return (q - w.zeros.float()[..., groups, :]) * w.scales.float()[..., groups, :]
