"""Sampler: exact filter masks, greedy/suppress, distribution, per-row reproducibility."""

import dataclasses
import functools
import itertools
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from nanovllm.core import sampler as sampler_mod
from nanovllm.core import triton_sampler as triton_mod
from nanovllm.core.random_draw import _mix32_, apply_filters, hash_uniform
from nanovllm.core.sampler import Sampler, SamplingTensors
from nanovllm.core.triton_sampler import TritonSampler, gumbel_argmax_triton
from nanovllm.launch import shard_sampling
from nanovllm.sampling_params import SamplingParams as SP

# Upper 0.1% points of the chi-square distribution, by degrees of freedom.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322,
            8: 26.124, 9: 27.877, 15: 37.697}

# Probabilities that are far from every threshold used below.
PROBS = [0.5, 0.2, 0.15, 0.1, 0.05]
# The same distribution, shuffled so that vocabulary order differs from probability order.
PERM = [3, 0, 4, 1, 2]  # token PERM[i] has probability PROBS[i]


def tensors(params, seeds=None, offsets=None, device="cpu"):
    n = len(params)
    seeds = list(range(1000, 1000 + n)) if seeds is None else seeds
    offsets = [0] * n if offsets is None else offsets
    return SamplingTensors.build(params, seeds, offsets, device)


def shuffled_logits():
    row = torch.empty(len(PROBS))
    for tok, p in zip(PERM, PROBS):
        row[tok] = math.log(p)
    return row


def keep_set(row, **kw):
    x = apply_filters(torch.as_tensor(row, dtype=torch.float32)[None], tensors([SP(**kw)]))
    return set(torch.nonzero(torch.isfinite(x[0])).flatten().tolist())


def toks(*ranks):
    """Token ids of the given probability ranks (0 = most likely) in shuffled_logits()."""
    return {PERM[r] for r in ranks}


# ---------------------------------------------------------------- exact masks


def test_top_k_mask_with_ties():
    row = [5.0, 3.0, 3.0, 1.0, 0.0, 4.0]
    assert keep_set(row, top_k=1) == {0}
    assert keep_set(row, top_k=2) == {0, 5}
    # Both 3.0s tie with the 3rd largest: both are kept (4 tokens for k=3).
    assert keep_set(row, top_k=3) == {0, 5, 1, 2}
    assert keep_set(row, top_k=4) == {0, 5, 1, 2}
    assert keep_set(row, top_k=5) == {0, 1, 2, 3, 5}
    assert keep_set(row, top_k=100) == set(range(6))
    assert keep_set(row, top_k=-1) == set(range(6))
    assert keep_set(row, top_k=0) == set(range(6))


def test_top_p_mask():
    row = shuffled_logits()
    # Prefix masses in rank order: 0.5, 0.7, 0.85, 0.95, 1.0.
    assert keep_set(row, top_p=0.01) == toks(0)  # tiny top_p: only the top token
    assert keep_set(row, top_p=0.3) == toks(0)
    assert keep_set(row, top_p=0.6) == toks(0, 1)
    assert keep_set(row, top_p=0.75) == toks(0, 1, 2)
    assert keep_set(row, top_p=0.9) == toks(0, 1, 2, 3)
    assert keep_set(row, top_p=0.97) == toks(0, 1, 2, 3, 4)
    assert keep_set(row, top_p=1.0) == toks(0, 1, 2, 3, 4)


def test_top_p_ties_with_last_kept_token_are_kept():
    row = torch.log(torch.tensor([0.2, 0.4, 0.2, 0.2]))
    # 0.4 + 0.2 already reaches 0.5, but the other 0.2s tie with the second token.
    assert keep_set(row, top_p=0.5) == {0, 1, 2, 3}
    assert keep_set(row, top_p=0.3) == {1}


def test_top_p_uses_temperature_scaled_distribution():
    row = shuffled_logits()
    assert keep_set(row, top_p=0.6) == toks(0, 1)
    # At T=2 the masses are 0.340, 0.555, 0.741, ... so a third token is needed.
    assert keep_set(row, top_p=0.6, temperature=2.0) == toks(0, 1, 2)


def test_min_p_mask():
    row = shuffled_logits()
    assert keep_set(row, min_p=0.0) == toks(0, 1, 2, 3, 4)
    assert keep_set(row, min_p=0.25) == toks(0, 1, 2)  # threshold p = 0.125
    assert keep_set(row, min_p=0.35) == toks(0, 1)  # threshold p = 0.175
    assert keep_set(row, min_p=0.9) == toks(0)
    # min_p = 1 keeps exactly the tokens tied for the maximum.
    assert keep_set([2.0, 2.0, 1.0], min_p=1.0) == {0, 1}


def test_combined_filters():
    row = shuffled_logits()
    # top-p runs on the top-k distribution renormalised to 0.95: masses 0.526, 0.737, 0.895.
    assert keep_set(row, top_k=4, top_p=0.72) == toks(0, 1)
    assert keep_set(row, top_p=0.72) == toks(0, 1, 2)  # without top-k, 0.7 < 0.72
    # Each filter removes one more token: top-k the 5th, top-p the 4th, min-p the 3rd.
    assert keep_set(row, top_k=4) == toks(0, 1, 2, 3)
    assert keep_set(row, top_k=4, top_p=0.85) == toks(0, 1, 2)
    assert keep_set(row, top_k=4, top_p=0.85, min_p=0.35) == toks(0, 1)
    assert keep_set(row, top_k=1, top_p=1.0, min_p=0.0) == toks(0)


