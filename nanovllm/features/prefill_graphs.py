"""Prefill-shaped steps (prompt chunks, mixed steps) as piecewise CUDA graphs: the forward
strategy (core/hooks.py) `PrefillGraphStrategy`, which features.forward_strategy wires in.

A prefill step's attention depends on how its tokens split into sequences (varlen lengths,
cached prefixes, decode rows), so it has no fixed shape to capture; the rest of each layer
(norms, GEMMs, RoPE, the MLP or MoE) depends only on the number of tokens. So for a few token
counts (buckets) the forward is captured in pieces cut at every attention call: piece 0 runs
from the embedding to layer 0's q/k/v, piece i from layer i-1's attention output to layer i's
q/k/v, the last one from the last attention output through the final norm. A step of T tokens
replays the pieces of the smallest bucket that holds T, running the real attention eagerly
between them on the first T rows (padding rows are computed, never attended to, never read).

Why it pays: an eager prefill step launches ~15 kernels per layer, each through Python, torch's
dispatcher and cuBLAS's heuristics; on a small model that host work is far longer than the GPU
work, and in a server every arriving request brings such a step (a mixed step), stalling every
running stream for its length. Replayed, a step costs one launch per piece plus the attention
calls. Numbers: BENCHMARKS.md.

The pieces share the decode graphs' memory pool, and are captured on the decode graphs' stream
(the allocator reuses a freed block only for the stream it was allocated on, so a stream per
bucket would stack every bucket's memory). Every replay reads only buffers outside the pool (the
inputs, the q/k/v and attention-output buffers below, weights, KV cache) or what an earlier
piece of the same replay wrote, so graphs may replay in any order. With the K/V store fused into
the q/k-norm + RoPE kernel (on CUDA) a piece also writes the KV cache, at the slots
of a buffer of its own that every replay fills first (-1 for padding rows: nothing stored); the
eager attention after it then skips its store. Padding rows (past the
step's tokens) are reset to token 0 at position 0 with a zero attention output on every
replay, so what they compute never depends on earlier steps (a per-tensor FP8 activation scale
sees them too, as it sees a decode graph's padding rows).

Decode rows inside the pieces (`decode_rows` > 0: the triton backend with the store fused). A
mixed step's decode rows (one new token each, attending over their cache, the step's last rows)
need no varlen shapes: each bucket's pieces also run the paged decode kernel over the bucket's
last `decode_rows` rows, at the end of every piece, on a block table and context lengths of
their own that every replay fills (length 0 for rows that are not decode rows: a zero output,
no cache read). A step that fits puts its prefill tokens first and its decode rows last in the
bucket, padding between them, and runs only the prefill rows' attention eagerly. Why: the eager
decode-row attention (two Triton launches and their checks, copies) cost more host time per layer
than the layer's GPU work, so a small model's mixed step waited on the host, and a server runs
such a step for every arriving request. Steps that do not fit (more decode rows, an FP8 scale
calibration pending) leave the decode kernel's table empty and attend eagerly as before.
Numbers: BENCHMARKS.md.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field

import torch

from nanovllm.kernels.paged_decode import paged_decode_attention
from nanovllm.model.attention import prefill_metadata
from nanovllm.model.attention.triton_backend import prefill_part

logger = logging.getLogger(__name__)


def prefill_graph_tokens(config) -> int:
    """The largest prefill step the engine replays as graphs under `config` (0: none): the
    max_prefill_graph_tokens cap within the step budget; none with enforce_eager."""
    if config.enforce_eager:
        return 0
    return min(config.prefill_graphs.max_tokens, config.max_num_batched_tokens)


class PrefillGraphStrategy:
    """The forward strategy (core/hooks.py) that replays prefill steps of up to
    `max_prefill_tokens` tokens as piecewise graphs (`graphs`, made by `prepare`)."""

    def __init__(self, max_prefill_tokens: int):
        self.max_prefill_tokens = max_prefill_tokens
        self.graphs: PrefillGraphs | None = None

    def prepare(self, runner) -> bool:
        """Capture the pieces on the runner's model, in its decode graphs' pool and stream; False
        when its attention layers are of several shapes."""
        if not PrefillGraphs.supports(runner.attn_layers):
            return False
        config, tokens = runner.config, self.max_prefill_tokens
        # A mixed step's decode rows attend inside the pieces where the pieces also store their
        # K/V (the fused store) and the triton backend gives them the paged decode kernel. At
        # most 256 of them: every replay runs the kernel over all those rows (empty ones exit at
        # once), and a step with more decode rows is GPU-bound anyway, its host time hidden.
        decode_rows = min(config.max_num_seqs, tokens, 256) if runner.backend.name == "triton" else 0
        self.graphs = PrefillGraphs(runner.model, runner.attn_layers, tokens, config.hf_config.hidden_size,
                                    config.dtype, runner.device, pool=runner.graphs.pool, stream=runner.graphs.stream,
                                    decode_rows=decode_rows, decode_splits=runner.inputs.num_splits,
                                    max_blocks=math.ceil(config.max_model_len / config.kvcache_block_size))
        return True

    def runs_prefill(self, num_tokens: int) -> bool:
        return self.graphs.bucket_for(num_tokens) is not None

    def run_prefill(self, ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        return self.graphs.run(ids, positions, meta)


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """Token buckets up to `max_tokens`: powers of two from 16 to 256, then steps of 256 (padding
    wastes at most a quarter below 1,024 tokens and an eighth above 2,048)."""
    if max_tokens < 1:
        return []
    sizes = [s for s in (16, 32, 64, 128) if s < max_tokens] + list(range(256, max_tokens, 256))
    return sizes + [max_tokens]


@dataclass
class _Bucket:
    """One bucket's pieces and, between them, the attention layers they stop at (and whether the
    piece before each stored that layer's K/V: the fused store)."""

    pieces: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    layers: list[torch.nn.Module] = field(default_factory=list)
    kv_stored: list[bool] = field(default_factory=list)
    decode_rows: int = 0  # the pieces attend the bucket's last this many rows as decode rows


