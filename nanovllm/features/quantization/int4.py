"""INT4 weight-only linear layers (W4A16): GPTQ, AWQ and compressed-tensors checkpoints, loaded
as they are stored (int4_formats.py) and multiplied by Triton kernels that unpack the 4-bit
weights in registers (kernels/w4a16.py; plain torch on the CPU).

The scheme comes from config.json's quantization_config (or `LLM(quantization="gptq" | "awq")`
with load_format="dummy": random packed weights of the real shapes, for benchmarks). The LM
head, embeddings, norms and the modules a config leaves out stay in 16 bits. Settings without a
kernel are refused before any weight loads: other bit widths, AWQ without zero points, an
activation order under tensor parallelism, experts or TP shards that cut a group. MoE
experts load through int4_moe.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from nanovllm.features.quantization.int4_formats import dequantize
from nanovllm.features.quantization.int4_loading import CONVERTERS, fill_dummy, load_part, tensor_specs
from nanovllm.features.quantization.int4_moe import Int4Experts
from nanovllm.features.quantization.model_steps import SchemeSteps
from nanovllm.kernels import one_row
from nanovllm.kernels.w4a16 import Strips, can_run, choose, w4a16_matmul, warm_up
from nanovllm.kernels.w4a16_gemv import Int4Operands, gated_fits, gemv


def _kernels_take(w, dtype: torch.dtype) -> bool:
    """Whether kernels/w4a16.py multiplies 16-bit activations by this layer's weights (else plain
    torch: fp32, or a K the kernels do not tile)."""
    return dtype in (torch.bfloat16, torch.float16) and can_run(w.qweight.shape[0] * 8, w.group_size)


def _ignored(qc: dict, *keys: str) -> tuple[str, ...]:
    for key in keys:
        if qc.get(key):
            return tuple(qc[key])
    return ()


class DequantWorkspace:
    """One buffer for the weight that large batches dequantize before cuBLAS multiplies it
    (kernels/w4a16.py, Dequant): layers run one after another, so a buffer as large as the
    largest layer serves them all. Grown as layers finish loading, so the engine's memory
    profile counts it and no CUDA graph capture allocates it."""

    def __init__(self):
        self.buffers: dict = {}

    def reserve(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        buf = self.buffers.get((dtype, device))
        if buf is None or buf.numel() < numel:
            self.buffers[(dtype, device)] = torch.empty(numel, dtype=dtype, device=device)

    def get(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        return self.buffers.get((dtype, device))


@dataclass(frozen=True)
class Int4Config(SchemeSteps):
    """An INT4 checkpoint's scheme (a model/quant.py QuantScheme): its format, group size (-1:
    one group per output channel), symmetry, activation order, GPTQ's v1 zero points (stored
    z - 1) and the modules left in 16 bits."""

    format: str  # "gptq", "awq" or "compressed-tensors"
    group_size: int = 128
    sym: bool = True
    desc_act: bool = False
    v1_zeros: bool = False
    ignored: tuple[str, ...] = ()
    dummy: bool = False  # asked for by name without a checkpoint in the format: random weights only
    workspace: DequantWorkspace = field(default_factory=DequantWorkspace, compare=False, repr=False)
    warmed: set = field(default_factory=set, compare=False, repr=False)  # weight shapes warm_up compiled for

    @classmethod
    def gptq(cls, qc: dict | None) -> "Int4Config":
        if qc is None:  # LLM(quantization="gptq") on a 16-bit checkpoint: dummy weights only
            return cls("gptq", 128, True, dummy=True)
        _bits(qc.get("bits"), "GPTQ")
        version = qc.get("checkpoint_format", "gptq")
        if version not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format={version!r} is not supported ('gptq' or 'gptq_v2')")
        return cls("gptq", _group(qc.get("group_size", 128)), bool(qc.get("sym", True)), bool(qc.get("desc_act")),
                   version == "gptq", _ignored(qc, "modules_to_not_convert"))

    @classmethod
    def awq(cls, qc: dict | None) -> "Int4Config":
        if qc is None:
            return cls("awq", 128, False, dummy=True)
        _bits(qc.get("bits", qc.get("w_bit")), "AWQ")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version={version!r} is not supported (only 'gemm')")
        if not qc.get("zero_point", True):
            raise ValueError("AWQ without zero points (zero_point=false) is not supported")
        return cls("awq", _group(qc.get("group_size", qc.get("q_group_size", 128))), False, False, False,
                   _ignored(qc, "modules_to_not_convert"))

    @classmethod
    def compressed_tensors(cls, qc: dict | None) -> "Int4Config":
        if qc is None:
            return cls("compressed-tensors", 128, True, dummy=True)
        if qc.get("format") != "pack-quantized":
            raise ValueError(f"compressed-tensors format={qc.get('format')!r} is not supported (only "
                             f"'pack-quantized' W4A16)")
        groups = list((qc.get("config_groups") or {}).values())
        if len(groups) != 1 or groups[0].get("input_activations"):
            raise ValueError("compressed-tensors: only one weight-only scheme (W4A16, no activation "
                             "quantization) is supported")
        w = groups[0].get("weights") or {}
        _bits(w.get("num_bits"), "compressed-tensors")
        if w.get("type", "int") != "int" or w.get("strategy") not in ("group", "channel"):
            raise ValueError(f"compressed-tensors weights type={w.get('type')!r} strategy={w.get('strategy')!r}: "
                             f"only int with 'group' or 'channel' is supported")
        group = _group(w.get("group_size")) if w["strategy"] == "group" else -1
        return cls("compressed-tensors", group, bool(w.get("symmetric", True)), w.get("actorder") is not None,
                   False, _ignored(qc, "ignore"))

    def check_model(self, hf_config, tp: int, load_format: str = "auto") -> None:
        if self.dummy and load_format != "dummy":
            raise ValueError(f"quantization={self.format!r} with a checkpoint that is not {self.format}-quantized (no "
                             f"quantization_config): only load_format='dummy' (random packed weights) can run it")
        if getattr(hf_config, "num_experts", 0):
            self._check_experts(hf_config, tp)
        if self.desc_act and tp > 1:
            raise ValueError(f"{self.format}: an activation order (desc_act / actorder) with tensor_parallel_size > 1 "
                             f"is not supported (a rank's input features would not hold whole groups)")
        if self.group_size > 0 and tp > 1:
            for what in ("intermediate_size", "hidden_size"):
                n = getattr(hf_config, what, None)
                if n and (n // tp) % self.group_size:
                    raise ValueError(f"{self.format}: {what} = {n} over tensor_parallel_size={tp} cuts a "
                                     f"{self.group_size}-feature group")

    def _check_experts(self, hf_config, tp: int) -> None:
        """The fused kernel's tiles: 32 input features at least, inside one group."""
        n = hf_config.moe_intermediate_size // tp
        for what, k in (("hidden_size", hf_config.hidden_size), (f"moe_intermediate_size over tp={tp}", n)):
            if k % 32 or (self.group_size > 0 and k % self.group_size):
                raise ValueError(f"{self.format} INT4 experts: {what} = {k} is not whole groups of "
                                 f"{max(self.group_size, 32)} input features")

    def method_for(self, kind: str, name: str):
        dotted = f".{name}."
        if any(i and (f".{i}." in dotted or name.startswith(i)) for i in self.ignored):
            return None
        return Int4Linear(self) if kind == "linear" else Int4Experts(self) if kind == "experts" else None

    def bytes_per_weight(self, dtype_bytes: int, in_features: int) -> float:
        """Bytes a step reads per weight: half a byte, and a scale and a zero point per group."""
        return 0.5 + 2 * dtype_bytes / (self.group_size if self.group_size > 0 else in_features)

    def __str__(self) -> str:
        return f"INT4 {self.format} (group {self.group_size}, {'sym' if self.sym else 'asym'})"