def test_batched_masks_match_single_rows():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 40, generator=gen) * 2
    params = [SP(top_k=5), SP(top_p=0.5), SP(min_p=0.2), SP(temperature=0.0, top_k=3),
              SP(top_k=10, top_p=0.8, min_p=0.05), SP(), SP(temperature=0.5, top_p=0.9)]
    batched = apply_filters(logits, tensors(params))
    for i, p in enumerate(params):
        alone = apply_filters(logits[i:i + 1], tensors([p]))
        assert torch.equal(torch.isfinite(batched[i]), torch.isfinite(alone[0])), i
    # Greedy rows are neither scaled nor filtered.
    assert torch.equal(batched[3], logits[3])


def _reference_keep(logits, temperature, top_k, top_p, min_p):
    """Float64 keep-set with the documented semantics, or None if some mass is near a cut."""
    l = [v / temperature for v in logits]
    n = len(l)
    keep = set(range(n))
    if top_k > 0 and top_k < n:
        kth = sorted(l, reverse=True)[top_k - 1]
        keep = {i for i in keep if l[i] >= kth}
    if top_p < 1.0:
        m = max(l[i] for i in keep)
        w = {i: math.exp(l[i] - m) for i in keep}
        total = sum(w.values())
        order = sorted(keep, key=lambda i: -w[i])
        mass, last = 0.0, None
        for i in order:
            if last is None or mass < top_p:
                last = w[i]
            else:
                break
            mass += w[i] / total
            if abs(mass - top_p) < 1e-4:
                return None
        keep = {i for i in keep if w[i] >= last}
    if min_p > 0.0:
        m = max(l)
        ratios = {i: math.exp(l[i] - m) for i in range(n)}
        if any(abs(r - min_p) < 1e-4 and r < 1.0 for r in ratios.values()):
            return None
        keep = {i for i in keep if ratios[i] >= min_p}
    return keep


@settings(max_examples=300, deadline=None)
@given(
    logits=st.lists(st.integers(-6, 6), min_size=1, max_size=12).map(lambda v: [x / 2 for x in v]),
    temperature=st.sampled_from([0.5, 1.0, 2.0]),
    top_k=st.integers(-1, 14),
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 0.99)),
)
def test_filters_match_reference(logits, temperature, top_k, top_p, min_p):
    expected = _reference_keep(logits, temperature, top_k, top_p, min_p)
    assume(expected is not None)
    got = keep_set(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    assert got == expected


# ---------------------------------------------------------------- greedy and suppress


def test_greedy_rows_are_argmax_in_mixed_batch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 300, generator=gen)
    params = [SP(temperature=0.0) if i % 3 == 0 else SP(temperature=1.5, top_k=20, top_p=0.9)
              for i in range(16)]
    sampler = Sampler()
    out = sampler(logits, tensors(params))
    assert out.dtype == torch.int64 and out.shape == (16,)
    ref = logits.argmax(-1)
    for i in range(0, 16, 3):
        assert out[i] == ref[i]
    # At T=1.5 over 300 tokens the random rows almost never land on the argmax.
    assert sum(int(out[i] != ref[i]) for i in range(16) if i % 3) >= 5
    assert torch.equal(sampler(logits, tensors([SP(temperature=0.0)] * 16)), ref)


def test_suppress_greedy_and_sampled():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 50, generator=gen)
    top2 = logits.topk(2, dim=-1).indices
    sampler = Sampler()
    rows = torch.tensor([0, 2, 2])
    cols = torch.stack([top2[0, 0], top2[2, 0], top2[2, 0]])  # repeats are allowed
    greedy = tensors([SP(temperature=0.0)] * 4)
    out = sampler(logits, greedy, suppress=(rows, cols))
    assert out.tolist() == [top2[0, 1], top2[1, 0], top2[2, 1], top2[3, 0]]
    # Mixed batch: greedy row 0 and random row 2 never pick what is suppressed.
    n = 2000
    big = logits[[0, 2]].repeat(n, 1)
    banned = [int(top2[0, 0]), int(top2[2, 0]), int(top2[2, 1])]
    rows = torch.arange(2 * n).repeat_interleave(3)
    cols = torch.tensor(banned).repeat(2 * n)
    params = [SP(temperature=0.0), SP(temperature=2.0)] * n
    t = tensors(params, seeds=[7] * (2 * n), offsets=list(range(2 * n)))
    out = sampler(big, t, suppress=(rows, cols))
    assert not torch.isin(out, torch.tensor(banned)).any()
    assert (out[0::2] == top2[0, 1]).all()
    assert out[1::2].unique().numel() > 10


# ---------------------------------------------------------------- distribution


def _chi2(counts, probs, n):
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a filtered-out token"
    expected = probs[support].double() * n
    stat = ((counts[support].double() - expected) ** 2 / expected).sum().item()
    return stat, int(support.sum()) - 1


BASE = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.5, 0.3, 0.0, -0.5, -1.0, -2.0])


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=8, top_p=0.9, min_p=0.05),
    dict(temperature=1.3, min_p=0.1),
])
@pytest.mark.parametrize("vary", ["offsets", "seeds"])
def test_sampled_frequencies_match_filtered_softmax(kw, vary):
    n = 20000
    p = SP(**kw)
    if vary == "offsets":
        t = tensors([p] * n, seeds=[42] * n, offsets=list(range(n)))
    else:
        t = tensors([p] * n, seeds=list(range(n)), offsets=[5] * n)
    out = Sampler()(BASE.repeat(n, 1), t)
    counts = torch.bincount(out, minlength=BASE.numel())
    probs = torch.softmax(apply_filters(BASE[None], tensors([p]))[0], dim=-1)
    stat, df = _chi2(counts, probs, n)
    assert stat < CHI2_999[df], (stat, df)
    # The test has teeth: a slightly different temperature over the same support fails it.
    hotter = SP(**{**kw, "temperature": kw["temperature"] * 1.15})
    wrong = torch.softmax(apply_filters(BASE[None], tensors([hotter]))[0], dim=-1)
    wrong = torch.where(probs > 0, wrong, 0.0)
    wrong = wrong / wrong.sum()
    stat_wrong, _ = _chi2(counts, wrong, n)
    assert stat_wrong > CHI2_999[df], stat_wrong


