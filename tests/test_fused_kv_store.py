"""The KV-cache store fused into the q/k-norm + RoPE kernel (qk_norm_rope with k_cache /
v_cache): its q, k, v and the caches it writes must be bitwise what the two separate kernels
(qk_norm_rope, then store_kvcache) give, for caches of the activation dtype and FP8, slots of
-1 (skipped), GQA and rotary-only models; and the caches must also be bitwise what the plain
torch store (store_kvcache_torch: index assignment, torch's e4m3 cast) writes from the
unfused kernel's k and v.

Without CUDA the kernels run through Triton's interpreter (fp32 / fp16 only: it rounds bf16
wrongly); the `gpu` tests use bf16 and real Qwen3 sizes, in a CUDA graph too. Fresh random
inputs every run (the seed is printed); caches and outputs start poisoned (NaN), so an element
written where it should not be, or left unwritten, shows up.
"""

from __future__ import annotations

import pytest
import torch

from nanovllm.kernels.qk_norm_rope import qk_norm_rope
from nanovllm.kernels.kv_store import store_kvcache
from nanovllm.model.attention.paged_kv import store_kvcache_torch
from nanovllm.model.layers.rotary_embedding import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
EPS = 1e-6

pytestmark = pytest.mark.usefixtures("fresh_seed")  # tests/conftest.py

CONFIGS = [  # (num_heads, num_kv_heads, head_dim, tokens)
    (4, 2, 64, 5),  # GQA
    (8, 8, 128, 2),
    (6, 3, 64, 3),  # kv heads not a power of two: part of every head block is masked
    (2, 1, 16, 4),  # MQA
]


