"""Paged attention: one `Attention` layer, three interchangeable backends behind it.

Every backend computes the same function: each new token attends causally to its sequence's
K/V, which live in a paged cache `[num_blocks, block_size, num_kv_heads, head_dim]` (one per
layer for K and for V). Causality is aligned bottom-right: with `c` cached tokens, new token
`j` sees K/V positions `0 .. c + j`. The backend is chosen once per engine (`select_backend`).

- `torch`:      CPU reference; SDPA over K/V gathered through the block table.
- `triton`:     CUDA without flash-attn; PyTorch's bundled FlashAttention-2 varlen kernel for
                prefill and our Triton split-KV kernel for decode.
- `flash_attn`: the flash-attn package (nano-vllm's calls), when importable.

FP8 KV cache (vLLM's semantics, `kv_cache_dtype="fp8"`): the caches hold float8_e4m3fn,
stored = clamp(k / k_scale, -448, 448) and read back as stored.float() * k_scale (V likewise),
with one fp32 K and V scale per layer (`Attention.k_scale` / `v_scale`). Every backend attends
over the values the cache gives back, also where it could use this step's K/V directly (a
prefill without cached tokens): a prefix hit, a later chunk or a recomputed sequence then sees
bitwise the same K/V as the first computation did. The flash_attn backend takes no FP8 cache.
"""

from __future__ import annotations

