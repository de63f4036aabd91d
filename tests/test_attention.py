"""Attention backends: backend selection, the flash_attn argument contract, and agreement of
all available backends with an independent reference on prefill, prefix-hit / chunked prefill
and decode."""

import math
import types

import pytest
import torch

from nanovllm.layers import attention as attn_mod
from nanovllm.layers.attention import FlashAttnBackend, TorchBackend, select_backend
from nanovllm.utils.context import AttentionMetadata, prefill_metadata


# ----------------------------------------------------------------------------- scenario helpers
def make_cache_scenario(cached, new, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed):
    """Random paged caches holding each sequence's cached + new K/V under a shuffled block table.

    Returns q (new tokens, packed), the per-sequence dense K/V, caches and block tables.
    """
    g = torch.Generator().manual_seed(seed)
    total = [c + n for c, n in zip(cached, new)]
    nblocks = [math.ceil(t / block_size) for t in total]
    num_blocks = sum(nblocks) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, start = [], 0
    for nb in nblocks:
        tables.append(perm[start:start + nb])
        start += nb
    width = max(nblocks)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype).to(device)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype).to(device)
    ks, vs = [], []
    for t, table in zip(total, tables):
        ks.append(k_cache[torch.tensor(table, device=device)].flatten(0, 1)[:t])
        vs.append(v_cache[torch.tensor(table, device=device)].flatten(0, 1)[:t])
    q = torch.randn(sum(new), num_heads, head_dim, generator=g).to(dtype).to(device)
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    return q, ks, vs, k_cache, v_cache, bt


def reference_attention(q, ks, vs, new, scale):
    """Plain matmul/softmax in fp32, bottom-right causal, GQA by repeating K/V heads."""
    outs, start = [], 0
    for k, v, n in zip(ks, vs, new):
        qi = q[start:start + n].float().transpose(0, 1)
        group = qi.size(0) // k.size(1)
        ki = k.float().transpose(0, 1).repeat_interleave(group, 0)
        vi = v.float().transpose(0, 1).repeat_interleave(group, 0)
        s = qi @ ki.transpose(1, 2) * scale
        L = k.size(0)
        allowed = torch.arange(L, device=q.device)[None, :] <= torch.arange(L - n, L, device=q.device)[:, None]
        s = s.masked_fill(~allowed, float("-inf"))
        outs.append((s.softmax(-1) @ vi).transpose(0, 1))
        start += n
    return torch.cat(outs).to(q.dtype)


def prefill_meta(cached, new, bt, device):
    kv = [c + n for c, n in zip(cached, new)]
    return prefill_metadata(new, kv, torch.full((sum(new),), -1, dtype=torch.int32), bt, device)


def decode_meta(ctx, bt, device, num_splits=1):
    return AttentionMetadata(is_prefill=False, slot_mapping=torch.full((len(ctx),), -1, dtype=torch.int32, device=device),
                             context_lens=torch.tensor(ctx, dtype=torch.int32, device=device), block_tables=bt,
                             query_lens=[1] * len(ctx), kv_lens=list(ctx), num_splits=num_splits)


def dense_new_kv(ks, vs, new):
    k = torch.cat([k[-n:] for k, n in zip(ks, new)])
    v = torch.cat([v[-n:] for v, n in zip(vs, new)])
    return k, v


