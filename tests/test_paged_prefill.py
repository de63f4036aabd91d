"""The paged prefill kernel (kernels/paged_prefill.py) against fp32 attention over the same K/V.

Without CUDA it runs in Triton's interpreter: fp32 with IEEE dots (the same products and sums
as the reference in another order: within 1e-5), and fp16 with 16-bit dots and the output
rounded once (2^-10 relative, plus the probabilities rounded to fp16 before the PV dot: within
2e-3). FP8 caches: the kernel and the reference both read stored * scale rounded to q's dtype.
Not bf16 here: the interpreter's tl.dot on bf16 operands returns garbage (Triton 3.9, numpy has
no bf16); fp16 runs the same code, and the GPU tests run bf16. Random inputs each run (the seed
is printed)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from test_attention import make_cache_scenario, ref_round_trip, reference_attention  # noqa: E402

from nanovllm.kernels.paged_prefill import paged_prefill_attention  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
FP8 = torch.float8_e4m3fn
# (cached tokens, new tokens) per sequence: fresh prompts, prefix hits (a partial block after
# the prefix, a prefix of whole blocks), a long chunk after a short one, one new token.
CASES = {"fresh": ([0, 0], [5, 37]), "prefix_hit": ([48, 20, 0], [3, 29, 17]), "chunked": ([40, 7], [70, 1])}


def run(case: str, dtype, fp8: bool, seed: int, block_size: int = 16, heads=(4, 2), tiles=(16, 32)):
    cached, new = CASES[case]
    q, ks, vs, kc, vc, bt = make_cache_scenario(cached, new, heads[0], heads[1], 16, block_size, dtype, DEVICE,
                                                seed=seed)
    scale = 16 ** -0.5
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([c + n for c, n in zip(cached, new)], dtype=torch.int32, device=DEVICE)
    scales = {}
    if fp8:
        k_scale = (kc.abs().amax().float() / 200).reshape(1)
        v_scale = (vc.abs().amax().float() / 100).reshape(1)
        kc, vc = ((x.float() / s).clamp(-448, 448).to(FP8) for x, s in ((kc, k_scale), (vc, v_scale)))
        ks = [ref_round_trip(k, k_scale, dtype) for k in ks]
        vs = [ref_round_trip(v, v_scale, dtype) for v in vs]
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    out = paged_prefill_attention(q, kc, vc, bt, cu, ctx, max(new), scale, block_m=tiles[0], block_n=tiles[1],
                                  **scales)
    return out, reference_attention(q.float(), ks, vs, new, scale).float()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_paged_prefill_equals_attention_over_the_cache(case, dtype, fp8, fresh_seed):
    if dtype == torch.float32 and CUDA:
        pytest.skip("fp32 q is the CPU path's (the GPU's dots would run in TF32)")
    if dtype == torch.bfloat16 and not CUDA:
        pytest.skip("the interpreter's bf16 dots are wrong (module docstring)")
    out, ref = run(case, dtype, fp8, fresh_seed % 10_000)
    assert out.dtype == dtype and torch.isfinite(out).all()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]  # bf16: 2^-8 roundings
    torch.testing.assert_close(out.float().cpu(), ref.cpu(), rtol=tol, atol=tol)


@pytest.mark.parametrize("heads, block_size, tiles", [((4, 4), 8, (16, 16)), ((8, 1), 32, (32, 16))])
def test_paged_prefill_layouts(heads, block_size, tiles, fresh_seed):
    """No GQA and 8 query heads on one kv head; blocks smaller and larger than the K/V tile."""
    out, ref = run("prefix_hit", torch.float32 if not CUDA else torch.float16, False, fresh_seed % 10_000,
                   block_size, heads, tiles)
    tol = 1e-5 if not CUDA else 2e-3
    torch.testing.assert_close(out.float().cpu(), ref.cpu(), rtol=tol, atol=tol)


def test_paged_prefill_refuses_bad_operands():
    kc = torch.zeros(4, 16, 2, 16)
    cu, ctx, bt = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), torch.zeros(1, 1)
    with pytest.raises(ValueError, match="kv heads"):
        paged_prefill_attention(torch.zeros(3, 3, 16), kc, kc, bt, cu, ctx, 3, 0.25)
    with pytest.raises(ValueError, match="k_cache and v_cache"):
        paged_prefill_attention(torch.zeros(3, 4, 16), kc, kc[:2], bt, cu, ctx, 3, 0.25)
    with pytest.raises(ValueError, match="FP8"):
        paged_prefill_attention(torch.zeros(3, 4, 16), kc, kc, bt, cu, ctx, 3, 0.25, k_scale=torch.ones(1),
                                v_scale=torch.ones(1))
