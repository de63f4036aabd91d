"""Tests for the Triton KV-cache store and paged decode attention kernels.

Without CUDA these run through Triton's interpreter (tests/conftest.py switches it on), so
the CPU shapes are small; the `gpu` tests use bf16 and realistic sizes. Every run draws new
random inputs, and outputs are poisoned with NaN before the kernel runs.
"""

import math
import random

import pytest
import torch

from nanovllm.kernels.kv_store import store_kvcache
from nanovllm.kernels.paged_decode import choose_num_splits, paged_decode_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere in out gives NaN (never passes)."""
    out = out.double().cpu()
    ref = ref.double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- references


def ref_store_kvcache(key, value, k_cache, v_cache, slot_mapping):
    """Plain-torch store: the caches viewed as [num_slots, heads, dim], rows scattered by slot."""
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_flat[slots] = key[keep]
    v_flat[slots] = value[keep]


def ref_paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Plain-torch float64 decode attention, one sequence at a time, on the CPU."""
    q, k_cache, v_cache = (t.double().cpu() for t in (q, k_cache, v_cache))
    block_tables, context_lens = block_tables.cpu(), context_lens.cpu()
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    for b in range(batch):
        ctx = int(context_lens[b])
        if ctx == 0:
            continue
        blocks = block_tables[b, : math.ceil(ctx / block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]
        k = k.repeat_interleave(group, dim=1)  # [ctx, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b], k) * scale
        out[b] = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v)
    return out


# ----------------------------------------------------------------------------- inputs


def make_paged_inputs(context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device):
    """Random q and caches with each sequence's blocks scattered over a shuffled pool.

    Cache entries that no sequence may read (spare blocks, slots past a context length) are
    NaN, and block-table entries past a sequence's blocks are -1, so any stray read shows
    up as NaN in the output or as a bad address.
    """
    batch = len(context_lens)
    blocks_per_seq = [math.ceil(c / block_size) for c in context_lens]
    max_blocks = max(max(blocks_per_seq) + random.randint(0, 2), 1)
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks).tolist()
    block_tables = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    for b, (ctx, nb) in enumerate(zip(context_lens, blocks_per_seq)):
        ids = [perm.pop() for _ in range(nb)]
        block_tables[b, :nb] = torch.tensor(ids, dtype=torch.int32)
        for i, blk in enumerate(ids):
            n = min(block_size, ctx - i * block_size)
            k_cache[blk, :n] = torch.randn(n, num_kv_heads, head_dim)
            v_cache[blk, :n] = torch.randn(n, num_kv_heads, head_dim)
    q = torch.randn(batch, num_heads, head_dim)
    return (
        q.to(device, dtype),
        k_cache.to(device, dtype),
        v_cache.to(device, dtype),
        block_tables.to(device),
        torch.tensor(context_lens, dtype=torch.int32, device=device),
    )


# ----------------------------------------------------------------------------- store_kvcache


@pytest.mark.parametrize(
    "num_kv_heads,head_dim,dtype,slot_dtype,packed",
    [
        (2, 64, torch.float32, torch.int64, False),
        (3, 40, torch.float16, torch.int32, True),  # width 120: not a power of two
        (1, 24, torch.float32, torch.int32, True),
        (4, 32, torch.float16, torch.int64, False),
    ],
)
def test_store_kvcache(num_kv_heads, head_dim, dtype, slot_dtype, packed):
    n, num_blocks, block_size = 11, 5, 16
    if packed:
        # key/value as strided views into a packed qkv projection, like the model produces.
        num_heads = 2 * num_kv_heads
        qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE, dtype=dtype)
        _, key, value = qkv.split(
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
        )
        key = key.view(n, num_kv_heads, head_dim)
        value = value.view(n, num_kv_heads, head_dim)
        assert not key.is_contiguous()
    else:
        key = torch.randn(n, num_kv_heads, head_dim, device=DEVICE, dtype=dtype)
        value = torch.randn(n, num_kv_heads, head_dim, device=DEVICE, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size)[:n]
    slots[torch.rand(n) < 0.3] = -1
    slots[0] = -1
    slot_mapping = slots.to(DEVICE, slot_dtype)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), device=DEVICE, dtype=dtype)
    v_cache = torch.full(shape, float("nan"), device=DEVICE, dtype=dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    ref_store_kvcache(key, value, k_ref, v_ref, slot_mapping)

    # A copy is exact, and skipped or unused slots must still hold their NaN.
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0, equal_nan=True)
    written = int((slots >= 0).sum())
    assert int((~k_cache.isnan()).all(-1).all(-1).sum()) == written


