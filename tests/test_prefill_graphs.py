"""Piecewise CUDA graphs for prefill-shaped steps (features/prefill_graphs.py).

On CPU: the token buckets, the option's checks and the attention layer's cut hook. On the GPU
(marked gpu): the replayed pieces against the eager forward on fresh random batches, and whole
engines with and without the graphs (mixed steps, chunking, prefix hits, prompt logprobs, steps
above the largest bucket) giving the same greedy tokens.
"""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import BLOCK, assert_idle, greedy, make_llm, rand_ids  # noqa: E402

from nanovllm import SamplingParams  # noqa: E402
from nanovllm.config import Config  # noqa: E402
from nanovllm.features.prefill_graphs import PrefillGraphs, prefill_graph_sizes  # noqa: E402
from nanovllm.model.attention import Attention  # noqa: E402
from nanovllm.model.attention import prefill_metadata  # noqa: E402


@pytest.mark.parametrize("max_tokens", [1, 16, 100, 256, 1000, 2048, 5000])
def test_buckets_cover_every_size_with_bounded_padding(max_tokens):
    sizes = prefill_graph_sizes(max_tokens)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_tokens and sizes[0] <= 16
    for t in range(1, max_tokens + 1):
        b = next(s for s in sizes if s >= t)
        # Padding: below 256 tokens at most the next power of two (and at least 16 rows);
        # above it, at most 255 rows.
        assert b - t <= (max(t, 16) if t <= 256 else 255), (t, b)
    assert prefill_graph_sizes(0) == []


def test_option_is_checked(ckpt):
    with pytest.raises(ValueError, match="max_prefill_graph_tokens"):
        Config.from_kwargs(ckpt, max_prefill_graph_tokens=-1)
    with pytest.raises(ValueError, match="max_prefill_graph_tokens"):
        Config.from_kwargs(ckpt, max_prefill_graph_tokens=2.5)
    assert Config(ckpt).prefill_graphs.max_tokens == 2048


def test_attention_hands_its_call_to_the_cut_hook():
    layer = Attention(4, 8, 0.5, 2)
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    seen = []
    layer.graph_break = lambda *args: seen.append(args) or "cut"
    assert layer(q, k, v, "meta", kv_stored=False) == "cut"
    (got,) = seen
    assert got[0] is layer and got[1] is q and got[2] is k and got[3] is v and got[4] == "meta" and got[5] is False


# ---------------------------------------------------------------------------- GPU
FUSE = pytest.mark.parametrize("fuse", ["1"], ids=["fused_store"])  # (the store is always fused on CUDA)


@pytest.mark.gpu
@FUSE
def test_replayed_pieces_match_the_eager_forward(ckpt, monkeypatch, fuse):
    """Fresh random prompts packed varlen (no cached prefix), through the bucket's pieces and
    through the plain forward: the same hidden states up to fp32 summation order (the padded
    GEMMs may pick other kernels; 1e-4 relative is ~1,000 fp32 ulps, far below what a wrong
    row, piece or buffer would give, which is O(1)). With the K/V store fused into the pieces
    too: the same cache rows as the eager forward's store, at the step's slots (not the
    capture's), none written for padding rows."""
    llm = make_llm(ckpt, device="cuda", dtype="float32", max_num_batched_tokens=512, max_prefill_graph_tokens=300)
    try:
        runner = llm.model_runner
        graphs = runner.forward_strategy.graphs
        assert isinstance(graphs, PrefillGraphs) and graphs.sizes[-1] == 300
        # The pieces store K/V themselves exactly when the store is fused.
        assert all(all(b.kv_stored) == (fuse == "1") and any(b.kv_stored) == (fuse == "1")
                   for b in graphs.buckets.values())
        rng = random.Random()
        seed = rng.randrange(1 << 30)
        rng.seed(seed)
        gen = torch.Generator().manual_seed(seed)
        vocab = llm.config.hf_config.vocab_size
        cache = runner.kv_cache  # [K/V, layer, block, offset, kv head, dim], fp32 here
        num_slots = cache.shape[2] * cache.shape[3]
        # Largest step first: the padding rows of every later step held real slots in an earlier
        # one, so a padding row replayed with a stale slot would write where it must not.
        for total in (300, 255, 64, 17, 1):
            lens, left = [], total
            while left:
                lens.append(min(left, rng.randint(1, 80)))
                left -= lens[-1]
            ids = torch.tensor([rng.randrange(vocab) for _ in range(total)], device="cuda")
            pos = torch.cat([torch.arange(n) for n in lens]).cuda()
            slots = torch.randperm(num_slots, generator=gen)[:total].to(torch.int32)  # distinct, each step its own
            stored, out = [], {}
            for run in ("graphs", "eager"):
                cache.fill_(float("nan"))  # poisoned: exactly the step's slots are written, in every layer
                meta = prefill_metadata(lens, lens, slots, None, "cuda")
                graphs.hidden.fill_(float("nan"))  # poisoned: every row read must be written
                with torch.inference_mode():
                    out[run] = graphs.run(ids, pos, meta).clone() if run == "graphs" else runner.model(ids, pos, meta)
                stored.append(cache.flatten(2, 3).clone())  # [K/V, layer, slot, kv head, dim]
            got, want = out["graphs"], out["eager"]
            assert got.shape == want.shape and torch.isfinite(got).all(), (seed, total)
            err = ((got - want).norm() / want.norm()).item()
            assert err < 1e-4, f"seed {seed}, {total} tokens in {lens}: relative error {err:.2e}"
            want_rows = torch.zeros(num_slots, dtype=torch.bool)
            want_rows[slots.long()] = True
            for c in stored:  # every (K/V, layer) wrote exactly the step's slots, whole rows
                written = ~c.isnan().flatten(3).all(3)
                assert torch.equal(written.cpu(), want_rows.expand_as(written.cpu())), (seed, total)
                assert not c[:, :, slots.long()].isnan().any(), (seed, total)
            a, b = stored[0][:, :, slots.long()], stored[1][:, :, slots.long()]
            kv_err = ((a - b).norm() / b.norm()).item()
            assert kv_err < 1e-4, f"seed {seed}, {total} tokens: cached K/V relative error {kv_err:.2e}"
    finally:
        llm.shutdown()


