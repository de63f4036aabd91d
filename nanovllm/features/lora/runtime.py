"""LoRA on one rank (core/hooks.py's Adapters): every decoder layer's qkv / o / gate_up / down
projection gets `max_loras` adapter slots (stacks.py) and a method that adds each token's
update to the layer's own product (the layer's quantization method, if any, still computes
that); before each forward, the step's adapters are loaded into their slots (each rank reads
the adapter folder itself, kept in a host LRU of max_cpu_loras) and persistent buffers tell
every token its slot, so decode and prefill graphs replay with the right adapters: on CUDA the
tokens sorted by slot in tiles for the shrink / expand kernels (kernels/lora.py), which read
only the slots in use; on CPU one-hot rows for the plain-torch product over every slot.
"""

from __future__ import annotations

import functools
from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F

from nanovllm.features.lora.adapter import TARGETS, LoraAdapter, load_adapter
from nanovllm.features.lora.stacks import LoraStack
from nanovllm.kernels.lora import LoraTiles, lora_expand, lora_shrink
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
        tiles = self.runtime.tiles
        if tiles is None:  # (CPU: the plain-torch product over every slot)
            return y + self.stack.delta(flat, self.runtime.onehot[:flat.shape[0]]).view_as(y)
        y = y.contiguous()
        s = self.stack
        lora_expand(lora_shrink(flat, s.a.view(s.slots, -1, s.a.shape[1]), tiles), s.b, y.view(-1, y.shape[-1]), tiles)
        return y


class LoraRuntime:
    @classmethod
    def factory(cls, lora_config, hf_config):
        """What Config carries to every rank: (model runner, most tokens a step holds) -> runtime."""
        return functools.partial(cls, lora_config)

    def __init__(self, lora_config, runner, max_tokens: int):
        self.config, self.device, self.tp, self.dtype = lora_config, runner.device, runner.tp, runner.config.dtype
        # Each token's slot: on CUDA as tiles of tokens sorted by slot (the Triton kernels), on
        # CPU as one-hot rows (the plain-torch product).
        cuda = self.device.type == "cuda"
        self.tiles = LoraTiles.allocate(max_tokens, lora_config.max_loras, self.device) if cuda else None
        self.onehot = None if cuda else torch.zeros(max_tokens, lora_config.max_loras, device=self.device)
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
                self._set_slots(np.full(0, -1))
                self.active = False
            return
        self.active = True
        self._set_slots(np.repeat(np.asarray(step.adapters), [len(t) for t in step.token_ids]))

    def _set_slots(self, token_slots: np.ndarray) -> None:
        """Every token's slot (-1: none) for this step's forward."""
        pin = self.device.type == "cuda"
        if self.tiles is not None:
            order, table = LoraTiles.plan(token_slots, self.tiles.table.shape[1])
            self.tiles.write(host_to_device(np.concatenate([order, table.ravel()]), torch.int32, self.device, pin),
                             len(order))
            return
        self.onehot.zero_()
        rows = np.flatnonzero(token_slots >= 0)
        if len(rows):
            self.onehot[host_to_device(rows, torch.long, self.device, pin),
                        host_to_device(token_slots[rows], torch.long, self.device, pin)] = 1.0