def test_uniform_noise_sanity():
    seeds = torch.arange(64, dtype=torch.int64) * 7919 - 100
    offsets = torch.arange(64, dtype=torch.int64)
    u = hash_uniform(seeds, offsets, 4096)
    assert u.shape == (64, 4096) and u.dtype == torch.float32
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.003
    assert abs(u.var().item() - 1 / 12) < 0.002
    counts = torch.histc(u, bins=16, min=0, max=1)
    exp = u.numel() / 16
    assert ((counts - exp) ** 2 / exp).sum() < CHI2_999[15]
    # Neighbouring tokens, rows and offsets are uncorrelated.
    c = u - 0.5
    assert abs((c[:, 1:] * c[:, :-1]).mean().item()) < 0.002
    assert abs((c[1:] * c[:-1]).mean().item()) < 0.002
    # Values are (2j + 1) / 2**24: odd multiples of 2**-24, exactly.
    j = (u.double() * 2**24).round()
    assert torch.equal(j, u.double() * 2**24) and (j.long() % 2 == 1).all()
    # Extreme seeds (full int64 range) still land in (0, 1).
    ext = torch.tensor([-(2**63), 2**63 - 1, 0, -1])
    v = hash_uniform(ext, ext, 1000)
    assert v.min() > 0 and v.max() < 1 and v.unique().numel() > 3900


def test_mix32_matches_reference_lowbias32():
    def lowbias32(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        x ^= x >> 16
        return x

    vals = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF]
    got = _mix32_(torch.tensor(vals, dtype=torch.int64)).tolist()
    assert got == [lowbias32(v) for v in vals]


# ---------------------------------------------------------------- reproducibility


def test_row_independent_of_batch_composition():
    gen = torch.Generator().manual_seed(3)
    vocab = 1000
    sampler = Sampler()
    targets = [SP(temperature=0.9), SP(temperature=0.8, top_k=50, top_p=0.9),
               SP(temperature=1.2, min_p=0.05), SP(temperature=1.0, top_k=7)]
    others = [SP(temperature=0.0), SP(top_p=0.5), SP(top_k=3), SP(min_p=0.3, temperature=2.0),
              SP(top_k=200, top_p=0.95)]
    for trial in range(12):
        p = targets[trial % len(targets)]
        row = torch.randn(1, vocab, generator=gen) * 3
        seed, off = 17 * trial - 5, 3 * trial
        alone = sampler(row, tensors([p], [seed], [off]))
        for size in (2, 5, 17):
            pos = trial % size
            logits = torch.randn(size, vocab, generator=gen) * 3
            logits[pos] = row[0]
            params = [others[(i + trial) % len(others)] for i in range(size)]
            params[pos] = p
            seeds = [seed + 1 + i for i in range(size)]
            seeds[pos] = seed
            offs = [i * 11 for i in range(size)]
            offs[pos] = off
            out = sampler(logits, tensors(params, seeds, offs))
            assert out[pos] == alone[0], (trial, size)


def test_seeds_and_offsets_drive_the_stream():
    vocab, n = 1000, 300
    logits = torch.zeros(n, vocab)  # uniform distribution: the token is pure noise
    sampler = Sampler()
    p = [SP()] * n
    a = sampler(logits, tensors(p, [1] * n, list(range(n))))
    a2 = sampler(logits, tensors(p, [1] * n, list(range(n))))
    b = sampler(logits, tensors(p, [2] * n, list(range(n))))
    shifted = sampler(logits, tensors(p, [1] * n, list(range(1, n + 1))))
    assert torch.equal(a, a2)
    assert (a == b).float().mean() < 0.02  # different seeds: unrelated streams
    assert a.unique().numel() > 200  # offsets advance the stream
    assert torch.equal(shifted[:-1], a[1:])  # the stream is indexed by position


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits(dtype):
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(8, 500, generator=gen) * 2).to(dtype)
    params = [SP(temperature=0.0), SP(top_k=20), SP(top_p=0.9), SP(min_p=0.1)] * 2
    t = tensors(params)
    sampler = Sampler()
    out = sampler(logits, t)
    assert out.dtype == torch.int64
    assert torch.equal(out, sampler(logits.float(), t))


def test_build_flags_and_dtypes():
    t = tensors([SP(temperature=0.0, top_k=5, top_p=0.5, min_p=0.5), SP(top_k=10)],
                seeds=[2**64 + 3, -1])
    assert t.temperatures.dtype == torch.float32 and t.top_ks.dtype == torch.int64
    assert t.seeds.tolist() == [3, -1]
    assert t.any_greedy and not t.all_greedy
    assert t.need_top_k and not t.need_top_p and not t.need_min_p  # greedy filters ignored
    assert t.sort_k == 10
    assert tensors([SP(top_p=0.9), SP(top_k=4)]).sort_k == -1
    t = tensors([SP(temperature=0.0)])
    assert t.all_greedy and t.sort_k == 0


# ---------------------------------------------------------------- fused kernel and CUDA


def gumbel_scores(logits, t, suppress=None):
    """What the torch path takes the argmax of."""
    u = hash_uniform(t.seeds, t.offsets, logits.shape[-1])
    return apply_filters(logits, t, suppress) - u.log().neg().log()


