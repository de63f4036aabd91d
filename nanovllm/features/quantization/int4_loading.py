"""Loading INT4 checkpoint tensors (int4_formats.py) into a linear layer: which tensors each
format has, where their output and input features lie, and how this rank's share of a packed
part (q / k / v of qkv_proj, gate / up of gate_up_proj) is cut from them; then the conversion
to the kernels' layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm.features.quantization.int4_formats import AWQ_ORDER, Int4Weights, pack_int4, to_kernel_layout, unpack_int4


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor: `role` (q: the 4-bit values, z: zero points, s: scales, g_idx, shape),
    its shape on this rank, dtype (None: the model's), the dimension of the output features and
    how many share an index (8 when packed along them), the dimension of the input features and
    whether tensor parallelism splits it (not for one group per channel)."""

    name: str
    role: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    out_dim: int | None
    out_pack: int
    in_dim: int | None
    in_split: bool = True


def tensor_specs(format: str, sym: bool, desc_act: bool, k: int, n: int, group_size: int) -> list[TensorSpec]:
    """The tensors of a layer with `k` input and `n` output features on this rank."""
    g, split = (k // group_size, True) if group_size > 0 else (1, False)
    i32 = torch.int32
    if format == "gptq":
        return [TensorSpec("qweight", "q", (k // 8, n), i32, 1, 1, 0),
                TensorSpec("qzeros", "z", (g, n // 8), i32, 1, 8, 0, split),
                TensorSpec("scales", "s", (g, n), None, 1, 1, 0, split),
                TensorSpec("g_idx", "g_idx", (k,), i32, None, 1, 0)]
    if format == "awq":
        return [TensorSpec("qweight", "q", (k, n // 8), i32, 1, 8, 0),
                TensorSpec("qzeros", "z", (g, n // 8), i32, 1, 8, 0, split),
                TensorSpec("scales", "s", (g, n), None, 1, 1, 0, split)]
    specs = [TensorSpec("weight_packed", "q", (n, k // 8), i32, 0, 1, 1),
             TensorSpec("weight_scale", "s", (n, g), None, 0, 1, 1, split),
             TensorSpec("weight_shape", "shape", (2,), torch.int64, None, 1, None)]
    if not sym:
        specs.append(TensorSpec("weight_zero_point", "z", (n // 8, g), i32, 0, 8, 1, split))
    if desc_act:
        specs.append(TensorSpec("weight_g_idx", "g_idx", (k,), i32, None, 1, 0))
    return specs


def _part(layer, shard) -> tuple[int, int]:
    """(offset, size) in this rank's output features of the packed part `shard` (None: all)."""
    if shard is None:
        return 0, layer.int4_shape[1]
    sizes = layer.packed_sizes()
    index = {"q": 0, "k": 1, "v": 2}.get(shard, shard)
    return sum(sizes[:index]), sizes[index]


def load_part(layer, spec: TensorSpec, param, loaded: torch.Tensor, name: str, shard=None) -> None:
    """Copy this rank's share of checkpoint tensor `loaded` into `param` (see the module docstring)."""
    offset, size = _part(layer, shard)
    tp, rank = layer.tp_size, layer.tp_rank
    if spec.role == "shape":  # compressed-tensors' (out, in) of the whole part: checked, then kept
        want = [size * (tp if layer.tp_dim == 0 else 1), layer.int4_full_shape[1]]
        if loaded.tolist() != want:
            raise ValueError(f"{name}: weight_shape {loaded.tolist()} is not the layer's {want}")
        param.data.copy_(loaded)
        return
    data = param.data
    if spec.out_dim is not None:
        rows = size // spec.out_pack
        full = rows * (tp if layer.tp_dim == 0 else 1)
        _check(loaded, spec.out_dim, full, name)
        if layer.tp_dim == 0 and tp > 1:
            loaded = loaded.narrow(spec.out_dim, rank * rows, rows)
        data = data.narrow(spec.out_dim, offset // spec.out_pack, rows)
    if spec.in_dim is not None and layer.tp_dim == 1 and tp > 1 and spec.in_split:
        cols = data.size(spec.in_dim)
        _check(loaded, spec.in_dim, cols * tp, name)
        loaded = loaded.narrow(spec.in_dim, rank * cols, cols)
    if tuple(loaded.shape) != tuple(data.shape):
        raise ValueError(f"{name}: checkpoint shard has shape {tuple(loaded.shape)}, expected {tuple(data.shape)}")
    if loaded.is_floating_point() != data.is_floating_point():
        raise ValueError(f"{name}: checkpoint tensor is {loaded.dtype}, expected {data.dtype} (config.json's "
                         f"quantization_config and the tensors disagree)")
    if spec.role == "g_idx" and shard is not None:  # one input order for the parts packed together
        parts = param.__dict__.setdefault("loaded_parts", set())
        if parts and not torch.equal(data, loaded.to(data.device, data.dtype)):
            raise ValueError(f"{name}: its activation order differs from the other projections packed with it "
                             f"(they read the same input, so GPTQ orders them alike)")
        parts.add(shard)
    data.copy_(loaded)


def fill_dummy(p: torch.Tensor, role: str, c, full_shape: tuple[int, int], gen: torch.Generator) -> None:
    """Random weights of a stored tensor (any leading dimensions, e.g. experts): random 4-bit
    values, zero points 8 and scales giving weights of about N(0, 0.02)."""
    if role == "q":  # (any 32 bits are eight valid 4-bit values)
        p.copy_(torch.randint(-2**31, 2**31 - 1, p.shape, generator=gen, device=p.device, dtype=torch.int64))
    elif role == "z":
        p.fill_(int(pack_int4(torch.full((8,), 7 if c.v1_zeros else 8), 0)))
    elif role == "s":
        p.fill_(0.02 / 4.6)  # uniform 4-bit values around 8 have a standard deviation of ~4.6
    elif role == "g_idx":
        k = p.shape[-1]
        p.copy_((torch.arange(k, device=p.device) // (c.group_size if c.group_size > 0 else k)).expand_as(p))
    elif role == "shape":
        p.copy_(torch.tensor(full_shape, device=p.device).expand_as(p))


def _check(loaded: torch.Tensor, dim: int, size: int, name: str) -> None:
    if loaded.dim() <= dim or loaded.size(dim) != size:
        raise ValueError(f"{name}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {size} along "
                         f"dimension {dim}")


def _group_size(config, k: int) -> int:
    return config.group_size if config.group_size > 0 else k


def _gptq(t: dict, config, dtype) -> Int4Weights:
    q = unpack_int4(t["q"], 0)  # [in, out]
    z = unpack_int4(t["z"], 1) + (1 if config.v1_zeros else 0)  # v1 stores z - 1
    g_idx = t["g_idx"].long()
    return to_kernel_layout(q, t["s"], z, g_idx - g_idx.min(), _group_size(config, q.shape[0]), dtype)


def _awq(t: dict, config, dtype) -> Int4Weights:
    q = unpack_int4(t["q"], 1, AWQ_ORDER)
    z = unpack_int4(t["z"], 1, AWQ_ORDER)
    return to_kernel_layout(q, t["s"], z, None, _group_size(config, q.shape[0]), dtype)


def _compressed_tensors(t: dict, config, dtype) -> Int4Weights:
    q = unpack_int4(t["q"], 1).t()  # stored [out, in]
    s = t["s"].t()
    z = unpack_int4(t["z"], 0).t() if "z" in t else torch.full_like(s, 8)  # symmetric: the + 8 offset
    return to_kernel_layout(q, s, z, t.get("g_idx"), _group_size(config, q.shape[0]), dtype)


CONVERTERS = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors}
