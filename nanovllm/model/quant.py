"""The hook through which quantization schemes store and multiply a model's weights.

A scheme (features/quantization/) is resolved by the front from `LLM(quantization=...)` and the
checkpoint's `quantization_config`; the engine's Config carries it to every rank. Before
the weights load, its `quantize` picks a method per quantizable module, which then owns that
module's weights (features/quantization/model_steps.py runs these steps for every scheme):

    create        its parameters in the stored format; each new parameter loads its checkpoint
                  tensor through its `weight_loader` (the module's own, which takes this rank's
                  shard, unless the method sets another)
    init_dummy    random weights in that format (load_format="dummy")
    after_loading convert what was loaded (e.g. quantize 16-bit weights at load time)
    apply         the module's product with the stored weights (linear: x @ W^T (+ bias);
                  MoE experts: features/moe.py's ExpertsMethod)
    apply_silu_mul  optional (linear): gate_up's silu(gate) * up from one kernel, None if it cannot
    gemv_operands   optional (linear): what the batch-1 GEMV multiplies (model/norm_chain.py): (weight,
                    scale) for kernels/dense_gemv.py, or kernels/w4a16_gemv.Int4Operands; None if it cannot

Quantizable modules name their kind in `quant_kind` ("linear", "experts"; None keeps a module, such
as an MoE router, 16-bit) and hold their method in `quant` (None: 16-bit); a wrapper (LoRA) may stand in.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class QuantMethod(Protocol):
    def create(self, module: nn.Module, name: str) -> None: ...

    def init_dummy(self, module: nn.Module, gen: torch.Generator) -> None: ...

    def after_loading(self, module: nn.Module) -> None: ...


class LinearMethod(QuantMethod, Protocol):
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


class QuantScheme(Protocol):
    """A resolved quantization scheme (e.g. features/quantization/fp8.py's Fp8Config)."""

    def check_model(self, hf_config, tp: int, load_format: str) -> None:
        """A ValueError, before any weight loads, for a model (or load_format) this scheme cannot store."""

    def method_for(self, kind: str, name: str) -> QuantMethod | None:
        """The method of the module `name` of this `quant_kind`, or None to keep it 16-bit."""

    def quantize(self, model: nn.Module) -> int:
        """Give each quantizable module it covers its method (method_for) and the method's
        parameters, before the weights load; how many modules it quantized."""

    def init_dummy(self, model: nn.Module, seed: int) -> None:
        """Random weights in the stored format for the modules a method holds (load_format="dummy")."""

    def finish_loading(self, model: nn.Module) -> None:
        """After the weights loaded: each module's method converts what it loaded (after_loading)."""