def assert_same_up_to_near_ties(a, b, scores):
    """Token ids agree, except where the two picks' scores differ only by float rounding."""
    for i in (a.cpu() != b.cpu()).nonzero().flatten().tolist():
        gap = abs(scores[i, a[i]] - scores[i, b[i]]).item()
        assert gap < 1e-4 * max(1.0, abs(scores[i, a[i]].item())), (i, gap)
    assert (a.cpu() != b.cpu()).sum() <= max(1, a.numel() // 20)


@pytest.mark.skipif(triton_mod.triton is None, reason="needs Triton")
def test_fused_kernel_matches_torch_path():
    # On CPU this runs through Triton's interpreter (conftest switches it on).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(6)
    b, vocab = 6, 1000  # several chunks, the last one partial
    logits = torch.randn(b, vocab, generator=gen) * 2
    params = [SP(), SP(temperature=0.7, top_k=20, top_p=0.8), SP(top_p=0.95, min_p=0.05),
              SP(temperature=1.5), SP(top_k=1), SP(min_p=0.5)]
    # Seeds and offsets that use the high 32 bits and the sign, to check the key derivation.
    seeds = [-(2**63), -1, 2**40 + 3, 0, 12345, 2**63 - 1]
    offsets = [0, 2**33 + 1, 7, 2**62, 5, 1]
    t = tensors(params, seeds, offsets)
    ref = Sampler()(logits, t)  # CPU: torch path

    def fused(x, thr=None):
        thr = None if thr is None else thr.to(device)
        out = gumbel_argmax_triton(x.to(device), thr, t.seeds.to(device), t.offsets.to(device),
                                   chunk=256, block=64)  # small tiles keep the interpreter fast
        return out.cpu()

    assert_same_up_to_near_ties(ref, fused(apply_filters(logits, t)), gumbel_scores(logits, t))
    # The threshold form drops exactly the tokens that masking drops.
    thr = torch.full((b,), float("-inf"))
    thr[1] = logits[1].sort(descending=True).values[3]  # keep the top 4 tokens of row 1
    masked = logits.clone()
    masked[1][masked[1] < thr[1]] = float("-inf")
    got = fused(logits, thr)
    assert got[1] in logits[1].topk(4).indices
    assert torch.equal(got, fused(masked))


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter


def random_rows(gen, b, vocab, dtype):
    """Fresh logits [b, vocab] in dtype and SamplingTensors with a different temperature per
    row (some exactly representable, some not), no filters and full-range seeds/offsets."""
    logits = (torch.randn(b, vocab, generator=gen) * 3).to(dtype)
    temps = [0.05, 0.6, 1.0, 1.7] + (torch.rand(b - 4, generator=gen) * 2.4 + 0.1).tolist()
    seeds = torch.randint(-(2**63), 2**63 - 1, (b,), generator=gen).tolist()
    offsets = torch.randint(0, 2**40, (b,), generator=gen).tolist()
    return logits, tensors([SP(temperature=x) for x in temps], seeds, offsets)


def fused_and_unfused(logits, t):
    """Tokens with the scaling inside the kernel, and with torch.div first (the old route)."""
    temps, seeds, offs = (v.to(DEVICE) for v in (t.temperatures, t.seeds, t.offsets))
    x = logits.to(DEVICE)
    kw = dict(chunk=256, block=64)  # small tiles keep the interpreter fast
    fused = gumbel_argmax_triton(x, None, seeds, offs, temps, **kw)
    unfused = gumbel_argmax_triton(torch.div(x, temps[:, None]), None, seeds, offs, **kw)
    return fused.cpu(), unfused.cpu()


@pytest.mark.skipif(triton_mod.triton is None, reason="needs Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_scaling_matches_unfused_route_and_torch_path(dtype):
    gen = torch.Generator()
    seed = gen.seed()  # fresh inputs each run; the seed is in every failure message
    vocab = 1000  # 4 chunks of 256, the last one partial, and not a multiple of the block
    logits, t = random_rows(gen, 12, vocab, dtype)
    fused, unfused = fused_and_unfused(logits, t)
    assert torch.equal(fused, unfused), seed
    ref = Sampler()(logits, t)  # CPU: hash_uniform + Gumbel argmax in torch
    assert_same_up_to_near_ties(ref, fused, gumbel_scores(logits, t))


@pytest.mark.skipif(triton_mod.triton is None, reason="needs Triton")
def test_kernel_scaling_rounds_like_torch_div():
    # Rows where every token's score x / T - log(-log u) is the same value up to a few ulps,
    # so the token is decided by how x / T rounds: a kernel that multiplied by 1 / T, or
    # divided approximately, would pick other tokens.
    gen = torch.Generator()
    seed = gen.seed()
    vocab = 1000
    _, t = random_rows(gen, 12, vocab, torch.float32)
    gumbel = -hash_uniform(t.seeds, t.offsets, vocab).log().neg().log()
    level = torch.randn(12, 1, generator=gen) * 3
    logits = (level - gumbel) * t.temperatures[:, None]
    fused, unfused = fused_and_unfused(logits, t)
    assert torch.equal(fused, unfused), seed
    assert fused.unique().numel() > 6, seed  # the rows do not all land on one token


@pytest.mark.skipif(triton_mod.triton is None, reason="needs Triton")
def test_sampler_scales_in_kernel_only_when_eligible(monkeypatch):
    # Send CPU tensors down the Triton route too (through the interpreter).
    monkeypatch.setattr(triton_mod, "_use_triton", lambda x: True)
    calls = []
    real_scaled = triton_mod._scaled
    monkeypatch.setattr(triton_mod, "_scaled", lambda *a: calls.append(1) or real_scaled(*a))
    gen = torch.Generator()
    seed = gen.seed()
    sampler = TritonSampler()
    for dtype in (torch.bfloat16, torch.float32):
        logits, t = random_rows(gen, 8, 1000, dtype)
        t_dev = tensors([SP(temperature=x) for x in t.temperatures.tolist()],
                        t.seeds.tolist(), t.offsets.tolist(), device=DEVICE)
        out = sampler(logits.to(DEVICE), t_dev).cpu()
        assert not calls, seed  # no fp32 [B, V] copy of the logits
        assert torch.equal(out, fused_and_unfused(logits, t)[0]), seed
    logits = torch.randn(4, 1000, generator=gen).to(DEVICE)
    base = [SP(temperature=0.8)] * 3
    ineligible = [
        (tensors(base + [SP(temperature=0.0)], device=DEVICE), None),
        (tensors(base + [SP(top_k=5)], device=DEVICE), None),
        (tensors(base + [SP(top_p=0.9)], device=DEVICE), None),
        (tensors(base + [SP(min_p=0.1)], device=DEVICE), None),
        (tensors(base + [SP()], device=DEVICE),
         (torch.tensor([0], device=DEVICE), torch.tensor([3], device=DEVICE))),
    ]
    wide_top_k = (tensors(base + [SP(top_k=200, top_p=0.9)], device=DEVICE), None)  # 200 * 8 > 1000: a sort
    sampler = TritonSampler()
    for i, (t, suppress) in enumerate(ineligible + [wide_top_k]):
        calls.clear()
        sampler(logits, t, suppress)
        # The filter kernel reads the raw logits unless tokens are suppressed or top-k is wide.
        copies = suppress is not None or t is wide_top_k[0]
        assert calls == [1] * copies, i
    eligible = tensors(base + [SP()], device=DEVICE)
    assert triton_mod._fuse_scaling(logits, eligible, None)
    # The kernel reads each row as one unit-stride run.
    assert not triton_mod._fuse_scaling(logits.t().contiguous().t(), eligible, None)


@pytest.mark.gpu
def test_cpu_and_cuda_agree_and_graph_capture():
    gen = torch.Generator().manual_seed(5)
    b, vocab = 64, 32000
    logits = torch.randn(b, vocab, generator=gen) * 3
    params = [SP(temperature=0.0), SP(), SP(temperature=0.7, top_k=20, top_p=0.8),
              SP(top_p=0.95, min_p=0.05)] * (b // 4)
    seeds, offs = list(range(b)), [100 + 3 * i for i in range(b)]
    sampler = TritonSampler()
    t_cpu = tensors(params, seeds, offs)
    t_gpu = tensors(params, seeds, offs, device="cuda")
    cpu = sampler(logits, t_cpu)
    gpu = sampler(logits.cuda(), t_gpu).cpu()
    # Noise is exact integer math; only float rounding of logs can flip near-ties.
    assert_same_up_to_near_ties(cpu, gpu, gumbel_scores(logits, t_cpu))
    bf16 = logits.to(torch.bfloat16)
    assert_same_up_to_near_ties(sampler(bf16, t_cpu), sampler(bf16.cuda(), t_gpu),
                                gumbel_scores(bf16.float(), t_cpu))

    # CUDA graph: capture once, replay with new logits and advanced offsets.
    static_logits = logits.cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            sampler(static_logits, t_gpu)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = sampler(static_logits, t_gpu)
    new_logits = torch.randn(b, vocab, generator=gen) * 3
    static_logits.copy_(new_logits)
    t_gpu.offsets.add_(1)
    graph.replay()
    expected = sampler(new_logits.cuda(), t_gpu)
    torch.cuda.synchronize()
    assert torch.equal(static_out, expected)


# ---------------------------------------------------------------- filter kernel (kernels/top_p.py)

# Rows whose top-p cut lies closer than this to a token boundary (|mass through some distinct
# value - top_p * Z| / Z, in float64) are not compared: there the float32 rounding of either
# path's mass sums may move the cut by one value. Each side's relative error is at most about
# (2 + the mass-weighted |s - m| + log2 V) * 2**-24 (rounding of s - m and of exp per term, then
# of the sums; the CPU cumsum accumulates in double): under 3e-6 for these logits.
CUT_MARGIN = 1e-5
TILES = dict(chunk=512, block=256)  # several chunks per row, the last one partial; fast to interpret
needs_triton = pytest.mark.skipif(triton_mod.triton is None, reason="needs Triton")


@pytest.fixture
def fused(monkeypatch):
    """Sampler.forward through filtered_sample_triton (on CPU: interpreted), with small tiles:
    fused(logits, t, suppress=None, **kernel_kw) -> tokens on the CPU."""
    from nanovllm.kernels import top_p

    monkeypatch.setattr(triton_mod, "_use_triton", lambda x: True)

    def run(logits, t, suppress=None, **kw):
        # poison: the outputs and workspace start as garbage, so that a value read unwritten shows.
        monkeypatch.setattr(triton_mod, "filtered_sample_triton",
                            functools.partial(top_p.filtered_sample_triton, **{**TILES, "poison": True, **kw}))
        t_dev = dataclasses.replace(t, **{f: getattr(t, f).to(DEVICE) for f in
                                          ("temperatures", "top_ks", "top_ps", "min_ps", "seeds", "offsets")})
        sup = None if suppress is None else tuple(v.to(DEVICE) for v in suppress)
        return TritonSampler()(logits.to(DEVICE), t_dev, sup).cpu()

    return run


def reference_tokens(logits, t, suppress=None):
    """apply_filters' distribution (with a full sort: it keeps every tie of the k-th logit)
    sampled with the kernels' own noise (gumbel_argmax_triton of the masked scores); greedy
    rows take the first argmax."""
    masked = apply_filters(logits, dataclasses.replace(t, sort_k=-1), suppress)
    sampled = gumbel_argmax_triton(masked.to(DEVICE), None, t.seeds.to(DEVICE), t.offsets.to(DEVICE), **TILES)
    return torch.where(t.temperatures.cpu() == 0, masked.argmax(-1).cpu(), sampled.cpu())


def top_p_margins(logits, t, suppress=None):
    """Per row, how close top-p's cut comes to a boundary between distinct scores, relative to
    Z (float64; inf on rows without top-p)."""
    scores = sampler_mod._scaled(logits, t, suppress).double()
    margins = []
    for row, p, k in zip(scores, t.top_ps.tolist(), t.top_ks.tolist()):
        s = row[torch.isfinite(row)]
        if p >= 1.0:
            margins.append(math.inf)
            continue
        if 0 < k < s.numel():
            s = s[s >= s.topk(k).values[-1]]
        vals, counts = torch.unique(s, sorted=True, return_counts=True)
        mass = (torch.exp(vals - vals[-1]) * counts).flip(0).cumsum(0)  # through each value, descending
        margins.append(((mass - p * mass[-1]).abs() / mass[-1]).min().item())
    return margins


def random_filter_params(gen, n, top_p=True):
    """n rows cycling through filter mixes (greedy and unfiltered rows too), random values."""
    kinds = ["top_p", "top_k top_p", "min_p", "top_k top_p min_p", "greedy", "plain", "top_k", "top_p min_p"]
    rand = lambda lo, hi: lo + (hi - lo) * torch.rand((), generator=gen).item()  # noqa: E731
    params = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        kw = {"temperature": 0.0 if kind == "greedy" else rand(0.3, 2.0)}
        if "top_p" in kind and top_p:
            kw["top_p"] = rand(0.2, 0.99)
        if "top_k" in kind:
            kw["top_k"] = int(torch.randint(1, 60, (), generator=gen))
        if "min_p" in kind:
            kw["min_p"] = rand(0.01, 0.3)
        params.append(SP(**kw))
    return params


def random_keys(gen, n):
    return (torch.randint(-(2**63), 2**63 - 1, (n,), generator=gen).tolist(),
            torch.randint(0, 2**40, (n,), generator=gen).tolist())


def assert_tokens_match(got, want, margins, context):
    """Equal tokens on every row whose top-p cut is not razor-thin; those skipped (returned)."""
    skipped = [i for i, m in enumerate(margins) if m < CUT_MARGIN]
    bad = [(i, int(got[i]), int(want[i])) for i in range(len(got)) if i not in skipped and got[i] != want[i]]
    assert not bad, (context, bad)
    return len(skipped)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_filter_kernel_matches_filters_and_noise(dtype, fused):
    gen = torch.Generator()
    seed = gen.seed()  # fresh inputs each run; the seed is in every failure message
    skipped = with_top_p = 0
    for trial in range(3):
        b, vocab = 16, int(torch.randint(1000, 5000, (), generator=gen))
        logits = (torch.randn(b, vocab, generator=gen) * 3).to(dtype)
        # The last trial has no top-p row: its launches skip the mass passes.
        t = tensors(random_filter_params(gen, b, top_p=trial < 2), *random_keys(gen, b))
        margins = top_p_margins(logits, t)
        got = fused(logits, t)
        skipped += assert_tokens_match(got, reference_tokens(logits, t), margins, (seed, trial))
        with_top_p += sum(m < math.inf for m in margins)
    # The test has teeth: most top-p rows are compared. A cut falls within 1e-5 of a boundary
    # about 2e-5 / p(boundary token) of the time, 0.7% of these rows (measured over 1,200): more
    # than half of 16 is ~1e-16 likely, while "at most 1" failed about one CI run in 60.
    assert skipped <= with_top_p // 2, (seed, skipped, with_top_p)


def rejection_rounds(logits, t):
    """How many candidates the rising-floor search tries on each row (a float64 model of the
    kernels' loop, for rows with top-p only, from the whole vocabulary up)."""
    u = hash_uniform(t.seeds, t.offsets, logits.shape[-1]).double()
    scores = sampler_mod._scaled(logits, t, None).double()
    noisy = scores - u.log().neg().log()
    kept = torch.isfinite(apply_filters(logits, dataclasses.replace(t, sort_k=-1)))
    rounds = []
    for s, y, keep in zip(scores, noisy, kept):
        live = torch.ones_like(keep)
        for n in itertools.count(1):
            c = int(torch.where(live, y, -math.inf).argmax())
            if keep[c]:
                break
            live &= s > s[c]
        rounds.append(n)
    return rounds


@needs_triton
@pytest.mark.parametrize("rounds", [0, 1, 2])
def test_filter_kernel_exact_when_candidates_are_rejected_many_times(rounds, fused):
    # Low top_p over a flat distribution: the first candidate is almost never kept, and the
    # floor climbs for several rounds, past the chunked rounds into the last decide's loop.
    gen = torch.Generator()
    seed = gen.seed()
    b, vocab = 16, 2000
    logits = torch.randn(b, vocab, generator=gen) * 0.5
    params = [SP(top_p=p, temperature=temp) for p in (0.01, 0.02, 0.05, 0.1) for temp in (0.7, 1.0, 1.5, 1.0)]
    t = tensors(params, *random_keys(gen, b))
    tries = rejection_rounds(logits, t)
    # The test has teeth: rows take several candidates, some more than 1 + 2 chunked rounds.
    assert sum(tries) >= 2.5 * b and max(tries) >= 4, (seed, tries)
    margins = top_p_margins(logits, t)
    skipped = assert_tokens_match(fused(logits, t, rounds=rounds), reference_tokens(logits, t), margins,
                                  (seed, tries))
    assert skipped <= b // 4, (seed, skipped)  # each row's cut is razor-thin with probability ~2%


@needs_triton
@pytest.mark.parametrize("mass_a,mass_b,rounds", [(0.30, 0.29, 2), (0.10, 0.095, 0)])
def test_filter_kernel_cut_between_two_heavy_tokens(mass_a, mass_b, rounds, fused):
    # Token A holds mass_a of the mass and B, next, mass_b; top_p sits 0.1% below or above A's
    # mass: B is cut or kept. B is often a candidate (with A at 10%, after a rejected tail
    # token, in the last decide's loop), so a test of the mass against top_p * Z that is loose
    # by a fraction of a percent shows.
    gen = torch.Generator()
    seed = gen.seed()
    b, vocab = 32, 2000
    logits = torch.randn(b, vocab, generator=gen) * 0.5
    a, bb = torch.randint(0, vocab, (2, b), generator=gen)
    bb = torch.where(bb == a, (a + 777) % vocab, bb)
    rows = torch.arange(b)
    logits[rows, a] = logits[rows, bb] = -math.inf
    tail = torch.logsumexp(logits.double(), dim=-1)
    z = tail - math.log(1 - mass_a - mass_b)  # log Z once A and B join
    logits[rows, a] = (z + math.log(mass_a)).float()
    logits[rows, bb] = (z + math.log(mass_b)).float()
    exact_a = torch.softmax(logits.double(), dim=-1)[rows, a]
    top_p = (exact_a * torch.tensor([0.999, 1.001]).repeat(b // 2)).tolist()
    t = tensors([SP(top_p=p) for p in top_p], *random_keys(gen, b))
    want = reference_tokens(logits, t)
    assert torch.equal(want[0::2], a[0::2]), seed  # B cut: always A
    kept_b = want[1::2] == bb[1::2]
    assert (kept_b | (want[1::2] == a[1::2])).all() and kept_b.any(), seed  # B kept: A or B
    assert torch.equal(fused(logits, t, rounds=rounds), want), seed


@needs_triton
def test_filter_kernel_dominant_token_over_a_kept_tail(fused):
    # One token holds half the mass, 6+ nats above a flat tail that top_p = 0.75 half keeps: a
    # quarter of the first candidates are rejected, and the winner of the next round is often a
    # kept tail token in a chunk whose max is far below the row's (which must still be read).
    gen = torch.Generator()
    seed = gen.seed()
    b, vocab = 64, 2000
    logits = torch.randn(b, vocab, generator=gen) * 0.3
    top = torch.randint(0, vocab, (b,), generator=gen)
    rows = torch.arange(b)
    logits[rows, top] = torch.logsumexp(logits, dim=-1)  # as much mass as the rest
    t = tensors([SP(top_p=0.75)] * b, *random_keys(gen, b))
    want = reference_tokens(logits, t)
    assert (want != top).sum() >= b // 8, seed  # the tail is sampled (a third of the rows on average)
    margins = top_p_margins(logits, t)
    skipped = assert_tokens_match(fused(logits, t), want, margins, seed)
    assert skipped <= b // 4, (seed, skipped)  # a cut in the flat tail is razor-thin ~8% of the time


@needs_triton
def test_filter_kernel_greedy_ties_suppress_and_masked_rows(fused):
    gen = torch.Generator()
    seed = gen.seed()
    b, vocab = 8, 1000
    logits = torch.randn(b, vocab, generator=gen) * 2
    # A greedy row: the first of the tied maxima, across chunks. Above the row's own draws for
    # sure (a fixed 9.0 lost to a randn * 2 draw past 4.5 sigma: one run in ~300).
    logits[0, [700, 300, 301]] = logits[0].max() + 1.0
    params = [SP(temperature=0.0), SP(top_p=0.9), SP(top_k=3, top_p=0.5), SP(min_p=0.2, top_p=0.8),
              SP(temperature=0.0, top_p=0.5), SP(temperature=0.6, top_p=0.7), SP(), SP(top_k=10)]
    t = tensors(params, *random_keys(gen, b))
    assert fused(logits, t)[0] == 300, seed
    # Suppressed tokens (the kernel then reads the scaled copy): each row's top 3, and all but
    # 5 tokens of row 5, which leaves most chunks of that row empty.
    top3 = logits.topk(3, dim=-1).indices
    rows = [torch.arange(b).repeat_interleave(3), torch.full((vocab - 5,), 5)]
    cols = [top3.flatten(), torch.arange(5, vocab)]
    suppress = (torch.cat(rows), torch.cat(cols))
    got = fused(logits, t, suppress)
    assert not any(int(got[i]) in top3[i].tolist() for i in range(b) if i != 5), seed
    assert got[5] < 5, seed
    margins = top_p_margins(logits, t, suppress)
    assert_tokens_match(got, reference_tokens(logits, t, suppress), margins, seed)


@pytest.mark.gpu
def test_filter_kernel_matches_filters_and_noise_on_cuda():
    # Qwen3's vocabulary in bf16 with the default tiles; the reference runs on the GPU too, so
    # that torch.log(min_p) is the same float on both sides.
    gen = torch.Generator()
    seed = gen.seed()
    b, vocab = 64, 151_936
    logits = (torch.randn(b, vocab, generator=gen) * 3).to(torch.bfloat16).cuda()
    t = tensors(random_filter_params(gen, b), *random_keys(gen, b), device="cuda")
    margins = top_p_margins(logits, t)
    skipped = assert_tokens_match(TritonSampler()(logits, t).cpu(), reference_tokens(logits, t), margins, seed)
    assert skipped <= max(2, b // 10), (seed, skipped)


# ---------------------------------------------------------------- per-shard candidates (TP)

def shard_pick(sampler, logits, t, bounds):
    """Token per row from each vocabulary shard [bounds[i], bounds[i+1])'s candidates."""
    cands = [shard_sampling.candidates(sampler, logits[:, lo:hi], t, lo) for lo, hi in zip(bounds, bounds[1:])]
    return shard_sampling.pick_candidates(torch.stack([c[0] for c in cands]), torch.stack([c[1] for c in cands]))


@pytest.mark.parametrize("route", ["torch", "triton"])
def test_shard_candidates_give_the_whole_vocabulary_token(route, monkeypatch):
    if route == "triton":
        if triton_mod.triton is None:
            pytest.skip("needs Triton")
        monkeypatch.setattr(triton_mod, "_use_triton", lambda x: True)  # CPU: the interpreter
        monkeypatch.setattr(shard_sampling, "_use_triton", lambda x: True)
    gen = torch.Generator()
    seed = gen.seed()
    sampler = TritonSampler()
    vocab = 1000
    for dtype in (torch.float32, torch.bfloat16):
        logits, t_sampled = random_rows(gen, 10, vocab, dtype)
        logits = logits.to(DEVICE if route == "triton" else "cpu")
        temps = t_sampled.temperatures.tolist()
        seeds, offsets = t_sampled.seeds.tolist(), t_sampled.offsets.tolist()
        greedy = [0.0 if i % 3 == 0 else x for i, x in enumerate(temps)]
        for row_temps in (temps, greedy, [0.0] * len(temps)):  # sampled, mixed, all greedy
            t = shard_sampling.temperature_only(row_temps, seeds, offsets, logits.device)
            want = sampler(logits, t).cpu()
            # Shard boundaries inside and on chunk edges, a one-token and an empty last shard.
            for bounds in ([0, vocab], [0, 500, vocab], [0, 256, 613, 999, vocab], [0, 700, vocab, vocab]):
                got = shard_pick(sampler, logits, t, bounds).cpu()
                assert torch.equal(got, want), (seed, dtype, row_temps is greedy, bounds)


def test_shard_candidates_break_ties_like_argmax():
    # The largest logit appears in two shards: the lowest token id wins, as in argmax.
    logits = torch.zeros(2, 12)
    logits[:, [9, 4]] = 5.0
    t = shard_sampling.temperature_only([0.0, 0.0], [1, 2], [0, 0], "cpu")
    got = shard_pick(Sampler(), logits, t, [0, 3, 6, 12])
    assert got.tolist() == [4, 4]
    # A shard offers its own first maximum, too.
    logits[:, 2] = 5.0
    assert shard_pick(Sampler(), logits, t, [0, 6, 12]).tolist() == [2, 2]


def test_candidates_refuse_filters_and_filters_off_matches_build():
    t = tensors([SP(temperature=0.7, top_k=5)])
    with pytest.raises(ValueError, match="top-k"):
        shard_sampling.candidates(Sampler(), torch.zeros(1, 8), t)
    plain = [SP(), SP(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2), SP(temperature=1.3)]
    filtered = [SP(top_k=3), SP(top_p=0.9), SP(min_p=0.1)]
    assert all(shard_sampling.filters_off(p) for p in plain)
    assert not any(shard_sampling.filters_off(p) for p in filtered)
    flags = tensors(plain)
    assert not (flags.need_top_k or flags.need_top_p or flags.need_min_p)


def test_top_k_past_any_vocabulary_fits_the_tensor_and_keeps_every_token():
    params = [SP(temperature=0.8, top_k=2**70), SP(temperature=0.8, top_k=3)]
    t = SamplingTensors.build(params, [1, 2], [0, 0], torch.device("cpu"))
    assert t.top_ks.tolist() == [2**31, 3]  # no int64 overflow; 2**31 keeps any vocabulary whole


def test_top_p_mass_counts_ties_with_the_kth_logit_past_a_partial_top_k():
    """top_k=3, top_p=0.6 over logits 3, 2, then five ties at 1 (vocabulary 64, so top-k is
    partial): the top-k set holds all five tied tokens, so the mass before token 1 is below 0.6
    of the set's and token 1 is kept. The same row beside a top-p-only row (a full sort) must
    keep the same tokens."""
    x = torch.full((1, 64), -30.0)
    x[0, :7] = torch.tensor([3.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    alone = SamplingTensors.build([SP(temperature=1.0, top_k=3, top_p=0.6)], [0], [0], "cpu")
    kept = torch.isfinite(apply_filters(x, alone)[0]).nonzero().flatten().tolist()
    # mass of {3, 2, 1 x5}: e^3 + e^2 + 5e = 41.7; token 0 alone is 20.1 < 0.6 x 41.7 = 25.0.
    assert kept[:2] == [0, 1] and 1 in kept
    both = SamplingTensors.build([SP(temperature=1.0, top_k=3, top_p=0.6),
                                  SP(temperature=1.0, top_p=0.5)], [0, 0], [0, 0], "cpu")
    assert torch.isfinite(apply_filters(x.expand(2, -1).clone(), both)[0]).nonzero().flatten().tolist() == kept


class _BackgroundExtension:
    """A logits extension whose host work runs 'in the background': it forces token 3."""

    order = 0

    def __init__(self):
        self.events = []

    def applies(self, params):
        return True

    def build(self, rows, where, vocab_size):
        return where

    def prepare(self, state, step=None):
        self.events.append("prepare")
        return True

    def transform(self, logits, state, step=None):
        self.events.append("transform")
        logits[:, 3] = 1e9

    def observe(self, state, tokens):
        pass

    def release(self, seq):
        pass


def test_a_background_extension_defers_the_draw_until_flush():
    """With defer, the draw (and prev_tokens) waits for flush() or the first wait for the tokens;
    without, it happens at once. Either way the tokens are the extension's."""
    from nanovllm.core.sampling import TokenSampler
    from nanovllm.core.sequence import Sequence
    from nanovllm.features.logits.processing import DeferredTokens, logits_processing

    ts = TokenSampler(4, torch.device("cpu"), None)
    ext = _BackgroundExtension()
    logits_processing(ts).add_extension(ext)
    rows = [Sequence(i, [1, 2], SP(temperature=0.0), seed=i) for i in range(2)]
    logits = torch.randn(2, 8)
    pending = ts.sample(logits, rows, frozenset(), defer=True)
    assert isinstance(pending, DeferredTokens) and ext.events == ["prepare"]
    assert ts.prev_tokens[:2].tolist() == [0, 0]
    ts.flush()
    assert ext.events == ["prepare", "transform"] and ts.prev_tokens[:2].tolist() == [3, 3]
    assert pending.result() == [3, 3]
    again = ts.sample(logits, rows, frozenset(), defer=True)
    assert again.result() == [3, 3] and ext.events[-2:] == ["prepare", "transform"]  # result() queues it
    now = ts.sample(logits, rows, frozenset())
    assert not isinstance(now, DeferredTokens) and now.result() == [3, 3]
