"""FP8 (e4m3) weights for the linear layers: Qwen's block-FP8 checkpoints, and 16-bit weights
quantized when they load (`LLM(quantization="fp8")`).

- "block" (checkpoints such as Qwen/Qwen3-8B-FP8; config.json `quantization_config` = {"quant_method":
  "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}): each
  linear weight is float8_e4m3fn with `weight_scale_inv` [ceil(out/128), ceil(in/128)];
  activations are quantized per token in groups of 128 when the layer runs. Tensor parallelism
  splits weights and scales together, so a rank's share must be whole 128-blocks (and so must
  every part of a packed qkv / gate_up weight but the last).
- "tensor" (online): the 16-bit checkpoint (or dummy weights) loads as usual, then each weight is
  quantized with one fp32 scale (per rank's shard); activations get one dynamic scale per call.
  The fastest FP8 GEMMs on an H200 at decode sizes (torch._scaled_mm tensor-wise; BENCHMARKS.md),
  and the scheme vLLM's online FP8 uses. Its cost: a batch shares one activation scale, so an
  outlier token coarsens the others' rounding, and results depend (slightly) on the batch; decode
  steps of two rows and more take fp8_chain.py instead, one activation scale per row.

MoE experts (Qwen3-MoE) are FP8 in 128x128 blocks under both schemes (from the checkpoint, or
quantized at load time): the fused-MoE kernel's format (fp8_moe.py). Embeddings, norms, the LM
head and the MoE routers stay in 16 bits. The arithmetic: fp8_ops.py, fp8_moe.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.kernels import one_row
from nanovllm.model.decoder import DecoderModel, head_dim_of
from nanovllm.features.quantization.fp8_chain import Fp8RowChain
from nanovllm.features.quantization.fp8_moe import CheckpointFp8Experts, OnlineFp8Experts
from nanovllm.features.quantization.model_steps import SchemeSteps
from nanovllm.features.quantization.fp8_ops import (BLOCK, FP8_DTYPE, fp8_block_linear, fp8_tensor_linear,
                                                  quantize_weight_block_fp8, quantize_weight_per_tensor_fp8)


@dataclass(frozen=True)
class Fp8Config(SchemeSteps):
    """How a model's linear weights are stored in FP8 (see the module docstring): a
    `QuantScheme` of model/quant.py."""

    scheme: str  # "block" (from an FP8 checkpoint) or "tensor" (quantized at load time)
    ignored: tuple[str, ...] = ()  # module names left in 16 bits (the checkpoint's modules_to_not_convert)

    @classmethod
    def from_checkpoint(cls, qc: dict) -> "Fp8Config":
        """The scheme of an FP8 checkpoint's quantization_config; a ValueError naming any setting
        nano-vllm does not run (other formats, block sizes, static activation scales)."""
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"FP8 checkpoint format fmt={fmt!r} is not supported (only 'e4m3')")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"FP8 checkpoint activation_scheme={scheme!r} (static activation scales) is not "
                             f"supported; nano-vllm quantizes activations dynamically")
        block = qc.get("weight_block_size")
        if block is None:
            raise ValueError("FP8 checkpoints without weight_block_size (per-tensor weight scales) are not "
                             "supported; Qwen's block format has weight_block_size [128, 128]")
        if list(block) != [BLOCK, BLOCK]:
            raise ValueError(f"FP8 weight_block_size={list(block)} is not supported (only [{BLOCK}, {BLOCK}])")
        ignored = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
        return cls("block", tuple(ignored))

    @classmethod
    def online(cls) -> "Fp8Config":
        return cls("tensor")

    @classmethod
    def resolve(cls, checkpoint_config: dict | None) -> "Fp8Config":
        """The checkpoint's block scheme, or (None) quantization at load time."""
        return cls.online() if checkpoint_config is None else cls.from_checkpoint(checkpoint_config)

    def check_model(self, hf_config, tp: int, load_format: str = "auto") -> None:
        """A ValueError, before any weight loads, when a tensor-parallel shard or a packed part
        (q / k of qkv, gate of gate_up) would not be whole 128-blocks of the checkpoint's scales,
        or (either scheme: FP8 experts are always in 128x128 blocks) when a rank's share of the
        MoE intermediate size would not be."""
        c = hf_config
        dims = {}
        if getattr(c, "num_experts", 0):
            dims["moe_intermediate_size"] = getattr(c, "moe_intermediate_size", None)
        if self.scheme == "block":
            head_dim = head_dim_of(c)
            dims.update({"num_attention_heads x head_dim": c.num_attention_heads * head_dim,
                         "num_key_value_heads x head_dim": c.num_key_value_heads * head_dim,
                         "intermediate_size": getattr(c, "intermediate_size", None)})
        for what, n in dims.items():
            if n is not None and n % (BLOCK * tp):
                where = f"{n // tp} rows per rank at tensor_parallel_size={tp}" if tp > 1 else f"{n} rows packed with others"
                raise ValueError(f"FP8 {'block checkpoint' if self.scheme == 'block' else 'weights'}: {what} = {n} "
                                 f"gives {where}, which cuts a {BLOCK}-row block of the weight scales")

    def quantizes(self, module_name: str) -> bool:
        """Whether the module is FP8: not named in `ignored`, where an entry names a module or a
        parent of it by whole dotted parts ("model.layers.1.mlp.gate" is the router, not also
        "model.layers.1.mlp.gate_up_proj")."""
        dotted = f".{module_name}."
        return not any(name and f".{name}." in dotted for name in self.ignored)

    def quantize(self, model: nn.Module) -> int:
        """SchemeSteps.quantize; online FP8 also gives each decoder its per-row chain for decode
        steps (fp8_chain.py), which multiplies TensorFp8Linear's weights."""
        count = super().quantize(model)
        if self.scheme == "tensor":
            for module in model.modules():
                if isinstance(module, DecoderModel):
                    module.chains.append(Fp8RowChain(TensorFp8Linear))
        return count

    def method_for(self, kind: str, name: str):
        """The FP8 method of a linear layer or MoE experts module (both schemes store experts
        in 128x128 blocks: fp8_moe.py), or None for a module left in 16 bits."""
        if not self.quantizes(name):
            return None
        block = self.scheme == "block"
        if kind == "linear":
            return BlockFp8Linear() if block else TensorFp8Linear()
        if kind == "experts":
            return CheckpointFp8Experts() if block else OnlineFp8Experts()
        return None


