"""Linear layers split across tensor-parallel ranks (column-parallel: the output features;
row-parallel: the input features, partial sums all-reduced), each with a `weight_loader` for its
shard. Packed layers (`qkv_proj`, `gate_up_proj`) hold several checkpoint tensors: one GEMM."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import one_row
from nanovllm.model.layers.activation import silu_and_mul
from nanovllm.parallel.group import current_tp_group, divide


def _copy_checked(param_slice: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if param_slice.shape != loaded.shape:
        raise ValueError(f"{what}: checkpoint shard has shape {tuple(loaded.shape)}, "
                         f"expected {tuple(param_slice.shape)}")
    if (param_slice.dtype == torch.float8_e4m3fn) != (loaded.dtype == torch.float8_e4m3fn):
        # A cast between FP8 codes and real values would load garbage without a word.
        raise ValueError(f"{what}: checkpoint tensor is {loaded.dtype}, expected {param_slice.dtype} "
                         f"(config.json's quantization_config and the tensors disagree)")
    param_slice.copy_(loaded)


def _units(param: torch.Tensor, n: int) -> int:
    """`n` weight rows as rows of `param`: itself, or the blocks covering them for a block-scale
    parameter (`param.block`, FP8's weight_scale_inv)."""
    block = getattr(param, "block", None)
    return n if block is None else -(-n // block)


class LinearBase(nn.Module):
    quant_kind = "linear"  # what a quantization scheme sees (model/quant.py)

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_dim = tp_dim
        # This rank's sizes, kept when a quantization method replaces the weight.
        self.in_features, self.out_features = input_size, output_size
        self.tp = current_tp_group()
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.quant = None  # its LinearMethod (model/quant.py) when quantized, set before loading
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
        if self.tp_dim is not None and self.tp_dim < param.dim():  # this rank's slice of the whole tensor
            size, full = param.size(self.tp_dim), list(param.shape)
            full[self.tp_dim] *= self.tp_size
            if list(loaded.shape) != full:
                raise ValueError(f"{name}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(full)}")
            loaded = loaded.narrow(self.tp_dim, self.tp_rank * size, size)
        _copy_checked(param.data, loaded, name)

    def packed_sizes(self) -> list[int]:
        """This rank's output rows of each checkpoint tensor packed in the weight (one part for
        an unpacked layer); quantization schemes check their block alignment."""
        return [self.weight.shape[0]]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T (+ bias) with this layer's weight, quantized or not."""
        if self.quant is not None:
            return self.quant.apply(self, x, bias)
        if one_row(x):  # batch 1
            from nanovllm.kernels.dense_gemv import dense_gemv

            return dense_gemv(x, self.weight, bias=bias)
        return F.linear(x, self.weight, bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up's packed output; one row from the GEMV's epilogue (or `apply_silu_mul`'s)."""
        out = None
        if one_row(x):
            from nanovllm.kernels.dense_gemv import dense_gemv

            out = (dense_gemv(x, self.weight, bias=self.bias, silu_mul=True) if self.quant is None
                   else getattr(self.quant, "apply_silu_mul", lambda *_: None)(self, x, self.bias))
        return out if out is not None else silu_and_mul(self(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, tp_dim=None)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs packed along dim 0 (e.g. gate_proj and up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, divide(sum(output_sizes), current_tp_group().size), bias, tp_dim=0)

    def packed_sizes(self) -> list[int]:
        return [n // self.tp_size for n in self.output_sizes]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "", shard_id: int = 0):
        _load_packed_part(self, param, loaded, name, sum(self.output_sizes[:shard_id]) // self.tp_size,
                          self.output_sizes[shard_id] // self.tp_size)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections packed along dim 0 (shards "q", "k", "v"); each rank holds its heads of all three."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        divide(num_kv_heads, current_tp_group().size)  # whole heads (then q's too: num_heads is a multiple)
        super().__init__(hidden_size, [num_heads * head_dim] + [num_kv_heads * head_dim] * 2, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "", shard_id: str = "q"):
        super().weight_loader(param, loaded, name, "qkv".index(shard_id))


def _load_packed_part(layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor, name: str, offset: int,
                      size: int) -> None:
    """Copy this rank's rows of one checkpoint tensor packed into `param` at `offset` (weight rows
    of this rank's shard; `size` of them). Block-scale parameters count in their blocks: packed
    parts then start on block boundaries (the quantization scheme checks that at creation)."""
    full = size * layer.tp_size
    expected = (_units(param, full),) + tuple(param.shape[1:])
    if tuple(loaded.shape) != expected:
        raise ValueError(f"{name}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {expected}")
    rows = _units(param, size)
    shard = loaded.narrow(0, layer.tp_rank * rows, rows)
    _copy_checked(param.data.narrow(0, _units(param, offset), rows), shard, name)


class RowParallelLinear(LinearBase):
    """With `reduce_results=False` the output is this rank's partial sum, which must reach
    `RMSNorm(..., all_reduce=True)` as returned (DistributedTPGroup.row_parallel)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True):
        super().__init__(divide(input_size, current_tp_group().size), output_size, bias, tp_dim=1)
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.reduce_results and self.bias is None:
            return self.tp.row_parallel(x, self)  # the norm after it sums over the ranks
        # Only rank 0 adds the bias, so the all-reduce counts it once.
        y = self.matmul(x, self.bias if self.tp_rank == 0 else None)
        return self.tp.all_reduce(y) if self.reduce_results else y
