"""What an EAGLE-3 head reads from the target: the residual stream entering chosen decoder layers
(the hidden state + the residual of the layer before; 0 is the embeddings), kept at every forward
by pre-hooks on those layers, in one fixed buffer: fixed, so that the CUDA graphs captured after
(decode, piecewise prefill) write it as they replay."""

from __future__ import annotations

from functools import partial

import torch

from nanovllm.parallel.group import current_tp_group


class LayerInputs:
    """Keeps the inputs of `layers` of `decoder` (model/decoder.py's DecoderModel) for forwards of
    up to `max_tokens` tokens (a longer one, such as score(), keeps none)."""

    def __init__(self, decoder, layers: tuple[int, ...], max_tokens: int):
        if current_tp_group().size > 1:
            raise NotImplementedError("keeping layer inputs with tensor parallelism (partial sums per rank)")
        if not layers or any(not 0 <= i < len(decoder.layers) for i in layers):
            raise ValueError(f"layers {layers}: must be some of 0..{len(decoder.layers) - 1}")
        weight = decoder.embed_tokens.weight
        self.layers = tuple(layers)
        self.buffer = torch.zeros(max_tokens, len(layers), weight.shape[1], dtype=weight.dtype, device=weight.device)
        for slot, i in enumerate(layers):
            decoder.layers[i].register_forward_pre_hook(partial(self._keep, slot))

    def _keep(self, slot: int, _layer, args) -> None:
        _, hidden, residual, _ = args  # DecoderLayer.forward(positions, hidden, residual, meta)
        n = hidden.shape[0]
        if n <= len(self.buffer):
            out = self.buffer[:n, slot]
            out.copy_(hidden) if residual is None else torch.add(hidden, residual, out=out)

    def rows(self, n: int) -> torch.Tensor:
        """The last forward's first `n` rows: [n, len(layers) x hidden], the layers in order."""
        return self.buffer[:n].flatten(1)