def _poisoned_cache(shape, dtype):
    if dtype == FP8:  # 0x7F: e4m3fn's NaN
        return torch.full(shape, 0x7F, dtype=torch.uint8, device=DEVICE).view(FP8)
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so that NaN == NaN (poison left alone) compares equal."""
    return t.contiguous().view(torch.uint8)


def _inputs(num_heads, num_kv_heads, head_dim, tokens, dtype, norm, num_blocks=4, block_size=8):
    max_pos = 4096
    rotary = RotaryEmbedding(head_dim, max_pos, 1_000_000.0).to(DEVICE)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (2 * torch.randn(tokens, width + 16, device=DEVICE)).to(dtype)[:, :width]  # a strided view
    positions = torch.randint(0, max_pos, (tokens,), device=DEVICE)
    weights = [(1 + 0.2 * torch.randn(head_dim, device=DEVICE)).to(dtype) for _ in range(2)] if norm else [None, None]
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[0] = -1  # a CUDA-graph padding row
    if tokens > 2:
        slots[-1] = -1
    return qkv, weights, rotary.cos_sin, positions, slots, (num_blocks, block_size, num_kv_heads, head_dim)


def _check_fused_store(num_heads, num_kv_heads, head_dim, tokens, dtype, cache_dtype, norm, slot_dtype=torch.int64):
    # Enough slots for every token (the GPU sizes reach 4096 tokens).
    num_blocks = max(4, -(-tokens // 8))
    qkv, (qw, kw), cos_sin, positions, slots, shape = _inputs(num_heads, num_kv_heads, head_dim, tokens, dtype, norm,
                                                              num_blocks=num_blocks)
    slots = slots.to(slot_dtype)
    # FP8: scales that put |k|, |v| (up to ~8) past 448 now and then (saturation), and a
    # non-power-of-two divisor (x / scale rounds before the e4m3 rounding).
    scales = [torch.tensor([s], device=DEVICE) for s in (0.0123, 0.0171)] if cache_dtype == FP8 else [None, None]
    caches = [_poisoned_cache(shape, cache_dtype) for _ in range(6)]
    q, k, v = qk_norm_rope(qkv, qw, kw, cos_sin, positions, num_heads, num_kv_heads, head_dim, EPS,
                           k_cache=caches[0], v_cache=caches[1], slot_mapping=slots, k_scale=scales[0],
                           v_scale=scales[1])
    q_ref, k_ref, v_ref = qk_norm_rope(qkv, qw, kw, cos_sin, positions, num_heads, num_kv_heads, head_dim, EPS)
    store_kvcache(k_ref, v_ref, caches[2], caches[3], slots, *scales)
    store_kvcache_torch(k_ref, v_ref, caches[4], caches[5], slots, *scales)
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(_bits(k), _bits(k_ref))
    assert torch.isfinite(q).all() and torch.isfinite(k).all()
    assert torch.equal(v, v_ref) and v.data_ptr() == v_ref.data_ptr()  # still a view into qkv
    for fused, ref in ((caches[0], caches[2]), (caches[1], caches[3]), (caches[0], caches[4]), (caches[1], caches[5])):
        assert torch.equal(_bits(fused), _bits(ref))
    # Exactly the slots >= 0 were written, whole rows of them; the rest keeps its poison.
    written = ~caches[0].float().isnan().view(-1, num_kv_heads * head_dim).all(-1)
    assert sorted(torch.nonzero(written).flatten().tolist()) == sorted(s for s in slots.tolist() if s >= 0)
    if cache_dtype == FP8:
        stored = caches[0].view(-1, num_kv_heads, head_dim)[slots[slots >= 0].long()].float()
        assert not stored.isnan().any() and (stored.abs() <= 448).all()


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,tokens", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cache", ["same", "fp8"])
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "rotary_only"])
def test_fused_store_equals_the_two_kernels(num_heads, num_kv_heads, head_dim, tokens, dtype, cache, norm):
    _check_fused_store(num_heads, num_kv_heads, head_dim, tokens, dtype, dtype if cache == "same" else FP8, norm)


def test_fused_store_int32_slots_and_no_tokens():
    _check_fused_store(4, 2, 32, 3, torch.float32, torch.float32, True, slot_dtype=torch.int32)
    qkv, (qw, kw), cos_sin, positions, slots, shape = _inputs(4, 2, 32, 3, torch.float32, True)
    cache = _poisoned_cache(shape, torch.float32)
    q, k, v = qk_norm_rope(qkv[:0], qw, kw, cos_sin, positions[:0], 4, 2, 32, EPS, k_cache=cache,
                           v_cache=cache.clone(), slot_mapping=slots[:0])
    assert q.shape == (0, 4, 32) and k.shape == v.shape == (0, 2, 32) and cache.isnan().all()


def test_fused_store_rejects_bad_arguments():
    nh, nkv, d = 4, 2, 32
    qkv, (qw, kw), cos_sin, positions, slots, shape = _inputs(nh, nkv, d, 3, torch.float32, True)
    cache = torch.zeros(shape, device=DEVICE)
    cache8 = torch.zeros(shape, device=DEVICE, dtype=FP8)
    one = torch.ones(1, device=DEVICE)

    def call(**kw_args):
        args = dict(k_cache=cache, v_cache=cache.clone(), slot_mapping=slots)
        args.update(kw_args)
        return qk_norm_rope(qkv, qw, kw, cos_sin, positions, nh, nkv, d, EPS, **args)

    with pytest.raises(ValueError, match="slot_mapping must be"):
        call(slot_mapping=None)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        call(slot_mapping=slots[:2])
    with pytest.raises(ValueError, match="int32 or int64"):
        call(slot_mapping=slots.float())
    with pytest.raises(ValueError, match="k_cache and v_cache must both be"):
        call(v_cache=None)
    with pytest.raises(ValueError, match="do not match"):
        call(k_cache=torch.zeros(4, 8, 1, 64, device=DEVICE), v_cache=torch.zeros(4, 8, 1, 64, device=DEVICE))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        call(k_cache=cache.half(), v_cache=cache.half())
    with pytest.raises(ValueError, match="contiguous"):
        t = torch.zeros(shape[0], shape[1], shape[3], shape[2], device=DEVICE).transpose(2, 3)
        call(k_cache=t, v_cache=t)
    with pytest.raises(ValueError, match="k_scale"):
        call(k_cache=cache8, v_cache=cache8.clone())
    with pytest.raises(ValueError, match="only to an FP8"):
        call(k_scale=one, v_scale=one)
    with pytest.raises(ValueError, match="go with k_cache"):
        qk_norm_rope(qkv, qw, kw, cos_sin, positions, nh, nkv, d, EPS, slot_mapping=slots)


# ----------------------------------------------------------------------------- GPU (bf16, real sizes)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 8), (32, 8), (28, 4)])
@pytest.mark.parametrize("tokens", [1, 256, 4096])
@pytest.mark.parametrize("cache", ["same", "fp8"])
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "rotary_only"])
def test_gpu_fused_store_bf16(num_heads, num_kv_heads, tokens, cache, norm):
    _check_fused_store(num_heads, num_kv_heads, 128, tokens, torch.bfloat16,
                       torch.bfloat16 if cache == "same" else FP8, norm)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["same", "fp8"])
def test_gpu_fused_store_in_cuda_graph(cache):
    """Captured once, replayed on new inputs and new slots (what a decode graph does)."""
    nh, nkv, hd, tokens = 16, 8, 128, 64
    cache_dtype = torch.bfloat16 if cache == "same" else FP8
    qkv, (qw, kw), cos_sin, positions, slots, _ = _inputs(nh, nkv, hd, tokens, torch.bfloat16, True,
                                                          num_blocks=64, block_size=256)
    qkv = qkv.contiguous()
    shape = (64, 256, nkv, hd)
    scales = [torch.tensor([s], device="cuda") for s in (0.0123, 0.0171)] if cache_dtype == FP8 else [None, None]
    k_cache, v_cache = _poisoned_cache(shape, cache_dtype), _poisoned_cache(shape, cache_dtype)

    def run():
        return qk_norm_rope(qkv, qw, kw, cos_sin, positions, nh, nkv, hd, EPS, k_cache=k_cache, v_cache=v_cache,
                            slot_mapping=slots, k_scale=scales[0], v_scale=scales[1])

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, k, _ = run()
    qkv.copy_(torch.randn_like(qkv, dtype=torch.float32))
    positions.copy_(torch.randint(0, 4096, (tokens,), device="cuda"))
    slots.copy_(torch.randperm(64 * 256, device="cuda")[:tokens])
    slots[3] = -1
    k_cache.copy_(_poisoned_cache(shape, cache_dtype))
    v_cache.copy_(_poisoned_cache(shape, cache_dtype))
    graph.replay()
    torch.cuda.synchronize()
    q_ref, k_ref, v_ref = qk_norm_rope(qkv, qw, kw, cos_sin, positions, nh, nkv, hd, EPS)
    k_want, v_want = _poisoned_cache(shape, cache_dtype), _poisoned_cache(shape, cache_dtype)
    store_kvcache(k_ref, v_ref, k_want, v_want, slots, *scales)
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(_bits(k), _bits(k_ref))
    assert torch.equal(_bits(k_cache), _bits(k_want)) and torch.equal(_bits(v_cache), _bits(v_want))
