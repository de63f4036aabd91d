"""The model-wide steps of a weight scheme (model/quant.py's QuantScheme: `quantize`,
`init_dummy`, `finish_loading`), shared by fp8.py's and int4.py's schemes: each runs over the
quantizable modules through the method the scheme picks for each (`method_for`)."""

from __future__ import annotations

import logging
from typing import Iterator

import torch
from torch import nn

logger = logging.getLogger(__name__)


def quantizable_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module in model.named_modules():
        if getattr(module, "quant_kind", None) is not None:
            yield name, module


class SchemeSteps:
    """A QuantScheme's model-wide steps, for a scheme class that defines `method_for`."""

    def quantize(self, model: nn.Module) -> int:
        """Give every module the scheme covers its method and stored-format parameters, before the
        weights load. Returns how many modules are quantized."""
        count = 0
        for name, module in quantizable_modules(model):
            method = self.method_for(module.quant_kind, name)
            if method is not None:
                module.quant = method
                method.create(module, name)
                count += 1
        logger.info("%s: %d linear layers and experts modules quantized", self, count)
        return count

    @torch.no_grad()
    def init_dummy(self, model: nn.Module, seed: int) -> None:
        """Random weights, in their stored format, for the modules a method holds."""
        gen = None
        for _, module in quantizable_modules(model):
            if module.quant is not None:
                if gen is None:
                    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed + 1)
                module.quant.init_dummy(module, gen)

    @torch.no_grad()
    def finish_loading(self, model: nn.Module) -> None:
        """After the weights loaded: each method converts what it loaded."""
        for _, module in quantizable_modules(model):
            if module.quant is not None:
                module.quant.after_loading(module)