import importlib
import itertools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.fp8_format import FP8_MAX
from nanovllm.model.context import AttentionMetadata

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- helpers
# Calibration headroom R: scale = amax / R, so the calibrating prefill's largest |K| is stored
# as R (of e4m3's 448) and later tokens may be 448 / R times larger before they saturate. One
# prefill is a small sample (other prompts and later positions can exceed its amax), and a
# saturated value's error is unbounded, while a smaller R is nearly free: e4m3 is floating
# point, its relative rounding (<= 2**-4) is the same at every magnitude down to its smallest
# normal 2**-6, so only values below amax * 2**-6 / R (amax/12800 for K, amax/6400 for V) lose
# precision, and they add at most that fraction of amax to a dot product. We take vLLM's
# defaults (K_SCALE_CONSTANT 200, V_SCALE_CONSTANT 100: 2.2x headroom for K, 4.5x for V) so
# that scales calibrated here and by vLLM agree.
K_SCALE_HEADROOM = 200.0
V_SCALE_HEADROOM = 100.0
_KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for LLM(kv_cache_dtype=...): "auto" -> the model's dtype,
    "fp8" / "fp8_e4m3" -> torch.float8_e4m3fn (vLLM's names). Anything else (fp8_e5m2
    included) is a ValueError."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in _KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; use one of "
                         f"{', '.join(map(repr, _KV_CACHE_DTYPES))}")
    return _KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def fp8_kv(k_cache: torch.Tensor, k_scale, v_scale) -> bool:
    """True for an FP8 cache; checks that the scales come with it and only with it."""
    from nanovllm.kernels.kv_store import check_kv_scales

    return check_kv_scales(k_cache, k_scale, v_scale)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x as an FP8 cache stores it: clamp(x.float() / scale, -448, 448) in e4m3 (round to
    nearest even). The clamp comes first: torch's cast turns values beyond 448 into NaN."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cached K or V as attention reads it: FP8 rows times `scale` in fp32, then rounded to
    `dtype` (q's); rows of any other dtype unchanged."""
    if x.dtype != torch.float8_e4m3fn:
        return x
    return (x.float() * scale).to(dtype)


def store_kvcache_torch(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Reference KV store: scatter each token's K/V into its slot (slot -1 = skip), quantized
    as `quantize_kv` says when the cache is FP8."""
    if fp8_kv(k_cache, k_scale, v_scale):
        k, v = quantize_kv(k, k_scale), quantize_kv(v, v_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def round_trip_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """This step's K or V as an FP8 cache will give it back, for a prefill that attends to
    it without reading the cache."""
    return dequantize_kv(quantize_kv(x, scale), scale, dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence: [length, num_kv_heads, head_dim]."""
    block_size = cache.size(1)
    num_blocks = -(-length // block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:length]


def gather_kv_varlen(cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     total: int) -> torch.Tensor:
    """The cached K (or V) of several sequences packed varlen as `cu_seqlens_k` describes.

    Vectorised (no per-sequence loop): token t of sequence i is slot
    block_tables[i, t // block_size] * block_size + t % block_size.
    """
    block_size = cache.size(1)
    kv_lens = cu_seqlens_k.diff().long()
    seq_idx = torch.repeat_interleave(torch.arange(kv_lens.numel(), device=cache.device), kv_lens,
                                      output_size=total)
    pos = torch.arange(total, device=cache.device) - cu_seqlens_k[seq_idx]
    blocks = block_tables[seq_idx, pos // block_size].long()
    return cache.view(-1, *cache.shape[2:])[blocks * block_size + pos % block_size]


def groups_of_at_most(lengths: list[int], limit: int):
    """Consecutive index ranges [a, b) whose lengths sum to <= limit (a single longer one alone)."""
    a, total = 0, 0
    for i, n in enumerate(lengths):
        if total and total + n > limit:
            yield a, i
            a, total = i, 0
        total += n
    if a < len(lengths):
        yield a, len(lengths)


# ---------------------------------------------------------------------------- backends
class TorchBackend:
    """Reference backend for CPU (and for checking the others): loops over sequences."""

    name = "torch"

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        store_kvcache_torch(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                k_scale=None, v_scale=None) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        fp8 = fp8_kv(k_cache, k_scale, v_scale)
        # Without cached tokens a prefill attends only to this step's K/V: no cache read needed.
        fresh = meta.is_prefill and not meta.has_prefix
        if fresh and fp8:
            k, v = round_trip_kv(k, k_scale, q.dtype), round_trip_kv(v, v_scale, q.dtype)
        for i, (n_q, n_k) in enumerate(zip(meta.query_lens, meta.kv_lens)):
            if n_q == 0:
                continue
            qi = q[start:start + n_q].transpose(0, 1)                    # [H, n_q, D]
            if fresh:
                ki = k[start:start + n_q].transpose(0, 1)
                vi = v[start:start + n_q].transpose(0, 1)
            else:
                ki = dequantize_kv(gather_kv(k_cache, meta.block_tables[i], n_k), k_scale, q.dtype).transpose(0, 1)
                vi = dequantize_kv(gather_kv(v_cache, meta.block_tables[i], n_k), v_scale, q.dtype).transpose(0, 1)
            group = qi.size(0) // ki.size(0)
            ki = ki.repeat_interleave(group, dim=0)
            vi = vi.repeat_interleave(group, dim=0)
            # Bottom-right causal mask: query j sits at absolute position n_k - n_q + j.
            qpos = torch.arange(n_k - n_q, n_k, device=q.device).unsqueeze(1)
            mask = torch.arange(n_k, device=q.device).unsqueeze(0) <= qpos
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
            out[start:start + n_q] = oi.transpose(0, 1)
            start += n_q
        return out


class _TritonKVStore:
    """CUDA backends write K/V into the paged cache with the Triton store kernel."""

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        from nanovllm.kernels.kv_store import store_kvcache

        store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


class TritonBackend(_TritonKVStore):
    """CUDA without flash-attn: aten's FlashAttention-2 varlen prefill, Triton paged decode."""

    name = "triton"
    GATHER_TOKENS = 1 << 16  # K/V tokens gathered per group: 256 MiB of K+V at 8 heads x 128 in bf16

    def __init__(self):
        from nanovllm.kernels.paged_decode import paged_decode_attention

        self._decode = paged_decode_attention
        self._reference = TorchBackend()

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                k_scale=None, v_scale=None) -> torch.Tensor:
        if not meta.is_prefill:
            return self._decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                num_splits=meta.num_splits, k_scale=k_scale, v_scale=v_scale)
        if meta.num_decode_rows:
            return self._mixed(q, k, v, k_cache, v_cache, meta, scale, k_scale, v_scale)
        if q.dtype == torch.float32:
            # aten's FlashAttention kernel takes only fp16/bf16; fp32 (tests) uses the reference.
            return self._reference.forward(q, k, v, k_cache, v_cache, meta, scale, k_scale, v_scale)
        fp8 = fp8_kv(k_cache, k_scale, v_scale)
        if not meta.has_prefix:
            if fp8:
                k, v = round_trip_kv(k, k_scale, q.dtype), round_trip_kv(v, v_scale, q.dtype)
            return self._flash(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q,
                               meta.max_seqlen_k, scale)
        # Cached prefix + new tokens: aten's kernel has no block table, so read each context back
        # from the paged cache (the new tokens were stored there a moment ago) as contiguous
        # varlen K/V. Prefix hits make contexts much longer than the step's token budget (say
        # 512 requests behind one 4k-token system prompt), so gather a bounded group at a time.
        # An FP8 cache is dequantized group by group (a transient fp32 copy of the group).
        out = torch.empty_like(q)
        cu_q_host = [0, *itertools.accumulate(meta.query_lens)]
        for a, b in groups_of_at_most(meta.kv_lens, self.GATHER_TOKENS):
            cu_q = meta.cu_seqlens_q[a:b + 1] - meta.cu_seqlens_q[a]
            cu_k = meta.cu_seqlens_k[a:b + 1] - meta.cu_seqlens_k[a]
            total = sum(meta.kv_lens[a:b])
            kk = dequantize_kv(gather_kv_varlen(k_cache, meta.block_tables[a:b], cu_k, total), k_scale, q.dtype)
            vv = dequantize_kv(gather_kv_varlen(v_cache, meta.block_tables[a:b], cu_k, total), v_scale, q.dtype)
            rows = slice(cu_q_host[a], cu_q_host[b])
            out[rows] = self._flash(q[rows], kk, vv, cu_q, cu_k, max(meta.query_lens[a:b]), max(meta.kv_lens[a:b]),
                                    scale)
        return out

    def _mixed(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale, v_scale):
        """A prefill step whose last rows are one-token decode rows (a mixed step): those attend
        through the paged decode kernel, reading the cache in place as a decode step does; the
        prefill path would first gather each one's whole context into a contiguous copy."""
        d = meta.num_decode_rows
        p, t = len(meta.query_lens) - d, q.size(0) - d  # prefill rows, and their packed tokens
        out = torch.empty_like(q)
        out[t:] = self._decode(q[t:], k_cache, v_cache, meta.block_tables[p:], meta.context_lens[p:], scale,
                               num_splits=meta.num_splits, k_scale=k_scale, v_scale=v_scale)
        if p:
            out[:t] = self.forward(q[:t], k[:t], v[:t], k_cache, v_cache, meta.prefill_part(), scale, k_scale, v_scale)
        return out

    @staticmethod
    def _flash(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        return torch.ops.aten._flash_attention_forward(q, k, v.contiguous(), cu_q, cu_k, max_q, max_k, 0.0, True,
                                                      False, scale=scale)[0]


class FlashAttnBackend(_TritonKVStore):
    """The flash-attn package: varlen prefill (paged via block_table on prefix hits), paged decode.

    Takes no FP8 KV cache (a ValueError): flash-attn is not installed on our GPU, so no such
    path could be tested."""

    name = "flash_attn"

    def __init__(self, module=None):
        fa = module or importlib.import_module("flash_attn")
        self.varlen = fa.flash_attn_varlen_func
        self.with_kvcache = fa.flash_attn_with_kvcache

    @staticmethod
    def _refuse_fp8(k_cache):
        if k_cache.dtype == torch.float8_e4m3fn:
            raise ValueError("the flash_attn attention backend does not support an FP8 KV cache; "
                             "use attention_backend='triton' (or kv_cache_dtype='auto')")

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        self._refuse_fp8(k_cache)
        super().store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                k_scale=None, v_scale=None) -> torch.Tensor:
        self._refuse_fp8(k_cache)
        if meta.is_prefill:
            if meta.has_prefix:
                k, v, block_table = k_cache, v_cache, meta.block_tables
            else:
                block_table = None
            return self.varlen(q, k, v, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
                               max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                               softmax_scale=scale, causal=True, block_table=block_table)
        out = self.with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens,
                                block_table=meta.block_tables, softmax_scale=scale, causal=True)
        return out.squeeze(1)


def flash_attn_available() -> bool:
    try:
        importlib.import_module("flash_attn")
        return True
    except Exception:
        return False


def select_backend(device: str, block_size: int, forced: str | None = None, kv_cache_dtype: str = "auto"):
    """Pick the attention backend once per engine (see module docstring for the order); an FP8
    KV cache (kv_cache_dtype "fp8" / "fp8_e4m3") never gets flash_attn."""
    fp8 = kv_cache_torch_dtype(kv_cache_dtype, torch.float32) == torch.float8_e4m3fn
    if forced is not None:
        if forced != "torch" and device != "cuda":
            raise ValueError(f"attention_backend={forced!r} needs CUDA; this engine runs on {device}")
        if forced == "flash_attn" and block_size % 256:
            raise ValueError(f"attention_backend='flash_attn' needs kvcache_block_size to be a multiple "
                             f"of 256, got {block_size}")
        if forced == "flash_attn" and fp8:
            raise ValueError(f"attention_backend='flash_attn' does not support kv_cache_dtype={kv_cache_dtype!r}; "
                             f"use attention_backend='triton'")
        name = forced
    elif device != "cuda":
        name = "torch"
    elif flash_attn_available() and block_size % 256 == 0 and not fp8:
        name = "flash_attn"
    else:
        name = "triton"
    backend = {"torch": TorchBackend, "triton": TritonBackend, "flash_attn": FlashAttnBackend}[name]()
    logger.info("attention backend: %s", name)
    return backend


# ---------------------------------------------------------------------------- the layer
class Attention(nn.Module):
    """Stores this step's K/V into the layer's paged cache, then attends through the backend.

    q: [tokens, num_heads, head_dim]; k, v: [tokens, num_kv_heads, head_dim].
    `k_cache` / `v_cache` are assigned by the ModelRunner once the cache is allocated; when
    they are float8_e4m3fn, the layer's `k_scale` / `v_scale` buffers (fp32 [1], default 1.0;
    set them in place, e.g. from a checkpoint, with `.copy_()`: the kernels and CUDA graphs
    hold their addresses) quantize and dequantize them. With `calibrate_next_prefill` set,
    the next prefill first calibrates the scales from its own K/V (`calibrate_kv_scales`),
    then clears the flag.

    `fuse_kv_store` (set by the ModelRunner from Config.fuse_kv_store): the caller may store
    this step's K/V itself while producing them (the decoder's q/k-norm + RoPE kernel, given
    `fused_store_args`) and then pass kv_stored=True, so that the layer skips its own store.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])
        self.backend = None
        # Not in the state dict: the loader decides where checkpoint scales come from.
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.calibrate_next_prefill = False
        self.fuse_kv_store = False
        # While piecewise prefill graphs are captured (engine/prefill_graphs.py): called instead
        # of attending, with forward's arguments and this layer first; it returns the output.
        self.graph_break = None

    def fused_store_args(self, meta: AttentionMetadata) -> dict:
        """Keyword arguments that make `qk_norm_rope` (kernels/fused_ops.py) store this step's
        K/V into the layer's cache (then call forward with kv_stored=True), or {} when the layer
        must store them itself: fusion off, no cache yet (the start-up forwards), or a prefill
        that first calibrates the FP8 scales from its K/V."""
        if not self.fuse_kv_store or not self.k_cache.numel() or (self.calibrate_next_prefill and meta.is_prefill):
            return {}
        args = dict(k_cache=self.k_cache, v_cache=self.v_cache, slot_mapping=meta.slot_mapping)
        if self.k_cache.dtype == torch.float8_e4m3fn:
            args.update(k_scale=self.k_scale, v_scale=self.v_scale)
        return args

    @torch.no_grad()
    def calibrate_kv_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k_scale = amax|k| / K_SCALE_HEADROOM, v_scale = amax|v| / V_SCALE_HEADROOM, computed
        and written on the device (no host sync). An all-zero or non-finite amax gives a
        scale of 1.0 instead (dividing by 0 would turn every stored value into NaN)."""
        for x, buf, headroom in ((k, self.k_scale, K_SCALE_HEADROOM), (v, self.v_scale, V_SCALE_HEADROOM)):
            s = x.abs().amax().float().reshape(1) / headroom
            buf.copy_(torch.where(torch.isfinite(s) & (s > 0), s, 1.0))

    def forward(self, q, k, v, meta: AttentionMetadata, kv_stored: bool = False) -> torch.Tensor:
        """Attention output [tokens, num_heads, head_dim]; kv_stored: the caller already wrote
        k and v into the cache (with fused_store_args)."""
        if self.graph_break is not None:
            return self.graph_break(self, q, k, v, meta, kv_stored)
        if self.calibrate_next_prefill and meta.is_prefill and k.numel():
            self.calibrate_kv_scales(k, v)
            self.calibrate_next_prefill = False
            # Whatever the caller stored went in with the scales of before (a piecewise prefill
            # graph's fused store): store again with the calibrated ones.
            kv_stored = False
        scales = (self.k_scale, self.v_scale) if self.k_cache.dtype == torch.float8_e4m3fn else (None, None)
        if self.k_cache.numel() and not kv_stored:
            self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, *scales)
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, *scales)