class PrefillGraphs:
    """Piecewise graphs of `model`'s forward for prefill-shaped steps of up to `max_tokens`
    tokens (see the module docstring). `attn_layers` are the model's Attention modules in
    forward order, all with the same head counts and size; `pool`, `stream`: the memory pool to
    capture into and the stream to capture on (the decode graphs'). `decode_rows` > 0: the
    pieces also attend up to that many trailing decode rows (the paged decode kernel, over block
    tables `max_blocks` wide, in `decode_splits(rows)` splits); only where the K/V store is
    fused into the pieces."""

    @staticmethod
    def supports(attn_layers) -> bool:
        """Whether the layers' attention calls can hand q/k/v over in one set of buffers: every
        layer has the same head counts and head size."""
        return len({(a.num_heads, a.num_kv_heads, a.head_dim) for a in attn_layers}) == 1

    def __init__(self, model, attn_layers, max_tokens: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, pool=None, stream: torch.cuda.Stream | None = None,
                 decode_rows: int = 0, max_blocks: int = 0, decode_splits=None):
        if not self.supports(attn_layers):
            shapes = sorted({(a.num_heads, a.num_kv_heads, a.head_dim) for a in attn_layers})
            raise ValueError(f"piecewise prefill graphs need every attention layer of one shape, got {shapes}")
        self.model, self.attn_layers = model, attn_layers
        self.stream = stream if stream is not None else torch.cuda.Stream()
        self.sizes = prefill_graph_sizes(max_tokens)
        n = self.sizes[-1]
        first = attn_layers[0]
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int32, device=device)  # for a fused K/V store
        self.q = torch.zeros(n, first.num_heads, first.head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(n, first.num_kv_heads, first.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.attn_out = torch.zeros_like(self.q)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        if decode_rows and not all(a.k_cache.numel() for a in attn_layers):
            logger.info("a mixed step's decode rows attend eagerly: the pieces do not store K/V themselves")
            decode_rows = 0  # (the baked decode kernel would read the cache before the eager store)
        self.decode_rows, self.decode_splits = decode_rows, decode_splits
        rows = min(decode_rows, n)
        self.dec_tables = torch.zeros(rows, max(max_blocks, 1), dtype=torch.int32, device=device)
        self.dec_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.buckets: dict[int, _Bucket] = {}
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first: the pool grows once
                try:
                    self.buckets[size] = self._capture(size)
                except Exception as e:
                    raise RuntimeError(f"capturing the piecewise prefill graph of {size} tokens failed ({e!r}); "
                                       "LLM(max_prefill_graph_tokens=0) runs prefill steps eagerly") from e
        logger.info("captured piecewise prefill graphs for %s tokens", self.sizes)

    def bucket_for(self, num_tokens: int) -> int | None:
        """The smallest bucket that holds `num_tokens`, or None (run eagerly)."""
        return next((s for s in self.sizes if s >= num_tokens), None)

    def _capture(self, n: int) -> _Bucket:
        # Warm-up outside the graphs (Triton compiles, cuBLAS picks its kernels for M = n): a
        # plain eager forward of one n-token sequence that stores nothing (slots -1). The
        # capture's slots are the slot buffer's: a fused store replays with the step's.
        self.slots[:n].fill_(-1)
        meta = prefill_metadata([n], [n], self.slots[:n], None, self.ids.device)
        self.model(self.ids[:n], self.positions[:n], meta)
        d = min(self.decode_rows, n)
        bucket = _Bucket(decode_rows=d)
        self.dec_lens.zero_()
        if d:
            self._attend_decode_rows(self.attn_layers[0], n, d)  # (compiles the kernels outside the capture)
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()

        def cut(layer, q, k, v, _meta, kv_stored):
            # End the running piece with q/k/v in the buffers the eager attention will read,
            # and start the next one on the buffer that attention will write.
            nonlocal graph
            self.q[:n].copy_(q)
            self.k[:n].copy_(k)
            self.v[:n].copy_(v)
            if bucket.decode_rows and not kv_stored:
                raise RuntimeError("decode rows inside the pieces need the K/V store fused into them")
            if bucket.decode_rows:
                self._attend_decode_rows(layer, n, bucket.decode_rows)
            graph.capture_end()
            bucket.pieces.append(graph)
            bucket.layers.append(layer)
            bucket.kv_stored.append(kv_stored)
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)
            return self.attn_out[:n]

        for layer in self.attn_layers:
            layer.graph_break = cut
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=self.pool)
                try:
                    self.hidden[:n].copy_(self.model(self.ids[:n], self.positions[:n], meta))
                    graph.capture_end()
                except BaseException:
                    # Never leave the stream capturing: every later CUDA call would fail too.
                    if torch.cuda.is_current_stream_capturing():
                        with contextlib.suppress(Exception):
                            graph.capture_end()
                    raise
                bucket.pieces.append(graph)
        finally:
            for layer in self.attn_layers:
                layer.graph_break = None
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        if len(bucket.layers) != len(self.attn_layers):
            raise RuntimeError(f"the forward called attention {len(bucket.layers)} times, "
                               f"not once per layer ({len(self.attn_layers)})")
        return bucket

    def _attend_decode_rows(self, layer, n: int, d: int) -> None:
        """The paged decode kernel over rows [n - d, n) of the q buffer, into the same rows of
        the attention output, on the decode-row tables (captured into the pieces)."""
        fp8 = layer.k_cache.dtype == torch.float8_e4m3fn
        paged_decode_attention(self.q[n - d:n], layer.k_cache, layer.v_cache, self.dec_tables[:d], self.dec_lens[:d],
                               layer.scale, num_splits=self.decode_splits(min(d, 64), self.dec_tables.size(1)),
                               out=self.attn_out[n - d:n], k_scale=layer.k_scale if fp8 else None,
                               v_scale=layer.v_scale if fp8 else None)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The model's final hidden states [T, hidden] for a prefill step of T = len(ids) tokens
        (at most the largest bucket): the same as model(ids, positions, meta). The result is a
        view of a buffer the next step overwrites (or, with decode rows in the pieces, a new
        tensor)."""
        t = ids.numel()
        n = self.bucket_for(t)
        bucket = self.buckets[n]
        d = meta.num_decode_rows
        if bucket.decode_rows:
            if 0 < d <= bucket.decode_rows and not any(layer.calibrate_next_prefill for layer in bucket.layers):
                return self._run_with_decode_rows(bucket, n, ids, positions, meta)
            self.dec_lens.zero_()  # (the pieces' decode kernel then writes zeros, which attention below overwrites)
        self.ids[:t].copy_(ids)
        self.positions[:t].copy_(positions)
        self.slots[:t].copy_(meta.slot_mapping)
        if t < n:  # padding rows: the same inputs on every replay (see the module docstring)
            self.ids[t:n].zero_()
            self.positions[t:n].zero_()
            self.slots[t:n].fill_(-1)
            self.attn_out[t:n].zero_()
        q, k, v = self.q[:t], self.k[:t], self.v[:t]
        for piece, layer, stored in zip(bucket.pieces, bucket.layers, bucket.kv_stored):
            piece.replay()
            self.attn_out[:t].copy_(layer(q, k, v, meta, kv_stored=stored))
        bucket.pieces[-1].replay()
        return self.hidden[:t]

    def _run_with_decode_rows(self, bucket: _Bucket, n: int, ids, positions, meta) -> torch.Tensor:
        """run() for a step whose last d rows the pieces attend: prefill tokens at [0, p), decode
        rows at [n - d, n), padding between; eager attention for the prefill tokens only."""
        d, t = meta.num_decode_rows, ids.numel()
        p = t - d  # prefill tokens
        rows = bucket.decode_rows
        for buf, src, pad in ((self.ids, ids, 0), (self.positions, positions, 0), (self.slots, meta.slot_mapping, -1)):
            buf[:p].copy_(src[:p])
            buf[n - d:n].copy_(src[p:])
            buf[p:n - d].fill_(pad)
        self.attn_out[p:n - d].zero_()  # padding rows: zero attention output (the decode kernel zeroes its own)
        seqs = len(meta.query_lens) - d
        width = meta.block_tables.size(1)
        self.dec_lens[:rows - d].zero_()
        self.dec_lens[rows - d:rows].copy_(meta.context_lens[seqs:])
        self.dec_tables[rows - d:rows, :width].copy_(meta.block_tables[seqs:])
        head = prefill_part(meta) if seqs else None  # (once for all layers)
        q, k, v, out = self.q[:p], self.k[:p], self.v[:p], self.attn_out[:p]
        for piece, layer in zip(bucket.pieces, bucket.layers):
            piece.replay()
            if head is not None:
                out.copy_(layer(q, k, v, head, kv_stored=True))
        bucket.pieces[-1].replay()
        return torch.cat((self.hidden[:p], self.hidden[n - d:n]))
