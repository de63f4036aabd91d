"""Attention backends: backend selection, the flash_attn argument contract, and agreement of
all available backends with an independent reference on prefill, prefix-hit / chunked prefill
and decode."""

import math
import types

import pytest
import torch

from nanovllm.config import KV_CACHE_DTYPES, QuantizationConfig
from nanovllm.features.quantization.fp8_kv import K_SCALE_HEADROOM, V_SCALE_HEADROOM, calibrate_kv_scales
from nanovllm.model.attention import Attention, AttentionMetadata, prefill_metadata
from nanovllm.model.attention import selection as backend_mod
from nanovllm.model.attention.selection import select_backend
from nanovllm.model.attention.flash_attn_backend import FlashAttnBackend
from nanovllm.model.attention.fp8_cache import quantize_kv
from nanovllm.model.attention.paged_kv import gather_kv
from nanovllm.model.attention.torch_backend import TorchBackend


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


def stub_cuda_backends(monkeypatch, flash_attn: bool = True):
    """Backend selection as on a CUDA machine (flash_attn importable or not), the CUDA backends
    replaced by stand-ins that say their name."""
    real = backend_mod.backend_class

    def stub(name):
        if name == "torch":
            return real(name)
        return type(name, (), {"name": name, "fp8_cache": real(name).fp8_cache})

    monkeypatch.setattr(backend_mod, "flash_attn_available", lambda: flash_attn)
    monkeypatch.setattr(backend_mod, "backend_class", stub)


def test_backend_selection(monkeypatch):
    assert select_backend("cpu", 16).name == "torch"
    with pytest.raises(ValueError, match="needs CUDA"):
        select_backend("cpu", 256, forced="triton")
    with pytest.raises(ValueError, match="multiple of 256"):
        select_backend("cuda", 16, forced="flash_attn")
    stub_cuda_backends(monkeypatch)
    assert select_backend("cuda", 256).name == "flash_attn"
    assert select_backend("cuda", 16).name == "triton"      # flash-attn needs block % 256
    assert select_backend("cuda", 256, forced="triton").name == "triton"
    stub_cuda_backends(monkeypatch, flash_attn=False)
    assert select_backend("cuda", 256).name == "triton"
    assert select_backend("cpu", 256).name == "torch"


# ----------------------------------------------------------------------------- GPU tests
@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("block_size", [16, 256])
def test_triton_backend_prefill_matches_torch_on_gpu(case, block_size):
    from nanovllm.model.attention.triton_backend import TritonBackend

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
    from nanovllm.model.attention.triton_backend import TritonBackend

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
    from nanovllm.model.attention.gathered_prefill import gather_kv_varlen, groups_of_at_most

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
@pytest.mark.parametrize("path", ["paged", "gathered"])
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_triton_prefix_prefill_paths(monkeypatch, path, cache):
    """Prefills with cached tokens through the backend, against attention on the sequences' own
    K/V (FP8: round-tripped through the cache's rounding): the paged prefill kernel (blocks of 16
    tokens, so its 64-token tiles span several blocks), or, for query chunks above
    PAGED_PREFILL_MAX_Q, the contexts gathered (and dequantized) for FlashAttention-2, here one
    group a sequence. Bound: bf16 inputs and probabilities, fp32 sums; 1e-2 relative as the other
    GPU cases."""
    from nanovllm.model.attention import gathered_prefill
    from nanovllm.model.attention.triton_backend import TritonBackend

    cached, new = CASES["prefix_hit"]
    q, ks, vs, kc, vc, bt = make_cache_scenario(cached, new, 16, 8, 128, 16, torch.bfloat16, "cuda", seed=11)
    scales = {}
    if cache == "fp8":
        scales = dict(k_scale=(kc.abs().amax().float() / 200).reshape(1),
                      v_scale=(vc.abs().amax().float() / 100).reshape(1))
        kc, vc = ((c.float() / s).clamp(-448, 448).to(FP8) for c, s in zip((kc, vc), scales.values()))
        ks = [ref_round_trip(k, scales["k_scale"], torch.bfloat16) for k in ks]
        vs = [ref_round_trip(v, scales["v_scale"], torch.bfloat16) for v in vs]
    meta = prefill_meta(cached, new, bt, "cuda")
    k_new, v_new = dense_new_kv(ks, vs, new)
    ref = reference_attention(q, ks, vs, new, 128 ** -0.5).float()
    calls = []
    if path == "gathered":
        monkeypatch.setattr(TritonBackend, "PAGED_PREFILL_MAX_Q", 0)
        monkeypatch.setattr(gathered_prefill, "GATHER_TOKENS", 300)
        real = gathered_prefill.gather_kv_varlen
        monkeypatch.setattr(gathered_prefill, "gather_kv_varlen", lambda *a: calls.append(1) or real(*a))
    out = TritonBackend().forward(q, k_new, v_new, kc, vc, meta, 128 ** -0.5, **scales).float()
    assert len(calls) == (2 * len(new) if path == "gathered" else 0)  # K and V, one group a sequence
    assert ((out - ref).norm() / ref.norm()) < 1e-2


