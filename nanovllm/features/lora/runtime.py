"""LoRA on one rank (core/hooks.py's Adapters): every decoder layer's qkv / o / gate_up / down
projection gets `max_loras` adapter slots (stacks.py) and a method that adds each token's
update to the layer's own product (the layer's quantization method, if any, still computes
that); before each forward, the step's adapters are loaded into their slots (each rank reads
the adapter folder itself, kept in a host LRU of max_cpu_loras) and a persistent one-hot buffer
tells every token its slot, so decode and prefill graphs replay with the right adapters.
"""

from __future__ import annotations

import functools
from collections import OrderedDict

import torch
import torch.nn.functional as F

from nanovllm.features.lora.adapter import TARGETS, LoraAdapter, load_adapter
from nanovllm.features.lora.stacks import LoraStack
from nanovllm.model.attention import host_to_device

LAYERS = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}


class LoraLinear:
    """A linear layer's method with LoRA: its own product (its quantization method's, if any)
    plus each token's adapter update."""

    def __init__(self, base, stack: LoraStack, runtime: "LoraRuntime"):
        self.base, self.stack, self.runtime = base, stack, runtime

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.base.apply(layer, x, bias) if self.base is not None else F.linear(x, layer.weight, bias)
        flat = x.reshape(-1, x.shape[-1])
        return y + self.stack.delta(flat, self.runtime.onehot[:flat.shape[0]]).view_as(y)


class LoraRuntime:
    @classmethod
    def factory(cls, lora_config, hf_config):
        """What Config carries to every rank: (model runner, most tokens a step holds) -> runtime."""
        return functools.partial(cls, lora_config)

    def __init__(self, lora_config, runner, max_tokens: int):
        self.config, self.device, self.tp, self.dtype = lora_config, runner.device, runner.tp, runner.config.dtype
        self.onehot = torch.zeros(max_tokens, lora_config.max_loras, device=self.device)
        self.stacks: dict[tuple[int, str], LoraStack] = {}
        self.cache: OrderedDict[int, LoraAdapter] = OrderedDict()  # adapter id -> weights (host)
        self.num_layers = 0
        self.active = False

    def attach(self, model) -> None:
        layers = model.model.layers
        self.num_layers = len(layers)
        for i, block in enumerate(layers):
            for name, parent in LAYERS.items():
                linear = getattr(getattr(block, parent), name, None)
                if linear is None:
                    continue  # (a mixture-of-experts layer has no gate_up / down projection)
                stack = LoraStack(self.config.max_loras, self.config.max_lora_rank, linear.in_features,
                                  linear.packed_sizes(), linear.tp_dim, self.tp.rank, self.tp.size, self.dtype,
                                  self.device)
                self.stacks[(i, name)] = stack
                linear.quant = LoraLinear(linear.quant, stack, self)
                linear.row_chunks = False  # its update reads each row's slot by the row's position

    def _adapter(self, adapter_id: int, name: str, path: str) -> LoraAdapter:
        if adapter_id in self.cache:
            self.cache.move_to_end(adapter_id)
            return self.cache[adapter_id]
        adapter = load_adapter(name, path, self.config.max_lora_rank, self.num_layers)
        self.cache[adapter_id] = adapter
        while len(self.cache) > self.config.max_cpu_loras:
            self.cache.popitem(last=False)
        return adapter

    def load(self, slot: int, adapter_id: int, name: str, path: str) -> None:
        adapter = self._adapter(adapter_id, name, path)
        for (layer, proj) in adapter.weights:
            if (layer, TARGETS[proj][0]) not in self.stacks:
                raise ValueError(f"LoRA adapter {name!r} changes layer {layer}'s {proj}, which this model does not "
                                 f"have as a dense projection (mixture-of-experts layers take no LoRA)")
        for (layer, name_), stack in self.stacks.items():
            parts = [adapter.weights.get((layer, p)) for p, (ours, _) in TARGETS.items() if ours == name_]
            stack.set(slot, parts)

    def prepare(self, step) -> None:
        for load in step.adapter_loads or ():
            self.load(*load)
        if step.adapters is None:
            if self.active:
                self.onehot.zero_()
                self.active = False
            return
        slots = [s for s, tokens in zip(step.adapters, step.token_ids) for _ in tokens]
        rows = [i for i, s in enumerate(slots) if s >= 0]
        self.onehot.zero_()
        self.active = True
        if rows:
            self.onehot[host_to_device(rows, torch.long, self.device, False),
                        host_to_device([slots[i] for i in rows], torch.long, self.device, False)] = 1.0