class BlockFp8Linear:
    """A linear layer with a block-FP8 checkpoint weight."""

    def create(self, layer, name: str) -> None:
        """Replace the layer's 16-bit weight by an empty FP8 weight and its block scales, with the
        layer's own (TP-sharding) loaders, before the checkpoint loads."""
        out_rows, in_cols = layer.weight.shape
        parts = layer.packed_sizes()
        split_rows = layer.tp_dim == 0 and layer.tp_size > 1
        for i, rows in enumerate(parts):
            if rows % BLOCK and (split_rows or i < len(parts) - 1):
                raise ValueError(f"{name}: FP8 block scales cover {BLOCK} rows, but {'this rank' if split_rows else 'a packed part'} "
                                 f"holds {rows} rows: the boundary cuts a {BLOCK}-row block "
                                 f"(tensor_parallel_size={layer.tp_size})")
        if layer.tp_dim == 1 and layer.tp_size > 1 and in_cols % BLOCK:
            raise ValueError(f"{name}: each rank holds {in_cols} input columns, which cuts a {BLOCK}-column "
                             f"FP8 scale block (tensor_parallel_size={layer.tp_size})")
        device = layer.weight.device
        layer.weight = nn.Parameter(torch.empty(out_rows, in_cols, dtype=FP8_DTYPE, device=device), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader
        scale = torch.empty(-(-out_rows // BLOCK), -(-in_cols // BLOCK), dtype=torch.float32, device=device)
        layer.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        layer.weight_scale_inv.block = BLOCK  # loaders count this parameter's rows in blocks
        layer.weight_scale_inv.weight_loader = layer.weight_loader

    def after_loading(self, layer) -> None:
        pass

    def init_dummy(self, layer, gen: torch.Generator) -> None:
        """Random weights of the checkpoint format (benchmarks without the checkpoint): N(0, 0.02)
        quantized in 128x128 blocks, as init_dummy draws 16-bit weights."""
        w = torch.empty(layer.weight.shape, dtype=torch.float32, device=layer.weight.device).normal_(0.0, 0.02, generator=gen)
        w_q, scale_inv = quantize_weight_block_fp8(w)
        layer.weight.data.copy_(w_q)
        layer.weight_scale_inv.data.copy_(scale_inv)

    def apply_silu_mul(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """gate_up's silu(gate) * up at one row from the GEMV's epilogue (LinearBase.silu_mul),
        when gate and up start on block rows; None otherwise."""
        if not one_row(x) or (layer.weight.shape[0] // 2) % BLOCK:
            return None
        from nanovllm.kernels.dense_gemv import dense_gemv

        return dense_gemv(x, layer.weight, scale=layer.weight_scale_inv, bias=bias, silu_mul=True)

    def gemv_operands(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, block scales) for the batch-1 GEMV's folds (model/norm_chain.py)."""
        return layer.weight, layer.weight_scale_inv

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if one_row(x):  # batch 1: as TensorFp8Linear's, the block scales multiplying x in the GEMV
            from nanovllm.kernels.dense_gemv import dense_gemv

            return dense_gemv(x, layer.weight, scale=layer.weight_scale_inv, bias=bias)
        return fp8_block_linear(x, layer.weight, layer.weight_scale_inv, bias)


class TensorFp8Linear:
    """A linear layer whose 16-bit weight is quantized per tensor once it has loaded."""

    def create(self, layer, name: str) -> None:
        pass  # the 16-bit weight loads as usual

    def init_dummy(self, layer, gen: torch.Generator) -> None:
        pass  # init_dummy draws the 16-bit weight

    def after_loading(self, layer) -> None:
        w_q, scale = quantize_weight_per_tensor_fp8(layer.weight.data)
        layer.weight = nn.Parameter(w_q, requires_grad=False)
        layer.register_buffer("weight_scale", scale.reshape(1).to(torch.float32))

    def apply_silu_mul(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """gate_up's silu(gate) * up at one row from the GEMV's epilogue (LinearBase.silu_mul)."""
        if not one_row(x):
            return None
        from nanovllm.kernels.dense_gemv import dense_gemv

        return dense_gemv(x, layer.weight, scale=layer.weight_scale, bias=bias, silu_mul=True)

    def gemv_operands(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, tensor scale) for the batch-1 GEMV's folds (model/norm_chain.py)."""
        return layer.weight, layer.weight_scale

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if one_row(x):
            # Batch 1: the codes widened in registers (kernels/dense_gemv.py), no activation
            # amax + cast (~4 us a GEMM at decode sizes, BENCHMARKS.md).
            from nanovllm.kernels.dense_gemv import dense_gemv

            return dense_gemv(x, layer.weight, scale=layer.weight_scale, bias=bias)
        return fp8_tensor_linear(x, layer.weight, layer.weight_scale, bias)