def _bits(bits, what: str) -> None:
    if bits != 4:
        raise ValueError(f"{what} bits={bits!r}: only 4-bit weights have a kernel")


def _group(size) -> int:
    if size in (None, -1):
        return -1
    if size not in (32, 64, 128, 256):
        raise ValueError(f"group_size={size!r} is not supported (32, 64, 128, 256 or -1)")
    return int(size)


class Int4Linear:
    """A linear layer whose weight loads in its checkpoint's INT4 format (see the module docstring)."""

    def __init__(self, config: Int4Config):
        self.config = config

    def _specs(self, layer):
        c = self.config
        return tensor_specs(c.format, c.sym, c.desc_act, *layer.int4_shape, c.group_size)

    def create(self, layer, name: str) -> None:
        """Replace the 16-bit weight by the format's tensors, each with a loader that takes this
        rank's share (whole groups) of its packed part."""
        out_rows, in_cols = layer.weight.shape
        c = self.config
        if c.group_size > 0 and in_cols % c.group_size:
            raise ValueError(f"{name}: {in_cols} input features are not whole groups of {c.group_size}")
        if out_rows % 8 or in_cols % 8:
            raise ValueError(f"{name}: INT4 weights pack 8 values a word; {out_rows} x {in_cols} does not divide")
        device, layer.int4_dtype = layer.weight.device, layer.weight.dtype
        layer.int4_shape = (in_cols, out_rows)
        tp = layer.tp_size
        layer.int4_full_shape = (out_rows * (tp if layer.tp_dim == 0 else 1), in_cols * (tp if layer.tp_dim == 1 else 1))
        del layer.weight
        for spec in self._specs(layer):
            param = nn.Parameter(torch.empty(spec.shape, dtype=spec.dtype or layer.int4_dtype, device=device),
                                 requires_grad=False)
            param.weight_loader = lambda p, t, n="", shard=None, spec=spec: load_part(layer, spec, p, t, n, shard)
            setattr(layer, spec.name, param)

    def init_dummy(self, layer, gen: torch.Generator) -> None:
        for spec in self._specs(layer):
            fill_dummy(getattr(layer, spec.name).data, spec.role, self.config, layer.int4_full_shape, gen)

    def after_loading(self, layer) -> None:
        """The loaded tensors -> the kernels' layout (int4_formats.Int4Weights) in `layer.int4`."""
        loaded = {}
        for spec in self._specs(layer):
            loaded[spec.role] = getattr(layer, spec.name).data
            delattr(layer, spec.name)
        layer.int4 = w = CONVERTERS[self.config.format](loaded, self.config, layer.int4_dtype)
        if w.qweight.is_cuda:
            self.config.workspace.reserve(w.qweight.numel() * 8, layer.int4_dtype, w.qweight.device)
            shape = (*w.qweight.shape, w.group_size, layer.int4_dtype)
            if shape not in self.config.warmed and _kernels_take(w, layer.int4_dtype):
                self.config.warmed.add(shape)  # every row count's kernel compiled now, not in a run
                warm_up(w.qweight, w.scales, w.zeros, w.group_size, layer.int4_dtype)

    def apply_silu_mul(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """gate_up's silu(gate) * up for one bf16 row from the batch-1 GEMV's epilogue
        (LinearBase.silu_mul; kernels/w4a16_gemv.py); None where that GEMV does not run."""
        w = layer.int4
        k, n = w.qweight.shape[0] * 8, w.qweight.shape[1]
        cfg = choose(1, n, k, x.dtype) if one_row(x) and bias is None and can_run(k, w.group_size) else None
        if not isinstance(cfg, Strips) or not gated_fits(n, cfg):
            return None
        if w.perm is not None:
            x = x.index_select(-1, w.perm)
        return gemv(x, w.qweight, w.scales, w.zeros, w.group_size, cfg, silu_mul=True)

    def gemv_operands(self, layer) -> Int4Operands | None:
        """The batch-1 GEMV's operands for the norm folds (model/norm_chain.py), or None where that
        GEMV does not run (fp16 models, a K it does not tile)."""
        w = layer.int4
        k, n = w.qweight.shape[0] * 8, w.qweight.shape[1]
        if layer.int4_dtype != torch.bfloat16 or not can_run(k, w.group_size):
            return None
        return Int4Operands(w.qweight, w.scales, w.zeros, w.group_size, w.perm, choose(1, n, k, torch.bfloat16))

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = layer.int4
        if w.perm is not None:
            x = x.index_select(-1, w.perm)
        if x.is_cuda and _kernels_take(w, x.dtype):
            y = w4a16_matmul(x, w.qweight, w.scales, w.zeros, w.group_size,
                             workspace=self.config.workspace.get(x.dtype, x.device))
        else:  # the same arithmetic in plain torch (the CPU, fp32, a K the kernels do not tile)
            y = (x.float() @ dequantize(w)).to(x.dtype)
        return y if bias is None else y + bias