def test_store_kvcache_empty_is_noop():
    k_cache = torch.full((2, 16, 2, 32), float("nan"), device=DEVICE)
    v_cache = k_cache.clone()
    empty = torch.empty(0, 2, 32, device=DEVICE)
    store_kvcache(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert k_cache.isnan().all() and v_cache.isnan().all()


def test_store_kvcache_rejects_bad_arguments():
    key = torch.randn(4, 2, 32, device=DEVICE)
    cache = torch.zeros(2, 16, 2, 32, device=DEVICE)
    slots = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kvcache(key, key, cache, cache.clone(), slots.float())
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kvcache(key, key, cache, cache.clone(), slots[:3])
    with pytest.raises(ValueError, match="dtypes"):
        store_kvcache(key.half(), key.half(), cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="heads"):
        store_kvcache(key, key, torch.zeros(2, 16, 1, 64, device=DEVICE), cache.clone(), slots)
    with pytest.raises(ValueError, match="stride"):
        t = torch.randn(4, 2, 64, device=DEVICE)[..., ::2]
        store_kvcache(t, t, cache, cache.clone(), slots)


# ----------------------------------------------------------------------------- paged decode


def _random_context_lens(batch, block_size, max_ctx):
    """Lengths that include 1, an exact block multiple, 0 and random values."""
    lens = [1, block_size * random.randint(1, max(1, max_ctx // block_size)), 0]
    lens += [random.randint(1, max_ctx) for _ in range(batch - len(lens))]
    random.shuffle(lens)
    return lens


def _check_decode(context_lens, num_heads, num_kv_heads, head_dim, block_size, num_splits, dtype):
    q, k_cache, v_cache, block_tables, ctx = make_paged_inputs(
        context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, DEVICE
    )
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    res = paged_decode_attention(q, k_cache, v_cache, block_tables, ctx, scale, num_splits, out=out)
    assert res is out
    ref = ref_paged_decode(q, k_cache, v_cache, block_tables, ctx, scale)
    assert not out.isnan().any(), "unwritten or NaN output"
    for b, c in enumerate(context_lens):
        if c == 0:
            assert (out[b] == 0).all(), "a context_len 0 row must give zeros"
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err:.2e} >= {tol:.0e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,block_size,max_ctx",
    [
        (8, 8, 16, 90),  # group 1, tiles gather several small blocks
        (8, 4, 32, 150),  # group 2
        (8, 2, 256, 600),  # group 4, one block split into several tiles
        (8, 1, 16, 200),  # group 8, MQA
    ],
)
def test_paged_decode(num_heads, num_kv_heads, block_size, max_ctx, num_splits, dtype):
    lens = _random_context_lens(4, block_size, max_ctx)
    _check_decode(lens, num_heads, num_kv_heads, 64, block_size, num_splits, dtype)


def test_paged_decode_head_dim_128_many_splits():
    # 6 splits of each sequence's own tiles (64 tokens at head_dim 128, fp16), which the table's
    # capacity (640 tokens = 10 tiles) leaves at 6: sequences shorter than 6 tiles have empty
    # splits, which must weigh 0, and a full one splits unevenly (2, 2, 2, 2, 1, 1 tiles).
    lens = [1, 0, 330, 640] + [random.randint(1, 640) for _ in range(4)]
    _check_decode(lens, 4, 2, 128, 16, 6, torch.float16)


def test_paged_decode_without_blocks_gives_zeros():
    q, k_cache, v_cache, block_tables, ctx = make_paged_inputs([0, 0], 2, 1, 32, 16, torch.float32, DEVICE)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, block_tables[:, :0], ctx, 0.2, 4, out=out)
    assert (out == 0).all()


def test_paged_decode_strided_q_and_out():
    batch, num_heads, num_kv_heads, head_dim, block_size = 3, 4, 2, 64, 16
    lens = [5, 33, 48]
    q, k_cache, v_cache, block_tables, ctx = make_paged_inputs(
        lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, DEVICE
    )
    # q as a view into a packed qkv row; out as a view into a wider buffer.
    packed = torch.randn(batch, num_heads + 2, head_dim, device=DEVICE)
    packed[:, :num_heads] = q
    q_view = packed[:, :num_heads]
    out_buf = torch.full((batch, num_heads + 1, head_dim), float("nan"), device=DEVICE)
    out_view = out_buf[:, 1:]
    paged_decode_attention(q_view, k_cache, v_cache, block_tables, ctx, 0.125, 2, out=out_view)
    ref = ref_paged_decode(q, k_cache, v_cache, block_tables, ctx, 0.125)
    assert rel_err(out_view, ref) < 1e-4
    assert out_buf[:, 0].isnan().all(), "wrote outside out"


def test_paged_decode_returns_new_tensor_and_handles_empty_batch():
    q, k_cache, v_cache, block_tables, ctx = make_paged_inputs(
        [20, 7], 2, 1, 32, 16, torch.float32, DEVICE
    )
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, ctx, 0.2, 1)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, ref_paged_decode(q, k_cache, v_cache, block_tables, ctx, 0.2)) < 1e-4
    empty = paged_decode_attention(q[:0], k_cache, v_cache, block_tables[:0], ctx[:0], 0.2, 4)
    assert empty.shape == (0, 2, 32)