# ----------------------------------------------------------------------------- a flash-attn stand-in
def make_flash_attn_stub(calls):
    """Implements flash-attn's documented semantics in plain torch and checks its argument contract."""

    def check_paged(k_cache, block_table):
        assert block_table.dtype == torch.int32, "block_table must be int32"
        assert k_cache.dim() == 4, "paged K/V: [num_blocks, block_size, kv_heads, head_dim]"
        assert k_cache.size(1) % 256 == 0, "flash-attn paged K/V needs block_size % 256 == 0"

    def gather(cache, table, length):
        return cache[table.long()].flatten(0, 1)[:length]

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale=None, causal=False, block_table=None):
        calls.append(("varlen", block_table is not None))
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
        assert causal, "nano-vllm always calls flash-attn with causal=True"
        assert q.dim() == 3 and q.stride(-1) == 1
        nq = cu_seqlens_q.diff().tolist()
        nk = cu_seqlens_k.diff().tolist()
        assert max(nq) == max_seqlen_q and max(nk) == max_seqlen_k
        if block_table is not None:
            check_paged(k, block_table)
            ks = [gather(k, block_table[i], n) for i, n in enumerate(nk)]
            vs = [gather(v, block_table[i], n) for i, n in enumerate(nk)]
        else:
            assert k.size(0) == sum(nk) and nq == nk
            ks = list(k.split(nk))
            vs = list(v.split(nk))
        return reference_attention(q, ks, vs, nq, softmax_scale)

    def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None,
                                softmax_scale=None, causal=False):
        calls.append(("kvcache", True))
        assert q.dim() == 4 and q.size(1) == 1, "decode q: [batch, 1, heads, head_dim]"
        assert cache_seqlens.dtype == torch.int32
        check_paged(k_cache, block_table)
        lens = cache_seqlens.tolist()
        ks = [gather(k_cache, block_table[i], n) for i, n in enumerate(lens)]
        vs = [gather(v_cache, block_table[i], n) for i, n in enumerate(lens)]
        return reference_attention(q[:, 0], ks, vs, [1] * len(lens), softmax_scale).unsqueeze(1)

    return types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func,
                                 flash_attn_with_kvcache=flash_attn_with_kvcache)


# ----------------------------------------------------------------------------- CPU tests
CASES = {
    "prefill": ([0, 0, 0], [5, 300, 17]),
    "prefix_hit": ([256, 512, 0], [3, 100, 40]),
    "chunked": ([256, 40], [256, 1]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (4, 4)])
def test_torch_and_flash_contract_match_reference(case, heads):
    cached, new = CASES[case]
    nh, nkv = heads
    q, ks, vs, kc, vc, bt = make_cache_scenario(cached, new, nh, nkv, 16, 256, torch.float32, "cpu", seed=hash(case) % 1000)
    scale = 16 ** -0.5
    ref = reference_attention(q, ks, vs, new, scale)
    meta = prefill_meta(cached, new, bt, "cpu")
    k_new, v_new = dense_new_kv(ks, vs, new)
    out_torch = TorchBackend().forward(q, k_new, v_new, kc, vc, meta, scale)
    torch.testing.assert_close(out_torch, ref, rtol=1e-4, atol=1e-4)

    calls = []
    fa = FlashAttnBackend(module=make_flash_attn_stub(calls))
    out_fa = fa.forward(q, k_new, v_new, kc, vc, meta, scale)
    torch.testing.assert_close(out_fa, ref, rtol=1e-4, atol=1e-4)
    assert calls == [("varlen", meta.has_prefix)]


def test_decode_torch_and_flash_contract():
    ctx = [1, 256, 257, 700]
    q, ks, vs, kc, vc, bt = make_cache_scenario([c - 1 for c in ctx], [1] * 4, 8, 2, 16, 256, torch.float32, "cpu", 3)
    scale = 0.25
    ref = reference_attention(q, ks, vs, [1] * 4, scale)
    meta = decode_meta(ctx, bt, "cpu")
    torch.testing.assert_close(TorchBackend().forward(q, None, None, kc, vc, meta, scale), ref, rtol=1e-4, atol=1e-4)
    calls = []
    out = FlashAttnBackend(module=make_flash_attn_stub(calls)).forward(q, None, None, kc, vc, meta, scale)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert calls == [("kvcache", True)]


def test_backend_selection(monkeypatch):
    assert select_backend("cpu", 16).name == "torch"
    with pytest.raises(ValueError, match="needs CUDA"):
        select_backend("cpu", 256, forced="triton")
    with pytest.raises(ValueError, match="multiple of 256"):
        select_backend("cuda", 16, forced="flash_attn")
    monkeypatch.setattr(attn_mod, "flash_attn_available", lambda: True)
    monkeypatch.setattr(attn_mod, "FlashAttnBackend", lambda: types.SimpleNamespace(name="flash_attn"))
    monkeypatch.setattr(attn_mod, "TritonBackend", lambda: types.SimpleNamespace(name="triton"))
    assert select_backend("cuda", 256).name == "flash_attn"
    assert select_backend("cuda", 16).name == "triton"      # flash-attn needs block % 256
    assert select_backend("cuda", 256, forced="triton").name == "triton"
    monkeypatch.setattr(attn_mod, "flash_attn_available", lambda: False)
    assert select_backend("cuda", 256).name == "triton"
    assert select_backend("cpu", 256).name == "torch"