# ----------------------------------------------------------------------------- FP8 KV cache
FP8 = torch.float8_e4m3fn
E4M3_U = 2.0 ** -4        # e4m3 unit roundoff (3 mantissa bits): relative error of a normal value
E4M3_SUB_ERR = 2.0 ** -10  # half the subnormal spacing 2**-9: absolute error below 2**-6 (times the scale)


def ref_round_trip(x, scale, dtype):
    """dequant(quant(x)) in plain torch: what an FP8 cache gives back for x, in `dtype`."""
    return ((x.float() / scale).clamp(-448, 448).to(FP8).float() * scale).to(dtype)


class PagedSequences:
    """An Attention layer on the torch backend with its own paged cache, fed step by step.

    `seqs` are (q, k, v) of whole sequences; each sequence gets a random block table, so that
    every run lays the same tokens out differently in the cache.
    """

    def __init__(self, seqs, num_heads, num_kv_heads, head_dim, block_size, cache_dtype, scales=None):
        self.seqs, self.block_size = seqs, block_size
        nblocks = [math.ceil(q.size(0) / block_size) for q, _, _ in seqs]
        perm = torch.randperm(sum(nblocks) + 2).tolist()
        self.tables = [[perm.pop() for _ in range(nb)] for nb in nblocks]
        self.layer = Attention(num_heads, head_dim, head_dim ** -0.5, num_kv_heads)
        self.layer.backend = TorchBackend()
        shape = (sum(nblocks) + 2, block_size, num_kv_heads, head_dim)
        self.layer.k_cache = torch.zeros(shape, dtype=cache_dtype)
        self.layer.v_cache = torch.zeros(shape, dtype=cache_dtype)
        if scales is not None:
            self.layer.k_scale.copy_(scales[0])
            self.layer.v_scale.copy_(scales[1])

    def _slots(self, i, start, end):
        t, bs = self.tables[i], self.block_size
        return [t[p // bs] * bs + p % bs for p in range(start, end)]

    def _tables(self, ids):
        width = max(len(self.tables[i]) for i in ids)
        return torch.tensor([self.tables[i] + [-1] * (width - len(self.tables[i])) for i in ids], dtype=torch.int32)

    def prefill(self, chunks):
        """chunks: (sequence index, start, end); tokens [start, end) are new, [0, start) cached.
        Returns each chunk's attention output."""
        ids = [i for i, _, _ in chunks]
        q, k, v = (torch.cat([self.seqs[i][j][a:b] for i, a, b in chunks]) for j in range(3))
        slots = torch.tensor(sum((self._slots(i, a, b) for i, a, b in chunks), []), dtype=torch.int32)
        meta = prefill_metadata([b - a for _, a, b in chunks], [b for _, _, b in chunks], slots, self._tables(ids), "cpu")
        return list(self.layer(q, k, v, meta).split([b - a for _, a, b in chunks]))

    def decode(self, rows):
        """rows: (sequence index, position): one new token each. Returns their outputs."""
        ids = [i for i, _ in rows]
        q, k, v = (torch.stack([self.seqs[i][j][p] for i, p in rows]) for j in range(3))
        slots = torch.tensor([self._slots(i, p, p + 1)[0] for i, p in rows], dtype=torch.int32)
        ctx = [p + 1 for _, p in rows]
        meta = AttentionMetadata(is_prefill=False, slot_mapping=slots, context_lens=torch.tensor(ctx, dtype=torch.int32),
                                 block_tables=self._tables(ids), query_lens=[1] * len(rows), kv_lens=ctx)
        return self.layer(q, k, v, meta)

    def cached(self, i, which):
        """Sequence i's cached K (which=0) or V (1), as stored."""
        cache = (self.layer.k_cache, self.layer.v_cache)[which]
        return gather_kv(cache, torch.tensor(self.tables[i]), self.seqs[i][0].size(0))


def random_sequences(lengths, num_heads, num_kv_heads, head_dim, dtype):
    # K/V of a few units: calibrated scales of about 0.05-0.1, so the scale really matters.
    return [(torch.randn(n, num_heads, head_dim).to(dtype), (3 * torch.randn(n, num_kv_heads, head_dim)).to(dtype),
             (2 * torch.randn(n, num_kv_heads, head_dim)).to(dtype)) for n in lengths]


def fp8_scales(seqs):
    """Scales as calibration would set them from all of the sequences' K/V (no saturation)."""
    k_scale, v_scale = torch.ones(1), torch.ones(1)
    calibrate_kv_scales(torch.cat([k for _, k, _ in seqs]), torch.cat([v for _, _, v in seqs]), k_scale, v_scale)
    return k_scale, v_scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_prefill_fresh_prefix_hit_chunked_and_decode_agree(dtype, fresh_seed):
    """A sequence's attention output is the same however its K/V reached the attention: a
    prefill without cached tokens (this step's K/V), after a prefix hit or in chunks (read back
    from the FP8 cache), or as a decode step; and it is SDPA over dequant(quant(K/V))."""
    nh, nkv, hd, bs = 4, 2, 16, 16
    n, c = 70, 37  # the sequence under test, the cached prefix of the prefix-hit run
    seqs = random_sequences([n, 30], nh, nkv, hd, dtype)
    scales = fp8_scales(seqs)
    # Block tables differ between runs (random): the layout must not matter.
    run = lambda: PagedSequences(seqs, nh, nkv, hd, bs, FP8, scales)  # noqa: E731

    fresh_run = run()
    fresh = fresh_run.prefill([(1, 0, 30), (0, 0, n)])[1]
    hit_run = run()
    hit_run.prefill([(1, 0, 30), (0, 0, c)])  # the prefix, stored along with another sequence
    hit = hit_run.prefill([(0, c, n)])[0]
    chunk_run = run()
    chunked = torch.cat([chunk_run.prefill([(0, 0, 16)])[0], chunk_run.prefill([(0, 16, 50), (1, 0, 30)])[0],
                         chunk_run.prefill([(0, 50, n)])[0]])
    decode_run = run()
    decode_run.prefill([(0, 0, n - 1)])
    decoded = decode_run.decode([(0, n - 1)])[0]

    # Every run stored bitwise the same bytes for the sequence.
    for other in (hit_run, chunk_run, decode_run):
        for which in (0, 1):
            assert torch.equal(other.cached(0, which).view(torch.uint8), fresh_run.cached(0, which).view(torch.uint8))
    # So all four attend over bitwise equal K/V; what is left is SDPA's summation order over
    # at most 70 keys for a different number of query rows: fp32 <= 70 * 2**-24 relative
    # (1e-5 is generous); in bf16 the output's rounding can flip by one ulp (<= 2**-7 relative).
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(hit, fresh[c:], **tol)
    torch.testing.assert_close(chunked, fresh, **tol)
    torch.testing.assert_close(decoded, fresh[n - 1], **tol)

    # And the function is attention over the round-tripped K/V (reference in fp32, causal).
    q, k, v = seqs[0]
    ref = reference_attention(q, [ref_round_trip(k, scales[0], dtype)], [ref_round_trip(v, scales[1], dtype)], [n],
                              hd ** -0.5)
    # fp32: only summation order differs (1e-5). bf16: SDPA over bf16 inputs vs the fp32
    # reference, and the output rounded to bf16 (2**-9): 1e-2 as in the GPU backend tests.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(fresh, ref, **tol)


def test_fp8_cache_error_against_full_precision_is_bounded(fresh_seed):
    """FP8 vs fp32 cache, same inputs, both through prefix-hit prefill (K/V read back).

    e4m3 rounds each value with relative error <= u = 2**-4 (normal range) or absolute error
    <= 2**-10 * scale (subnormals), nothing saturating at calibrated scales. So each score
    s_i = c q.k_i moves by at most E = c sum_d |q_d| (u |k_id| + 2**-10 k_scale); softmax
    weights then move by a factor within e**(+-2E): |p'_i - p_i| <= (e**(2E) - 1) p_i; and
    |o' - o| <= sum |p'_i - p_i| |v'_i| + sum p_i |v'_i - v_i|
             <= (e**(2E) - 1) max |v'| + u max |v| + 2**-10 v_scale,
    per query row and head (maxima over the sequence: a valid, looser bound). fp32
    arithmetic adds ~1e-6; 1e-5 slack.
    """
    nh, nkv, hd, bs, n, c = 4, 2, 16, 16, 90, 40
    seqs = random_sequences([n], nh, nkv, hd, torch.float32)
    scales = fp8_scales(seqs)
    q, k, v = seqs[0]
    for x, s in ((k, scales[0]), (v, scales[1])):  # the round trip itself: e4m3's bound
        assert ((ref_round_trip(x, s, torch.float32) - x).abs() <= E4M3_U * x.abs() + E4M3_SUB_ERR * s).all()
    outs = []
    for cache_dtype, sc in ((FP8, scales), (torch.float32, None)):
        r = PagedSequences(seqs, nh, nkv, hd, bs, cache_dtype, sc)
        r.prefill([(0, 0, c)])
        outs.append(r.prefill([(0, c, n)])[0])
    out8, out32 = outs
    group = nh // nkv
    k_err = (E4M3_U * k.abs() + E4M3_SUB_ERR * scales[0]).repeat_interleave(group, 1)   # [n, nh, hd]
    E = hd ** -0.5 * torch.einsum("jhd,ihd->jhi", q[c:].abs(), k_err).amax(-1)           # [n - c, nh]
    v_rt = ref_round_trip(v, scales[1], torch.float32)
    v_max = v.abs().amax((0, 2)).repeat_interleave(group)                                # [nh]
    v_rt_max = v_rt.abs().amax((0, 2)).repeat_interleave(group)
    bound = torch.expm1(2 * E) * v_rt_max + E4M3_U * v_max + E4M3_SUB_ERR * scales[1] + 1e-5
    err = (out8 - out32).abs().amax(-1)                                                  # [n - c, nh]
    assert (err <= bound).all(), f"max excess {(err - bound).max():.3g}"
    assert err.max() > 0, "the FP8 cache changed nothing: was it used?"


def test_fp8_calibration_on_first_prefill_only(fresh_seed):
    nh, nkv, hd, bs = 4, 2, 16, 16
    seqs = random_sequences([40, 20], nh, nkv, hd, torch.float32)
    seqs[1] = (seqs[1][0], 10 * seqs[1][1], 10 * seqs[1][2])  # a later prompt with far larger K/V
    r = PagedSequences(seqs, nh, nkv, hd, bs, FP8)
    layer = r.layer
    assert layer.k_scale.tolist() == [1.0] and layer.v_scale.tolist() == [1.0]
    r.prefill([(0, 0, 5)])
    # A decode step does not take the flag (nor change the scales); the next prefill does.
    layer.calibrate_next_prefill = calibrate_kv_scales
    r.decode([(0, 5)])
    assert layer.calibrate_next_prefill and layer.k_scale.tolist() == [1.0] and layer.v_scale.tolist() == [1.0]
    r.prefill([(0, 6, 16)])
    assert not layer.calibrate_next_prefill
    k0, v0 = seqs[0][1][6:16], seqs[0][2][6:16]
    want = (k0.abs().amax() / K_SCALE_HEADROOM).reshape(1), (v0.abs().amax() / V_SCALE_HEADROOM).reshape(1)
    assert torch.equal(layer.k_scale, want[0]) and torch.equal(layer.v_scale, want[1])
    # The calibrating prefill was stored with the new scales (the tokens before it with 1.0).
    assert torch.equal(r.cached(0, 0)[6:16].view(torch.uint8), (k0 / want[0]).clamp(-448, 448).to(FP8).view(torch.uint8))
    assert torch.equal(r.cached(0, 1)[:5].view(torch.uint8), seqs[0][2][:5].clamp(-448, 448).to(FP8).view(torch.uint8))
    # Later prefills and decodes leave the scales alone, however large their K/V.
    r.prefill([(1, 0, 20), (0, 16, 39)])
    r.decode([(0, 39)])
    assert torch.equal(layer.k_scale, want[0]) and torch.equal(layer.v_scale, want[1])


def test_fp8_calibration_keeps_a_usable_scale_for_zero_or_nonfinite_kv():
    layer = Attention(2, 16, 0.25, 1)
    zeros = torch.zeros(5, 1, 16)
    calibrate_kv_scales(zeros, torch.full((5, 1, 16), float("inf")), layer.k_scale, layer.v_scale)
    assert layer.k_scale.tolist() == [1.0] and layer.v_scale.tolist() == [1.0]


def _e4m3_midpoint_distance(x: torch.Tensor) -> torch.Tensor:
    """|x| / 448-clamped: its distance to the nearest e4m3 rounding midpoint, relative to the
    e4m3 spacing there (0: on a midpoint; 0.5: on an e4m3 value)."""
    a = x.abs().clamp(2.0 ** -6, 448.0)
    spacing = 2.0 ** (torch.floor(torch.log2(a)) - 3)
    frac = a / spacing - torch.floor(a / spacing)  # position inside the spacing, 0.5 = midpoint
    return (frac - 0.5).abs()


def test_fp8_calibrated_maxima_are_off_the_rounding_midpoints(fresh_seed):
    """issue 40, item 10: the calibrating prompt's largest |K| / |V| is stored as the headroom,
    which must not be an e4m3 rounding midpoint: calibrated from K/V with relative noise of a few
    fp32 ulps (what batching the prompt with others changes in its GEMMs), the largest values
    must be stored as the same codes. With vLLM's 200 / 100 (midpoints between 192 and 208, 96
    and 104) they round up or down with the noise, and the same prompt gave other tokens alone
    and in a batch."""
    assert _e4m3_midpoint_distance(torch.tensor([K_SCALE_HEADROOM, V_SCALE_HEADROOM])).min() > 0.25
    for _ in range(50):
        x = torch.randn(6, 2, 16) * 10 ** torch.empty(1).uniform_(-3, 3)
        top = x.abs().flatten().argmax()
        codes = set()
        for ulps in range(-4, 5):
            noisy = x * (1 + ulps * 2.0 ** -23)
            k_scale, v_scale = torch.ones(1), torch.ones(1)
            calibrate_kv_scales(noisy, noisy, k_scale, v_scale)
            for scale, headroom in ((k_scale, K_SCALE_HEADROOM), (v_scale, V_SCALE_HEADROOM)):
                stored = quantize_kv(noisy, scale).flatten()[top]
                codes.add((headroom, stored.float().abs().item()))
        assert len(codes) == 2, codes  # one code each for K and V, whatever the noise
        assert all(value == headroom for headroom, value in codes)


def test_kv_cache_dtype_names():
    assert KV_CACHE_DTYPES["auto"] is None  # the model's dtype
    assert KV_CACHE_DTYPES["fp8"] == KV_CACHE_DTYPES["fp8_e4m3"] == FP8
    for bad in ("fp8_e5m2", "bf16", "FP8", None):
        with pytest.raises(ValueError, match=r"kv_cache_dtype=.*'auto', 'fp8', 'fp8_e4m3'") as e:
            QuantizationConfig(kv_cache_dtype=bad)
        assert repr(bad) in str(e.value)


def test_fp8_bad_inputs_and_backend_selection(monkeypatch):
    k = torch.randn(3, 2, 16)
    slots = torch.arange(3, dtype=torch.int32)
    cache8 = torch.zeros(2, 16, 2, 16, dtype=FP8)
    cache32 = torch.zeros(2, 16, 2, 16)
    one = torch.ones(1)
    with pytest.raises(ValueError, match="FP8 KV cache needs k_scale"):
        TorchBackend().store_kv(k, k, cache8, cache8.clone(), slots)
    with pytest.raises(ValueError, match="only to an FP8 KV cache"):
        TorchBackend().store_kv(k, k, cache32, cache32.clone(), slots, one, one)
    meta = prefill_metadata([3], [3], slots, torch.zeros(1, 1, dtype=torch.int32), "cpu")
    with pytest.raises(ValueError, match="FP8 KV cache needs k_scale"):
        TorchBackend().forward(torch.randn(3, 4, 16), k, k, cache8, cache8, meta, 0.25)
    fa = FlashAttnBackend(module=make_flash_attn_stub([]))
    with pytest.raises(ValueError, match="flash_attn attention backend does not support an FP8"):
        fa.store_kv(k, k, cache8, cache8.clone(), slots, one, one)
    with pytest.raises(ValueError, match="flash_attn attention backend does not support an FP8"):
        fa.forward(torch.randn(3, 4, 16), k, k, cache8, cache8, meta, 0.25, one, one)

    with pytest.raises(ValueError, match="float8_e5m2"):
        select_backend("cpu", 16, kv_cache_dtype=torch.float8_e5m2)
    assert select_backend("cpu", 256, kv_cache_dtype=FP8).name == "torch"
    stub_cuda_backends(monkeypatch)
    assert select_backend("cuda", 256).name == "flash_attn"
    assert select_backend("cuda", 256, kv_cache_dtype=FP8).name == "triton"
    assert select_backend("cuda", 256, kv_cache_dtype=FP8).name == "triton"
    with pytest.raises(ValueError, match="does not support kv_cache_dtype='fp8'"):
        select_backend("cuda", 256, forced="flash_attn", kv_cache_dtype=FP8)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("block_size", [16, 256])
def test_triton_backend_fp8_matches_torch_on_gpu(case, block_size):
    """Prefill (fresh: round trip; prefix hit / chunked: the paged prefill kernel) and decode of the
    triton backend on an FP8 cache vs the torch backend on the same cache, and both vs fp32
    attention over the round-tripped K/V. bf16 throughout: 1e-2 as the bf16 tests above."""
    from nanovllm.kernels.paged_decode import choose_num_splits
    from nanovllm.model.attention.triton_backend import TritonBackend

    cached, new = CASES[case]
    q, ks, vs, kc, vc, bt = make_cache_scenario(cached, new, 16, 8, 128, block_size, torch.bfloat16, "cuda",
                                                seed=torch.seed() % 10_000)
    k_scale = (kc.abs().amax().float() / 200).reshape(1)
    v_scale = (vc.abs().amax().float() / 100).reshape(1)
    quant = lambda x, s: (x.float() / s).clamp(-448, 448).to(FP8)  # noqa: E731
    kc8, vc8 = quant(kc, k_scale), quant(vc, v_scale)
    ks_rt = [ref_round_trip(k, k_scale, torch.bfloat16) for k in ks]
    vs_rt = [ref_round_trip(v, v_scale, torch.bfloat16) for v in vs]
    scale = 128 ** -0.5
    k_new, v_new = dense_new_kv(ks, vs, new)
    meta = prefill_meta(cached, new, bt, "cuda")
    ref = reference_attention(q, ks_rt, vs_rt, new, scale).float()
    outs = {}
    for backend in (TorchBackend(), TritonBackend()):
        out = backend.forward(q, k_new, v_new, kc8, vc8, meta, scale, k_scale, v_scale).float()
        outs[backend.name] = out
        err = (out - ref).norm() / ref.norm()
        assert err < 1e-2, (backend.name, err.item())
    assert ((outs["triton"] - outs["torch"]).norm() / outs["torch"].norm()) < 1e-2

    # Decode of each sequence's last token over the same cache.
    ctx = [c + n for c, n in zip(cached, new)]
    qd = torch.randn(len(ctx), 16, 128, device="cuda", dtype=torch.bfloat16)
    ref = reference_attention(qd, ks_rt, vs_rt, [1] * len(ctx), scale).float()
    splits = choose_num_splits(len(ctx), 8, bt.size(1))
    for backend in (TorchBackend(), TritonBackend()):
        out = backend.forward(qd, None, None, kc8, vc8, decode_meta(ctx, bt, "cuda", splits), scale,
                              k_scale, v_scale).float()
        err = (out - ref).norm() / ref.norm()
        assert err < 1e-2, (backend.name, err.item())