def test_paged_decode_rejects_bad_arguments():
    q, k_cache, v_cache, block_tables, ctx = make_paged_inputs(
        [20, 7], 4, 2, 32, 16, torch.float32, DEVICE
    )
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(q[..., :24], k_cache[..., :24].contiguous(),
                               v_cache[..., :24].contiguous(), block_tables, ctx, 0.2, 1)
    with pytest.raises(ValueError, match="block_size"):
        bad = k_cache[:, :12].contiguous()
        paged_decode_attention(q, bad, bad, block_tables, ctx, 0.2, 1)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(q[:, :3], k_cache, v_cache, block_tables, ctx, 0.2, 1)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, k_cache, v_cache, block_tables.long(), ctx, 0.2, 1)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(q, k_cache, v_cache, block_tables, ctx, 0.2, 0)
    with pytest.raises(ValueError, match="out"):
        paged_decode_attention(q, k_cache, v_cache, block_tables, ctx, 0.2, 1, out=q.half())
    many = 65536  # one more row than the grid's second dimension holds
    with pytest.raises(ValueError, match="65535"):
        paged_decode_attention(q[:1].expand(many, -1, -1), k_cache, v_cache, block_tables[:1].expand(many, -1),
                               ctx[:1].expand(many), 0.2, 1)


def test_choose_num_splits():
    for _ in range(200):
        batch = random.randint(1, 512)
        kv_heads = random.choice([1, 2, 4, 8, 16])
        max_blocks = random.randint(1, 300)
        s = choose_num_splits(batch, kv_heads, max_blocks)
        assert 1 <= s <= max_blocks
        if s < max_blocks:
            assert batch * kv_heads * s >= 10 * 132, "fewer than ten programs per SM"
            assert s == 1 or batch * kv_heads * (s - 1) < 10 * 132, "more splits than needed"
    assert choose_num_splits(256, 8, 16) == 1  # the batch alone fills the GPU
    assert choose_num_splits(1, 8, 4) == 4
    with pytest.raises(ValueError):
        choose_num_splits(0, 8, 16)


# ----------------------------------------------------------------------------- FP8 KV cache

FP8 = torch.float8_e4m3fn


def ref_quantize(x, scale):
    """The FP8 cache's stored value, in plain torch: clamp(x / scale, +-448) rounded to e4m3.
    Torch's cast rounds to nearest even but turns values beyond 448 into NaN: clamp first."""
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8)


def fp8_bytes(t):
    return t.view(torch.uint8)


def random_scales(device):
    """Per-tensor K and V scales away from 1 and from powers of two (so that the division
    really rounds), as fp32 [1] tensors."""
    return (torch.rand(2, device=device) * 0.9 + 0.05).split(1)