# ----------------------------------------------------------------------------- GPU tests
@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("block_size", [16, 256])
def test_triton_backend_prefill_matches_torch_on_gpu(case, block_size):
    from nanovllm.layers.attention import TritonBackend

    cached, new = CASES[case]
    q, ks, vs, kc, vc, bt = make_cache_scenario(cached, new, 16, 8, 128, block_size, torch.bfloat16, "cuda",
                                                seed=torch.seed() % 10_000)
    scale = 128 ** -0.5
    meta = prefill_meta(cached, new, bt, "cuda")
    k_new, v_new = dense_new_kv(ks, vs, new)
    ref = reference_attention(q, ks, vs, new, scale).float()
    for backend in (TorchBackend(), TritonBackend()):
        out = backend.forward(q, k_new, v_new, kc, vc, meta, scale).float()
        err = (out - ref).norm() / ref.norm()
        assert err < 1e-2, (backend.name, err.item())


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_triton_backend_decode_matches_torch_on_gpu(block_size):
    from nanovllm.kernels.paged_decode import choose_num_splits
    from nanovllm.layers.attention import TritonBackend

    g = torch.Generator().manual_seed(torch.seed() % 10_000)
    ctx = torch.randint(1, 3000, (48,), generator=g).tolist()
    q, ks, vs, kc, vc, bt = make_cache_scenario([c - 1 for c in ctx], [1] * len(ctx), 32, 8, 128, block_size,
                                                torch.bfloat16, "cuda", seed=int(g.initial_seed()))
    scale = 128 ** -0.5
    ref = reference_attention(q, ks, vs, [1] * len(ctx), scale).float()
    splits = choose_num_splits(len(ctx), 8, bt.size(1))
    for backend in (TorchBackend(), TritonBackend()):
        out = backend.forward(q, None, None, kc, vc, decode_meta(ctx, bt, "cuda", splits), scale).float()
        err = (out - ref).norm() / ref.norm()
        assert err < 1e-2, (backend.name, err.item())


def test_gather_groups_and_varlen_gather_on_cpu():
    from nanovllm.layers.attention import gather_kv, gather_kv_varlen, groups_of_at_most

    assert list(groups_of_at_most([5, 5, 5], 10)) == [(0, 2), (2, 3)]
    assert list(groups_of_at_most([20, 1, 1], 10)) == [(0, 1), (1, 3)]   # a long one alone
    assert list(groups_of_at_most([3], 10)) == [(0, 1)]
    cached, new = CASES["prefix_hit"]
    _, ks, _, kc, _, bt = make_cache_scenario(cached, new, 4, 2, 16, 256, torch.float32, "cpu", seed=5)
    lens = [c + n for c, n in zip(cached, new)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    packed = gather_kv_varlen(kc, bt, cu, sum(lens))
    torch.testing.assert_close(packed, torch.cat(ks))
    torch.testing.assert_close(gather_kv(kc, bt[1], lens[1]), ks[1])


@pytest.mark.gpu
def test_triton_prefix_prefill_in_several_gather_groups(monkeypatch):
    from nanovllm.layers.attention import TritonBackend

    cached, new = CASES["prefix_hit"]
    q, ks, vs, kc, vc, bt = make_cache_scenario(cached, new, 16, 8, 128, 16, torch.bfloat16, "cuda", seed=11)
    meta = prefill_meta(cached, new, bt, "cuda")
    k_new, v_new = dense_new_kv(ks, vs, new)
    ref = reference_attention(q, ks, vs, new, 128 ** -0.5).float()
    monkeypatch.setattr(TritonBackend, "GATHER_TOKENS", 300)  # forces one group per sequence
    out = TritonBackend().forward(q, k_new, v_new, kc, vc, meta, 128 ** -0.5).float()
    assert ((out - ref).norm() / ref.norm()) < 1e-2