# (cached, new) tokens of each sequence of a mixed step; decode rows (new == 1, cached > 0) last
MIXED_STEPS = {
    "prompts+decode": [(0, 40), (0, 17), (30, 1), (200, 1), (77, 1), (1, 1), (129, 1)],
    "decode_rows_only": [(45, 1), (3, 1), (160, 1), (64, 1), (90, 1), (12, 1)],
    "largest_bucket": [(0, 250), *[(20 * i + 5, 1) for i in range(8)]],
    "prefix_hit": [(20, 30), (100, 1), (31, 1), (250, 1)],
    "too_many_decode_rows": [(0, 5), *[(10 * i + 3, 1) for i in range(10)]],  # 10 > the 8 the pieces attend
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
@pytest.mark.parametrize("case", sorted(MIXED_STEPS))
def test_replayed_pieces_attend_a_mixed_steps_decode_rows(ckpt, case, dtype, tol):
    """A mixed step (prompt tokens, then one-token decode rows over their cached K/V), through
    the bucket's pieces, which attend up to 8 decode rows themselves (the decode kernel inside
    each piece; more rows: the eager attention), and through the plain forward, from the same
    random cache: the same hidden states and the same K/V stored at the step's slots. Fused
    store (the default). fp32: 1e-4 relative, as above. bf16 (the prompt tokens through aten's
    FlashAttention, as served): every activation rounds to 2**-8, and the pieces' decode kernel
    splits the contexts differently from the eager call and their padded GEMMs may pick other
    kernels, so a row can differ by a few bf16 ulps; 3e-2 is still far below what a wrong row,
    slot or table gives (O(1))."""
    llm = make_llm(ckpt, device="cuda", dtype=dtype, max_num_batched_tokens=512, max_prefill_graph_tokens=300,
                   max_num_seqs=8, num_kvcache_blocks=512)
    try:
        runner = llm.model_runner
        graphs = runner.forward_strategy.graphs
        assert {n: b.decode_rows for n, b in graphs.buckets.items()} == {n: min(8, n) for n in graphs.sizes}
        rows = MIXED_STEPS[case]
        seed = random.randrange(1 << 30)
        gen = torch.Generator().manual_seed(seed)
        vocab = llm.config.hf_config.vocab_size
        cache = runner.kv_cache
        blocks_each = -(-max(c + n for c, n in rows) // BLOCK)
        order = torch.randperm(cache.shape[2], generator=gen)[:blocks_each * len(rows)].view(len(rows), blocks_each)
        tables = order.to(torch.int32).cuda()
        q_lens, kv_lens = [n for _, n in rows], [c + n for c, n in rows]
        slots = torch.tensor([int(order[i, p // BLOCK]) * BLOCK + p % BLOCK
                              for i, (c, n) in enumerate(rows) for p in range(c, c + n)], dtype=torch.int32)
        ids = torch.randint(vocab, (sum(q_lens),), generator=gen).cuda()
        pos = torch.cat([torch.arange(c, c + n) for c, n in rows]).cuda()
        start = torch.randn(cache.shape, generator=gen).to(cache.device)
        decode = sum(1 for c, n in rows if n == 1 and c > 0)
        out, stored = {}, {}
        for run in ("graphs", "eager"):
            cache.copy_(start)
            meta = prefill_metadata(q_lens, kv_lens, slots, tables, "cuda")
            meta.num_decode_rows = decode
            meta.num_splits = runner.inputs.num_splits(decode, tables.size(1))
            with torch.inference_mode():
                out[run] = graphs.run(ids, pos, meta).clone() if run == "graphs" else runner.model(ids, pos, meta)
            stored[run] = cache.flatten(2, 3)[:, :, slots.long()].clone()
        got, want = out["graphs"], out["eager"]
        assert got.shape == want.shape and torch.isfinite(got).all(), seed
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < tol, f"seed {seed}, {case}: relative error {err:.2e}"
        a, b = stored["graphs"].float(), stored["eager"].float()
        kv_err = ((a - b).norm() / b.norm()).item()
        assert kv_err < tol, f"seed {seed}, {case}: stored K/V relative error {kv_err:.2e}"
    finally:
        llm.shutdown()


@pytest.mark.gpu
@FUSE
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_engines_with_and_without_prefill_graphs_agree(ckpt, monkeypatch, fuse, kv_cache_dtype):
    """Mixed steps (decode rows beside prompt chunks, their inputs taken from the device),
    chunked prompts, prefix hits (cached blocks read back in the eager attention) and prompt
    logprobs, with a bucket cap below the step budget so that some steps run eagerly. fp32.
    Three sequences at a time: later prompts arrive while others decode, in steps of a few
    tokens (graphs); the first ones fill the 64-token budget (eager). With the K/V store in its
    own kernel or fused into the pieces, and a bf16 or FP8 cache."""
    shared = rand_ids(48, seed=3)
    prompts = [rand_ids(n, seed=20 + n) for n in (5, 70, 33, 140, 9)] + [shared + [1, 2], shared + [3]]
    params = [greedy(12 + 4 * i) for i in range(len(prompts))]
    params[1] = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=2)
    results, replays = {}, {}
    for cap in (0, 40):
        llm = make_llm(ckpt, device="cuda", dtype="float32", max_num_batched_tokens=64, mixed_steps=True,
                       max_num_seqs=3, max_prefill_graph_tokens=cap, kv_cache_dtype=kv_cache_dtype)
        try:
            strategy = llm.model_runner.forward_strategy
            graphs = strategy and strategy.graphs
            assert (graphs is None) == (cap == 0)
            count = {"graph": 0, "eager": 0}
            if graphs is not None:
                run, fits = graphs.run, graphs.bucket_for

                def counting_run(*a, _run=run):
                    count["graph"] += 1
                    return _run(*a)

                def counting_fits(n, _fits=fits):
                    count["eager"] += _fits(n) is None
                    return _fits(n)

                graphs.run, graphs.bucket_for = counting_run, counting_fits
            out = llm.generate(prompts, params, use_tqdm=False)
            results[cap] = out
            replays[cap] = count
            assert_idle(llm)
        finally:
            llm.shutdown()
    assert replays[40]["graph"] > 0 and replays[40]["eager"] > 0, replays
    for a, b in zip(results[0], results[40]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    lp_eager, lp_graph = results[0][1].prompt_logprobs, results[40][1].prompt_logprobs
    assert lp_eager[0] is None and lp_graph[0] is None and len(lp_eager) == len(lp_graph) == 70
    for a, b in zip(lp_eager[1:], lp_graph[1:]):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) <= 1e-4 for t in a)


@pytest.mark.gpu
def test_fp8_scale_calibration_in_a_replayed_prefill(ckpt, monkeypatch):
    """calculate_kv_scales=True with the K/V store fused into the pieces: the first prefill (it
    fits a bucket) stores K/V from inside a piece with the scales of before, then its eager
    attention calibrates and stores again. The scales, greedy tokens and logprobs must be the
    ones of an engine that runs that prefill eagerly."""
    prompts = [rand_ids(30, seed=5), rand_ids(21, seed=6)]
    params = [greedy(10, logprobs=1), greedy(6, logprobs=1)]
    seen = {}
    for cap in (0, 64):
        llm = make_llm(ckpt, device="cuda", dtype="float32", max_num_batched_tokens=64, max_num_seqs=1,
                       max_prefill_graph_tokens=cap, kv_cache_dtype="fp8", calculate_kv_scales=True)
        try:
            assert (llm.model_runner.forward_strategy is None) == (cap == 0)
            out = llm.generate(prompts, params, use_tqdm=False)
            layers = llm.model_runner.attn_layers
            assert not any(a.calibrate_next_prefill for a in layers)
            seen[cap] = ([(o.outputs[0].token_ids, [sorted(lp.items()) for lp in o.outputs[0].logprobs]) for o in out],
                         [(a.k_scale.item(), a.v_scale.item()) for a in layers])
        finally:
            llm.shutdown()
    (toks0, scales0), (toks1, scales1) = seen[0], seen[64]
    assert all(k != 1.0 and v != 1.0 for k, v in scales0)  # calibrated, not the initial scales
    flat0, flat1 = [x for kv in scales0 for x in kv], [x for kv in scales1 for x in kv]
    assert flat1 == pytest.approx(flat0, rel=1e-5)  # the same K/V up to fp32 summation order
    assert [t for t, _ in toks1] == [t for t, _ in toks0]