@pytest.mark.parametrize(
    "num_kv_heads,head_dim,dtype,slot_dtype,packed",
    [
        (2, 64, torch.float32, torch.int64, False),
        (3, 40, torch.float16, torch.int32, True),  # width 120: not a power of two
        (4, 32, torch.bfloat16, torch.int64, False),
    ],
)
def test_store_kvcache_fp8(num_kv_heads, head_dim, dtype, slot_dtype, packed, fresh_seed):
    n, num_blocks, block_size = 11, 5, 16
    width = (2 + 2 * num_kv_heads if packed else 2 * num_kv_heads) * head_dim
    qkv = torch.randn(n, width, device=DEVICE) * 100  # |x| / scale spans e4m3's range
    outliers = torch.randperm(qkv.numel(), device=DEVICE)[: qkv.numel() // 20]
    qkv.view(-1)[outliers] *= 100  # and beyond: these saturate
    qkv = qkv.to(dtype)
    if packed:
        # key/value as strided views into a packed qkv projection, like the model produces.
        key, value = qkv[:, 2 * head_dim :].view(n, 2 * num_kv_heads, head_dim).split(num_kv_heads, dim=1)
        assert not key.is_contiguous()
    else:
        key, value = (t.contiguous() for t in qkv.view(n, 2 * num_kv_heads, head_dim).split(num_kv_heads, dim=1))
    k_scale, v_scale = random_scales(DEVICE)
    slots = torch.randperm(num_blocks * block_size)[:n]
    slots[torch.rand(n) < 0.3] = -1
    slots[0] = -1
    slot_mapping = slots.to(DEVICE, slot_dtype)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Poison: 0x7F is e4m3fn's NaN; skipped and unused slots must keep it.
    k_cache = torch.full(shape, 0x7F, device=DEVICE, dtype=torch.uint8).view(FP8)
    v_cache = k_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    store_kvcache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    keep = slots >= 0
    k_ref.view(-1, num_kv_heads, head_dim)[slots[keep]] = ref_quantize(key[keep.to(DEVICE)], k_scale)
    v_ref.view(-1, num_kv_heads, head_dim)[slots[keep]] = ref_quantize(value[keep.to(DEVICE)], v_scale)

    # The same arithmetic (fp32 division, clamp, round to nearest even): identical bytes.
    assert torch.equal(fp8_bytes(k_cache), fp8_bytes(k_ref))
    assert torch.equal(fp8_bytes(v_cache), fp8_bytes(v_ref))
    written = ~k_cache.float().isnan().any(-1).any(-1).view(-1)
    assert int(written.sum()) == int(keep.sum())
    # Values beyond 448 * scale saturate to +-448.
    stored = k_cache.view(-1, num_kv_heads, head_dim)[slots[keep]].float()
    big = (key[keep.to(DEVICE)].float() / k_scale).abs() > 448
    assert big.any() and (stored[big].abs() == 448).all()


@pytest.mark.parametrize("scale", [1.0, 0.125, 0.3])
def test_store_kvcache_fp8_rounds_like_torch_at_every_tie(scale):
    _check_store_fp8_ties(scale, DEVICE)


def _check_store_fp8_ties(scale, device):
    """Every finite e4m3 value, every midpoint between neighbours (ties go to the even one),
    the floats just either side of each midpoint, and values past 448 (saturate), all signs,
    times `scale` (a power of two keeps the ties exact; 0.3 makes x / scale round first);
    NaN stays NaN (checked on the GPU)."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = codes[~codes.isnan() & (codes >= 0)].unique().sort().values
    mid = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mid, mid.nextafter(torch.zeros(())), mid.nextafter(torch.full((), 1e9)),
                   torch.tensor([449.0, 463.9, 464.0, 1e4, 3e38, float("nan")])])
    x = torch.cat([x, -x, torch.zeros(-2 * x.numel() % 64)]) * scale
    n = x.numel() // 64  # rows of 64 values: few interpreted programs
    key = x.view(n, 1, 64).to(device)
    cache = torch.zeros(n, 1, 1, 64, dtype=FP8, device=device)
    s = torch.tensor([scale], device=device)
    store_kvcache(key, key, cache, cache.clone(), torch.arange(n, device=device), s, s)
    nan = key.isnan()
    if device != "cpu":  # Triton's interpreter casts NaN to a finite e4m3 value: GPU only
        assert cache.view(n, 1, 64)[nan].float().isnan().all()
    assert torch.equal(fp8_bytes(cache.view(n, 1, 64))[~nan], fp8_bytes(ref_quantize(key, s))[~nan])


def quantized_paged_inputs(context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device):
    """make_paged_inputs with FP8 caches (quantized with random scales; the NaN poison stays NaN)
    and the dequantized fp32 caches the reference attends over."""
    q, k, v, block_tables, ctx = make_paged_inputs(
        context_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, device
    )
    k_scale, v_scale = random_scales(device)
    k8, v8 = ref_quantize(k * 100 * k_scale, k_scale), ref_quantize(v * 100 * v_scale, v_scale)
    deq = (k8.float() * k_scale, v8.float() * v_scale)
    return q.to(dtype), k8, v8, block_tables, ctx, k_scale, v_scale, deq


def _check_decode_fp8(context_lens, num_heads, num_kv_heads, head_dim, block_size, num_splits, dtype, tol,
                      device=DEVICE):
    q, k8, v8, block_tables, ctx, k_scale, v_scale, (k_deq, v_deq) = quantized_paged_inputs(
        context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device
    )
    # Scores of order 1: the stored values are ~N(0, 100^2), so fold 1/100 into the scale.
    scale = head_dim**-0.5 / 100
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k8, v8, block_tables, ctx, scale, num_splits, out=out,
                           k_scale=k_scale, v_scale=v_scale)
    assert not out.isnan().any(), "unwritten or NaN output"
    for b, c in enumerate(context_lens):
        if c == 0:
            assert (out[b] == 0).all(), "a context_len 0 row must give zeros"
    # The reference attends in float64 over the dequantized cache and q as given (already in
    # its dtype). e4m3 -> q's dtype is exact and the scales only move where fp32 rounds, so the
    # kernel's error is that of the unquantized path (test_paged_decode): fp32 accumulation
    # over <= 600 tokens (about 1e-6 relative, bound 1e-4), or with fp16 q the fp16 rounding of
    # the probabilities before the PV dot and of the output (2**-11 each, bound 3e-3).
    ref = ref_paged_decode(q, k_deq, v_deq, block_tables, ctx, scale)
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err:.2e} >= {tol:.0e}"


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,block_size,max_ctx,num_splits,dtype",
    [
        (8, 8, 16, 90, 1, torch.float32),  # group 1, tiles gather several small blocks
        (8, 2, 32, 150, 3, torch.float16),  # group 4
        (8, 1, 256, 600, 4, torch.float32),  # MQA, one block split into several tiles
        (4, 2, 16, 300, 6, torch.float16),  # many splits: some sequences have empty ones
    ],
)
def test_paged_decode_fp8(num_heads, num_kv_heads, block_size, max_ctx, num_splits, dtype, fresh_seed):
    random.seed(fresh_seed)
    lens = _random_context_lens(4, block_size, max_ctx)
    lens.append(block_size + 5)  # a partial last block for sure
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    _check_decode_fp8(lens, num_heads, num_kv_heads, 64, block_size, num_splits, dtype, tol)


def test_fp8_kv_rejects_bad_arguments():
    key = torch.randn(4, 2, 32, device=DEVICE)
    slots = torch.arange(4, device=DEVICE)
    cache8 = torch.zeros(2, 16, 2, 32, device=DEVICE, dtype=FP8)
    cache32 = torch.zeros(2, 16, 2, 32, device=DEVICE)
    one = torch.ones(1, device=DEVICE)
    with pytest.raises(ValueError, match="needs k_scale"):
        store_kvcache(key, key, cache8, cache8.clone(), slots)
    with pytest.raises(ValueError, match="needs v_scale"):
        store_kvcache(key, key, cache8, cache8.clone(), slots, one, None)
    with pytest.raises(ValueError, match="only to an FP8"):
        store_kvcache(key, key, cache32, cache32.clone(), slots, one, one)
    with pytest.raises(ValueError, match="fp32 tensor of shape"):
        store_kvcache(key, key, cache8, cache8.clone(), slots, one.bfloat16(), one)
    with pytest.raises(ValueError, match="fp32 tensor of shape"):
        store_kvcache(key, key, cache8, cache8.clone(), slots, torch.ones((), device=DEVICE), one)
    with pytest.raises(ValueError, match="fp32 tensor of shape"):
        store_kvcache(key, key, cache8, cache8.clone(), slots, 1.0, one)
    with pytest.raises(ValueError, match="dtypes"):  # the two caches must agree
        store_kvcache(key, key, cache8, cache32, slots, one, one)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        store_kvcache(key.to(FP8), key.to(FP8), cache8, cache8.clone(), slots, one, one)

    q, k8, v8, block_tables, ctx, k_scale, v_scale, _ = quantized_paged_inputs(
        [20, 7], 4, 2, 32, 16, torch.float32, DEVICE
    )
    with pytest.raises(ValueError, match="needs k_scale"):
        paged_decode_attention(q, k8, v8, block_tables, ctx, 0.2, 1)
    with pytest.raises(ValueError, match="only to an FP8"):
        paged_decode_attention(q, k8.float(), v8.float(), block_tables, ctx, 0.2, 1,
                               k_scale=k_scale, v_scale=v_scale)
    with pytest.raises(ValueError, match="dtypes"):
        paged_decode_attention(q, k8, v8.float(), block_tables, ctx, 0.2, 1, k_scale=k_scale, v_scale=v_scale)


# ----------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("num_splits", [1, None])
def test_paged_decode_gpu_bf16(block_size, num_splits):
    batch, num_heads, num_kv_heads, head_dim, max_ctx = 64, 16, 8, 128, 4096
    lens = _random_context_lens(batch, block_size, max_ctx)
    lens[0] = max_ctx
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, math.ceil(max_ctx / block_size))
    _check_decode_gpu(lens, num_heads, num_kv_heads, head_dim, block_size, num_splits)


def _check_decode_gpu(lens, num_heads, num_kv_heads, head_dim, block_size, num_splits):
    q, k_cache, v_cache, block_tables, ctx = make_paged_inputs(
        lens, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, "cuda"
    )
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, block_tables, ctx, head_dim**-0.5, num_splits, out)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    ref = ref_paged_decode(q, k_cache, v_cache, block_tables, ctx, head_dim**-0.5)
    err = rel_err(out, ref)
    assert err < 1e-2, f"relative error {err:.2e}"


@pytest.mark.gpu
def test_store_kvcache_gpu_bf16():
    n, num_kv_heads, head_dim, num_blocks, block_size = 300, 8, 128, 64, 256
    qkv = torch.randn(n, 32 * head_dim, device="cuda", dtype=torch.bfloat16)
    key = qkv[:, 16 * head_dim : 24 * head_dim].view(n, num_kv_heads, head_dim)
    value = qkv[:, 24 * head_dim :].view(n, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:n]
    slots[::7] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    v_cache = torch.full_like(k_cache, float("nan"))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(key, value, k_cache, v_cache, slots.int())
    ref_store_kvcache(key, value, k_ref, v_ref, slots)
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    """Capture store + decode at a fixed batch size, then replay with new tables and lengths."""
    batch, num_heads, num_kv_heads, head_dim, block_size = 8, 16, 8, 128, 16
    max_blocks, num_blocks = 64, 8 * 64 + 8
    dtype, dev = torch.bfloat16, "cuda"
    num_splits = choose_num_splits(batch, num_kv_heads, max_blocks)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.empty(batch, num_heads, head_dim, device=dev, dtype=dtype)
    new_k = torch.empty(batch, num_kv_heads, head_dim, device=dev, dtype=dtype)
    new_v = torch.empty_like(new_k)
    slot_mapping = torch.empty(batch, device=dev, dtype=torch.int64)
    block_tables = torch.empty(batch, max_blocks, device=dev, dtype=torch.int32)
    context_lens = torch.empty(batch, device=dev, dtype=torch.int32)
    out = torch.empty_like(q)

    def fill(max_ctx):
        """New random inputs in the captured buffers; the last row is padding (len 0, slot -1)."""
        lens = [random.randint(1, max_ctx) for _ in range(batch - 1)] + [0]
        perm = torch.randperm(num_blocks, device=dev).int()
        block_tables.copy_(perm[: batch * max_blocks].view(batch, max_blocks))
        context_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        # The decode token's slot is the last one of its context.
        pos = (context_lens - 1).clamp_min(0).long()
        blk = block_tables.gather(1, (pos // block_size)[:, None]).squeeze(1).long()
        slots = blk * block_size + pos % block_size
        slots[-1] = -1
        slot_mapping.copy_(slots)
        q.normal_(), new_k.normal_(), new_v.normal_()
        out.fill_(float("nan"))

    def step():
        store_kvcache(new_k, new_v, k_cache, v_cache, slot_mapping)
        paged_decode_attention(
            q, k_cache, v_cache, block_tables, context_lens, head_dim**-0.5, num_splits, out
        )

    fill(max_blocks * block_size)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for max_ctx in (max_blocks * block_size, 37, 1):
        fill(max_ctx)
        graph.replay()
        torch.cuda.synchronize()
        assert not out.isnan().any()
        assert (out[-1] == 0).all()
        # The stored token must be visible to the decode in the same replay.
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        live = slot_mapping[:-1]
        torch.testing.assert_close(k_flat[live], new_k[:-1], rtol=0, atol=0)
        ref = ref_paged_decode(q, k_cache, v_cache, block_tables, context_lens, head_dim**-0.5)
        assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_store_kvcache_fp8_ties_gpu(scale):
    _check_store_fp8_ties(scale, "cuda")


@pytest.mark.gpu
def test_store_kvcache_gpu_fp8(fresh_seed):
    """bf16 K/V views of a packed projection into an FP8 cache: bytes as torch's CUDA cast."""
    n, num_kv_heads, head_dim, num_blocks, block_size = 300, 8, 128, 64, 256
    qkv = torch.randn(n, 32 * head_dim, device="cuda", dtype=torch.bfloat16) * 50
    key = qkv[:, 16 * head_dim : 24 * head_dim].view(n, num_kv_heads, head_dim)
    value = qkv[:, 24 * head_dim :].view(n, num_kv_heads, head_dim)
    k_scale, v_scale = random_scales("cuda")
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:n]
    slots[::7] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, 0x7F, device="cuda", dtype=torch.uint8).view(FP8)
    v_cache = k_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(key, value, k_cache, v_cache, slots.int(), k_scale, v_scale)
    keep = slots >= 0
    k_ref.view(-1, num_kv_heads, head_dim)[slots[keep]] = ref_quantize(key[keep], k_scale)
    v_ref.view(-1, num_kv_heads, head_dim)[slots[keep]] = ref_quantize(value[keep], v_scale)
    assert torch.equal(fp8_bytes(k_cache), fp8_bytes(k_ref))
    assert torch.equal(fp8_bytes(v_cache), fp8_bytes(v_ref))


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("num_splits", [1, None])
def test_paged_decode_gpu_fp8(block_size, num_splits, fresh_seed):
    """bf16 q over an FP8 cache at Qwen3-8B's head shape, against float64 attention over the
    dequantized cache: 1e-2 as the bf16 test (bf16 probabilities and output, 2**-9 each)."""
    random.seed(fresh_seed)
    batch, num_heads, num_kv_heads, head_dim, max_ctx = 64, 16, 8, 128, 4096
    lens = _random_context_lens(batch, block_size, max_ctx)
    lens[0] = max_ctx
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, math.ceil(max_ctx / block_size))
    _check_decode_fp8(lens, num_heads, num_kv_heads, head_dim, block_size, num_splits, torch.bfloat16, 1e-2,
                      device="cuda")


@pytest.mark.gpu
def test_cuda_graph_fp8_scales_set_after_capture(fresh_seed):
    """Store + decode on an FP8 cache captured with scales 1.0; new scales written into the
    same tensors afterwards must be what the replay quantizes and dequantizes with."""
    batch, num_heads, num_kv_heads, head_dim, block_size, max_blocks = 8, 16, 8, 128, 16, 16
    dev, num_blocks = "cuda", batch * max_blocks
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, device=dev, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    k_scale, v_scale = torch.ones(1, device=dev), torch.ones(1, device=dev)
    q = torch.randn(batch, num_heads, head_dim, device=dev, dtype=torch.bfloat16)
    new_k = torch.randn(batch, num_kv_heads, head_dim, device=dev, dtype=torch.bfloat16)
    new_v = torch.randn_like(new_k)
    block_tables = torch.randperm(num_blocks, device=dev).int().view(batch, max_blocks)
    context_lens = torch.randint(1, max_blocks * block_size, (batch,), device=dev, dtype=torch.int32)
    pos = (context_lens - 1).long()
    slots = block_tables.gather(1, (pos // block_size)[:, None]).squeeze(1).long() * block_size + pos % block_size
    out = torch.empty_like(q)
    num_splits = choose_num_splits(batch, num_kv_heads, max_blocks)

    def step():
        store_kvcache(new_k, new_v, k_cache, v_cache, slots, k_scale, v_scale)
        paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, head_dim**-0.5, num_splits, out,
                               k_scale=k_scale, v_scale=v_scale)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    # The rest of the cache: random e4m3 values.
    k_cache.copy_(torch.randn(k_cache.shape, device=dev).to(FP8))
    v_cache.copy_(torch.randn(v_cache.shape, device=dev).to(FP8))
    k_scale.fill_(0.037)
    v_scale.fill_(0.41)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    assert torch.equal(fp8_bytes(k_flat[slots]), fp8_bytes(ref_quantize(new_k, k_scale)))
    ref = ref_paged_decode(q, k_cache.float() * k_scale, v_cache.float() * v_scale, block_tables, context_lens,
                           head_dim**-0.5)
    assert rel_err(out, ref) < 1e-2


# ----------------------------------------------------------------------------- benchmark


def bench_paged_decode():
    """Print effective KV read bandwidth of paged_decode_attention (bf16, block 256).

    Run from the repo root: python3 -m tests.test_kernels. 'eager' times single calls with
    triton.testing.do_bench (launch overhead included, as in an eager engine step); 'graph'
    times CUDA-graph replays, as the engine's decode step runs.
    """
    import triton

    num_heads, num_kv_heads, head_dim, block_size = 16, 8, 128, 256
    dtype = torch.bfloat16
    header = ("B", "ctx", "splits", "eager us", "TB/s", "graph us", "TB/s")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (5, 6, 6, 9, 6, 9, 6))))
    for batch in (64, 256):
        for ctx_len in (1024, 4096):
            blocks_per_seq = ctx_len // block_size
            num_blocks = batch * blocks_per_seq
            k_cache = torch.randn(
                num_blocks, block_size, num_kv_heads, head_dim, device="cuda", dtype=dtype
            )
            v_cache = torch.randn_like(k_cache)
            block_tables = torch.randperm(num_blocks, device="cuda").int().view(batch, -1)
            context_lens = torch.full((batch,), ctx_len, device="cuda", dtype=torch.int32)
            q = torch.randn(batch, num_heads, head_dim, device="cuda", dtype=dtype)
            out = torch.empty_like(q)
            splits = choose_num_splits(batch, num_kv_heads, blocks_per_seq)
            # do_bench_cudagraph warms up on a side stream that does not wait for the inputs.
            torch.cuda.synchronize()

            def fn():
                paged_decode_attention(
                    q, k_cache, v_cache, block_tables, context_lens, head_dim**-0.5, splits, out
                )

            eager_ms = triton.testing.do_bench(fn, return_mode="median")
            graph_ms = triton.testing.do_bench_cudagraph(fn, return_mode="median")
            kv_bytes = 2 * batch * ctx_len * num_kv_heads * head_dim * k_cache.element_size()
            print(
                f"{batch:>5} {ctx_len:>6} {splits:>6} {eager_ms * 1e3:>9.1f} "
                f"{kv_bytes / eager_ms / 1e9:>6.2f} {graph_ms * 1e3:>9.1f} "
                f"{kv_bytes / graph_ms / 1e9:>6.2f}"
            )


if __name__ == "__main__":
    bench_paged_decode()
