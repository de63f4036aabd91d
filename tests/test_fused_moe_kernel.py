"""Tests for the fused MoE kernels (nanovllm/kernels/fused_moe.py).

The reference is written here in plain torch: a loop over experts in float64 that gathers each
expert's (token, choice) slots, as transformers' Qwen3MoeExperts does. Next to the exact result
it carries an elementwise bound on what the kernel may differ by (`Bounded`): every rounding
the kernel performs is charged as a first-order error term propagated through the products,
SiLU and sums, so a test compares `|kernel - exact| <= bound` elementwise. With unit roundoff u
of the activation dtype and eps = 2^-24 (fp32), the bound is about
(3u + (H + I + k) eps) * S, S = sum_j w_j (|h_j| @ |w2_e|^T) the magnitude of the terms
(|h| including the gate/up error's sensitivity): the kernel rounds three times to the dtype
(intermediate, slot output, final sum) and accumulates in fp32 over H and I terms.

Without CUDA the kernels run through Triton's interpreter (tests/conftest.py), which gets bf16
`tl.dot` wrong: CPU tests use fp32 and fp16 and small shapes. `gpu` tests use bf16 and
Qwen3-30B-A3B's sizes, and CUDA-graph capture. Every run draws new random inputs (`fresh_seed`
prints the seed), and every buffer allocated with torch.empty during a test is poisoned first
(NaN, or a garbage integer) so an element a kernel forgets to write shows up.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nanovllm.kernels import fused_moe as fm
from nanovllm.kernels import moe_align
from nanovllm.kernels.moe_fp8_activations import quantize_fp8_activations
from nanovllm.features.moe import route_topk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]
EPS32 = 2.0**-24
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
FP8_REL = 2.0**-4 + EPS32  # e4m3 keeps 3 mantissa bits: rounding costs <= 2^-4 relative (+ the fp32 divide)
FP8_SUB = 2.0**-10  # ... or, below the normal range, half the subnormal spacing 2^-9 (in units of the scale)
INT_POISON = -123456789

pytestmark = pytest.mark.usefixtures("fresh_seed")  # tests/conftest.py


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """torch.empty / empty_like return NaN-filled float tensors and INT_POISON-filled ints."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype in (torch.int32, torch.int64):
            t.fill_(INT_POISON)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


# ----------------------------------------------------------------------------- reference


class Bounded:
    """An exact value (float64) and an elementwise bound on the error of a computed version."""

    def __init__(self, value: torch.Tensor, err: torch.Tensor | None = None):
        self.value = value.double()
        self.err = torch.zeros_like(self.value) if err is None else err

    @property
    def mag(self) -> torch.Tensor:  # bound on |computed value|
        return self.value.abs() + self.err


def dot_gamma(k_dim: int, fp8: bool = False) -> float:
    """Relative accumulation error of one output of the kernel's K-loop, in units of
    sum_k |a_k| |b_k|: an fp32 sum of K terms rounds each term at most K + 4 times (product, the
    FP8 scale multiplies, the sum). CUDA tensor cores may truncate instead of rounding (twice
    the error); Hopper's FP8 MMA keeps only ~14 bits inside each 128-wide K-step (DeepSeek-V3
    report, sec. 3.3.2), which the kernel promotes to fp32 after every step."""
    if DEVICE == "cpu":
        return (k_dim + 4) * EPS32
    if fp8:
        return 128 * 2.0**-13 + 2 * (k_dim // 128 + 4) * EPS32
    return 2 * (k_dim + 4) * EPS32


def linear(a: Bounded, w: Bounded, gamma: float) -> Bounded:
    """a @ w^T with both operands carrying errors and an accumulation error of gamma."""
    value = a.value @ w.value.T
    err = a.err @ w.value.abs().T + a.value.abs() @ w.err.T + a.err @ w.err.T + gamma * (a.mag @ w.mag.T)
    return Bounded(value, err)


def silu_mul(g: Bounded, up: Bounded, u: float) -> Bounded:
    """silu(g) * up computed in fp32 and rounded to a dtype of unit roundoff u.

    |silu(g') - silu(g)| <= |silu'(g)| d + d^2 / 4 (|silu''| <= 1/2); the fp32 epilogue
    (exp, reciprocal, two products) adds a few eps relative -- more on the GPU, whose exp2 is
    approximate (2^-22.5) and whose argument -g * log2(e) is rounded (|g| eps): 32 eps is
    allowed (|g| < 20 here) -- and the final rounding u."""
    sig = torch.sigmoid(g.value)
    s = g.value * sig
    ds = sig * (1 + g.value * (1 - sig))
    value = s * up.value
    d1 = (ds.abs() * g.err + 0.25 * g.err**2) * up.mag + s.abs() * up.err
    return Bounded(value, d1 + (32 * EPS32 + u) * (value.abs() + d1))


def rounded(x: Bounded, u: float) -> Bounded:
    """x after one more product/rounding step (relative u on its magnitude)."""
    return Bounded(x.value, x.err + u * x.mag)


def fp8_input(x: torch.Tensor, scale_per_element: torch.Tensor) -> Bounded:
    """Full-precision x seen through FP8 quantization with the given scales."""
    x = x.double()
    return Bounded(x, FP8_REL * x.abs() + FP8_SUB * scale_per_element.double())


def reference_slots(x: Bounded, w13: Bounded, w2: Bounded, ids: torch.Tensor, weights: torch.Tensor, u: float,
                    fp8: bool = False, down_input=None) -> tuple[Bounded, Bounded]:
    """Loop over experts: (intermediate [T*k, I], weighted slot outputs [T*k, H]) of slot
    s = t*k + j, with bounds that model the kernel's roundings (see module doc).
    down_input(h, slots) may replace the intermediate of those slots by what the down GEMM
    really reads (for FP8: the intermediate seen through its activation quantization)."""
    num_tokens, k = ids.shape
    inter = w13.value.shape[1] // 2
    hidden = w2.value.shape[1]
    slots_of = ids.reshape(-1).long()
    h_val = torch.full((num_tokens * k, inter), math.nan, dtype=torch.float64, device=ids.device)
    h_err = torch.full_like(h_val, math.nan)
    y_val = torch.full((num_tokens * k, hidden), math.nan, dtype=torch.float64, device=ids.device)
    y_err = torch.full_like(y_val, math.nan)
    w_slot = weights.reshape(-1).double()
    for e in range(w13.value.shape[0]):
        slots = (slots_of == e).nonzero().flatten()
        if slots.numel() == 0:
            continue
        xs = Bounded(x.value[slots // k], x.err[slots // k])
        gate = linear(xs, Bounded(w13.value[e, :inter], w13.err[e, :inter]), dot_gamma(x.value.shape[1], fp8))
        up = linear(xs, Bounded(w13.value[e, inter:], w13.err[e, inter:]), dot_gamma(x.value.shape[1], fp8))
        h = silu_mul(gate, up, u)
        h_val[slots], h_err[slots] = h.value, h.err
        hd = down_input(h, slots) if down_input is not None else h
        y = linear(hd, Bounded(w2.value[e], w2.err[e]), dot_gamma(inter, fp8))
        we = w_slot[slots, None]
        y = rounded(Bounded(we * y.value, we.abs() * y.err), EPS32 + u)  # * weight in fp32, rounded to dtype
        y_val[slots], y_err[slots] = y.value, y.err
    return Bounded(h_val, h_err), Bounded(y_val, y_err)


def reference_moe(x, w13, w2, ids, weights, u, fp8=False, down_input=None) -> Bounded:
    """The MoE output [T, H]: the k weighted slot outputs of a token summed (fp32, k - 1 adds,
    then one rounding to the dtype)."""
    if not isinstance(x, Bounded):
        x, w13, w2 = Bounded(x), Bounded(w13), Bounded(w2)
    _, y = reference_slots(x, w13, w2, ids, weights, u, fp8, down_input)
    num_tokens, k = ids.shape
    val = y.value.view(num_tokens, k, -1).sum(1)
    err = y.err.view(num_tokens, k, -1).sum(1)
    mag = y.mag.view(num_tokens, k, -1).sum(1)
    err = err + k * EPS32 * mag
    return Bounded(val, err + u * (val.abs() + err))


def assert_within(out: torch.Tensor, ref: Bounded, what: str = "output") -> None:
    assert out.shape == ref.value.shape, (out.shape, ref.value.shape)
    assert torch.isfinite(out).all(), f"non-finite {what} (an element left unwritten?)"
    diff = (out.double() - ref.value).abs()
    bad = diff > ref.err
    if bad.any():
        i = bad.nonzero()[0].tolist()
        ratio = (diff / ref.err.clamp_min(1e-300)).max().item()
        raise AssertionError(f"{what}: {bad.sum().item()} elements out of bound, worst |err| / bound = {ratio:.3g}; "
                             f"first at {i}: got {out[tuple(i)].item()!r}, exact {ref.value[tuple(i)].item()!r}, "
                             f"bound {ref.err[tuple(i)].item():.3g}")


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit-identical (NaNs would count as differing), with a diagnosable message."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    if got.dtype == torch.float8_e4m3fn:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    if not torch.equal(got, want):
        diff = got != want
        raise AssertionError(f"{what}: {diff.sum().item()} of {diff.numel()} elements differ (first at "
                             f"{diff.nonzero()[0].tolist()}); NaNs: {got.float().isnan().sum().item()} got, "
                             f"{want.float().isnan().sum().item()} want")


# ----------------------------------------------------------------------------- inputs


def random_routing(num_tokens: int, num_experts: int, k: int, experts=None, device=DEVICE):
    """(weights fp32 [T, k] positive, ids int32 [T, k]): k distinct experts per token drawn from
    `experts` (default all); weights a softmax of random logits, so they are not sorted."""
    pool = torch.arange(num_experts, device=device) if experts is None else torch.tensor(experts, device=device)
    assert k <= pool.numel()
    pick = torch.rand(num_tokens, pool.numel(), device=device).argsort(dim=1)[:, :k]
    ids = pool[pick].to(torch.int32)
    weights = torch.softmax(torch.randn(num_tokens, k, device=device), dim=-1)
    return weights, ids


def random_experts(num_experts, hidden, inter, dtype, device=DEVICE):
    """w13 [E, 2I, H], w2 [E, H, I] with entries ~ N(0, 1/fan_in) (activations stay O(1))."""
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=device) / math.sqrt(hidden)).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device=device) / math.sqrt(inter)).to(dtype)
    return w13, w2


# ----------------------------------------------------------------------------- route_topk


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_topk_equals_transformers_router(renormalize, dtype):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=32, num_experts=24, num_experts_per_tok=4, norm_topk_prob=renormalize)
    router = Qwen3MoeTopKRouter(cfg).to(dtype)
    with torch.no_grad():
        router.weight.normal_()
        hidden = torch.randn(37, 32).to(dtype)
        logits, scores, indices = router(hidden)
    weights, ids = route_topk(logits, 4, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids.long(), indices.long())
    assert torch.equal(weights, scores.float())  # bit for bit: same ops, same rounding to the dtype
    if renormalize:
        assert torch.allclose(weights.sum(-1), torch.ones(37), atol=4 * UNIT_ROUNDOFF[dtype])


def test_route_topk_rejects_bad_input():
    with pytest.raises(ValueError, match="top_k"):
        route_topk(torch.randn(3, 4), 5, True)
    with pytest.raises(ValueError, match="top_k"):
        route_topk(torch.randn(3, 4), 0, True)
    with pytest.raises(ValueError, match="router_logits"):
        route_topk(torch.randn(3, 4, 2), 2, True)
    with pytest.raises(TypeError, match="float"):
        route_topk(torch.ones(3, 4, dtype=torch.int32), 2, True)


# ----------------------------------------------------------------------------- alignment


def check_alignment(ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    sorted_ids, block_experts, total = moe_align.align_tokens_to_experts(ids, num_experts, block_m)
    num_slots = ids.numel()
    flat = ids.reshape(-1).long().cpu()
    sorted_ids, block_experts, total = sorted_ids.cpu().long(), block_experts.cpu().long(), int(total.item())
    assert sorted_ids.numel() == moe_align.max_padded_slots(num_slots, num_experts, block_m)
    assert block_experts.numel() * block_m == sorted_ids.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert total == padded.sum().item()
    sentinel = num_slots
    # Everything past the used length is the sentinel / the -1 block marker.
    assert (sorted_ids[total:] == sentinel).all()
    assert (block_experts[total // block_m:] == -1).all()
    # Experts in increasing order, each with ceil(count / block_m) blocks; none for empty experts.
    used = block_experts[: total // block_m]
    assert (used >= 0).all() and (used[1:] >= used[:-1]).all()
    assert torch.equal(torch.bincount(used, minlength=num_experts), padded // block_m)
    pos = 0
    for e in range(num_experts):
        group = sorted_ids[pos: pos + padded[e]]
        c = counts[e].item()
        # The expert's slots in increasing order, then the sentinel up to the block boundary.
        assert torch.equal(group[:c], (flat == e).nonzero().flatten()), f"expert {e}"
        assert (group[c:] == sentinel).all(), f"expert {e} padding"
        pos += padded[e].item()
    # Hence every slot exactly once:
    real = sorted_ids[:total][sorted_ids[:total] != sentinel]
    assert torch.equal(real.sort().values, torch.arange(num_slots))


@pytest.mark.parametrize(
    "num_tokens,k,num_experts,block_m,experts",
    [
        (1, 1, 1, 16, None),  # a single slot
        (1, 8, 128, 16, None),  # decode, Qwen3-30B routing
        (5, 2, 8, 16, [2, 5]),  # most experts get no slot
        (13, 3, 6, 4, None),  # E not a power of two, T*k not a multiple of block_m
        (40, 1, 16, 1, [7]),  # everything on one expert, block_m 1 (no padding)
        (700, 2, 8, 64, None),  # 1400 slots: the three-kernel path (more than 4 chunks)
        (300, 4, 100, 32, None),  # three-kernel path, E = 100
        (96, 2, 16, 128, [0, 15]),  # block_m larger than any group
    ],
)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_align_tokens_to_experts_invariants(num_tokens, k, num_experts, block_m, experts, id_dtype):
    _, ids = random_routing(num_tokens, num_experts, k, experts)
    check_alignment(ids.to(id_dtype), num_experts, block_m)


def test_align_tokens_to_experts_no_tokens_and_bad_input():
    sorted_ids, block_experts, total = moe_align.align_tokens_to_experts(torch.zeros(0, 4, dtype=torch.int32, device=DEVICE), 8, 16)
    assert sorted_ids.numel() == 0 and block_experts.numel() == 0 and total.item() == 0
    ids = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_m"):
        moe_align.align_tokens_to_experts(ids, 4, 12)
    with pytest.raises(ValueError, match="num_experts"):
        moe_align.align_tokens_to_experts(ids, 0, 16)
    with pytest.raises(TypeError, match="int32 or int64"):
        moe_align.align_tokens_to_experts(ids.float(), 4, 16)
    with pytest.raises(ValueError, match="topk_ids"):
        moe_align.align_tokens_to_experts(ids.flatten(), 4, 16)


# ----------------------------------------------------------------------------- fused_moe, CPU


CASES = {  # name: (T, H, I, E, k, experts routed to (None: all))
    "one_token": (1, 64, 32, 8, 2, None),
    "top1_odd_sizes": (7, 80, 40, 6, 1, None),  # H, I not multiples of any tile
    "empty_experts": (13, 72, 56, 16, 3, [1, 4, 9, 10]),  # T*k = 39, 12 experts get nothing
    "all_one_expert_top1": (9, 48, 24, 4, 1, [3]),
    "all_same_pair": (11, 40, 24, 5, 2, [4, 1]),  # every token routed to experts 4 and 1
    "prefill_config": (70, 64, 48, 4, 2, None),  # 35 slots per expert: block_m 64
}


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_moe_matches_reference(case, dtype):
    num_tokens, hidden, inter, num_experts, k, experts = CASES[case]
    x = torch.randn(num_tokens, hidden, device=DEVICE).to(dtype)
    w13, w2 = random_experts(num_experts, hidden, inter, dtype)
    weights, ids = random_routing(num_tokens, num_experts, k, experts)
    out = fm.fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == dtype
    assert_within(out, reference_moe(x, w13, w2, ids, weights, UNIT_ROUNDOFF[dtype]))


@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe_with_route_topk_matches_transformers_block(renormalize):
    """End to end against transformers' Qwen3MoeSparseMoeBlock (fp32), same weights: its
    arithmetic has errors of the same kind and size as the kernel's, so twice our bound."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=40, num_experts=12, num_experts_per_tok=3,
                         norm_topk_prob=renormalize)
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.normal_()
        block.experts.gate_up_proj.normal_(std=64**-0.5)
        block.experts.down_proj.normal_(std=40**-0.5)
        x = torch.randn(1, 19, 64)
        want = block(x)[0]
        logits = F.linear(x[0], block.gate.weight)
    weights, ids = route_topk(logits, 3, renormalize)
    w13, w2 = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    out = fm.fused_moe(x[0], w13, w2, weights, ids)
    ref = reference_moe(x[0], w13, w2, ids, weights, UNIT_ROUNDOFF[torch.float32])
    assert_within(want, Bounded(ref.value, ref.err), "transformers")  # the bound models it too
    assert_within(out, Bounded(want.double(), 2 * ref.err))


@pytest.mark.parametrize("config", [
    fm.MoEConfig(16, fm.GemmConfig(16, 16, 1, 1), fm.GemmConfig(16, 32, 2, 2)),
    fm.MoEConfig(32, fm.GemmConfig(64, 64, 4, 4), fm.GemmConfig(64, 64, 4, 4)),
    fm.MoEConfig(128, fm.GemmConfig(64, 64, 8, 3), fm.GemmConfig(128, 64, 8, 3)),
])
def test_fused_moe_explicit_configs(config):
    """Tiles larger and smaller than the problem (partial tiles everywhere)."""
    x = torch.randn(21, 72, device=DEVICE)
    w13, w2 = random_experts(5, 72, 40, torch.float32)
    weights, ids = random_routing(21, 5, 2)
    out = fm.fused_moe(x, w13, w2, weights, ids, config=config)
    assert_within(out, reference_moe(x, w13, w2, ids, weights, UNIT_ROUNDOFF[torch.float32]))


def test_fused_moe_strided_hidden_and_no_tokens():
    x = torch.randn(6, 2 * 64, device=DEVICE)[:, ::2]  # non-contiguous rows and columns
    w13, w2 = random_experts(4, 64, 32, torch.float32)
    weights, ids = random_routing(6, 4, 2)
    assert_within(fm.fused_moe(x, w13, w2, weights, ids), reference_moe(x, w13, w2, ids, weights, EPS32))
    empty = fm.fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 64) and empty.dtype == x.dtype


def test_fused_moe_rejects_bad_input():
    x = torch.randn(3, 32)
    w13, w2 = random_experts(4, 32, 16, torch.float32, device="cpu")
    weights, ids = random_routing(3, 4, 2, device="cpu")
    with pytest.raises(ValueError, match="w13"):
        fm.fused_moe(x, w13[:, :, :16], w2, weights, ids)
    with pytest.raises(ValueError, match="w2"):
        fm.fused_moe(x, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(TypeError, match="dtype"):
        fm.fused_moe(x, w13.half(), w2.half(), weights, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fm.fused_moe(x, w13, w2, weights, ids[:2])
    with pytest.raises(ValueError, match="topk_weights"):
        fm.fused_moe(x, w13, w2, weights[:, :1], ids)
    with pytest.raises(TypeError, match="topk_ids"):
        fm.fused_moe(x, w13, w2, weights, ids.float())
    with pytest.raises(ValueError, match="w13_scale"):
        fm.fused_moe(x, w13.to(fm.FP8_DTYPE), w2.to(fm.FP8_DTYPE), weights, ids)
    with pytest.raises(ValueError, match="only for float8"):
        fm.fused_moe(x, w13, w2, weights, ids, w13_scale=torch.ones(4, 1, 1))


# ----------------------------------------------------------------------------- FP8


def torch_quantize_activations(x: torch.Tensor):
    """The test's own per-row, per-128-group quantization: scale = max(amax, 1e-10) / 448,
    q = clamp(x / scale, +-448) (clamped before the cast: torch's CPU cast does not saturate)."""
    rows, cols = x.shape
    groups = -(-cols // 128)
    xf = F.pad(x.float(), (0, groups * 128 - cols)).view(rows, groups, 128)
    amax = xf.abs().amax(-1).clamp(min=1e-10)
    # A tensor divisor: CUDA torch turns division by a Python scalar into a product with its
    # reciprocal, which can differ from the kernel's correctly rounded division in the last bit.
    scale = amax / torch.full_like(amax, 448.0)
    q = (xf / scale[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(rows, -1)[:, :cols], scale


def quantize_weight_blocks(w: torch.Tensor):
    """Block FP8 as in Qwen3-*-FP8 checkpoints: per expert, one scale per 128x128 block
    (dequantized weight = q * scale, the checkpoints' weight_scale_inv)."""
    e, rows, cols = w.shape
    rb, cb = -(-rows // 128), -(-cols // 128)
    wp = F.pad(w.float(), (0, cb * 128 - cols, 0, rb * 128 - rows)).view(e, rb, 128, cb, 128)
    scale = wp.abs().amax(dim=(2, 4)).clamp(min=1e-10) / 448.0
    q = (wp / scale[:, :, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(e, rb * 128, cb * 128)[:, :rows, :cols].contiguous(), scale


def expand_blocks(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[E, rb, cb] block scales -> [E, rows, cols] per element."""
    return scale.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :rows, :cols]


def expand_groups(scale: torch.Tensor, cols: int) -> torch.Tensor:
    return scale.repeat_interleave(128, 1)[:, :cols]


def dequantize(q: torch.Tensor, scale_per_element: torch.Tensor) -> torch.Tensor:
    return q.double() * scale_per_element.double()  # exact in float64


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_quantize_fp8_activations_equals_torch(dtype):
    x = (torch.randn(9, 200, device=DEVICE) * torch.logspace(-3, 3, 9, device=DEVICE)[:, None]).to(dtype)
    x[3] = 0  # an all-zero row: scale from the floor, q = 0
    x[5, 130] = 1e-7  # a value that lands among the subnormals of its group
    q, scale = quantize_fp8_activations(x)
    want_q, want_scale = torch_quantize_activations(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (9, 2)
    assert_same(scale, want_scale, "scales")  # bit for bit: same fp32 arithmetic
    assert_same(q, want_q.contiguous(), "quantized values")


def fp8_problem(num_tokens, hidden, inter, num_experts, k, dtype, experts=None):
    x = torch.randn(num_tokens, hidden, device=DEVICE).to(dtype)
    w13, w2 = random_experts(num_experts, hidden, inter, torch.float32)
    q13, s13 = quantize_weight_blocks(w13)
    q2, s2 = quantize_weight_blocks(w2)
    weights, ids = random_routing(num_tokens, num_experts, k, experts)
    return x, (w13, q13, s13), (w2, q2, s2), weights, ids


FP8_CASES = {  # (T, H, I, E, k, experts, activation dtype)
    "decode": (2, 128, 128, 4, 2, None, torch.float16),
    "partial_k_block": (5, 200, 128, 3, 2, None, torch.float32),  # H = 200: a 72-wide last K-step
    "prefill_config": (64, 128, 128, 2, 2, None, torch.float16),  # 64 slots per expert: block_m 64
}


def check_fp8_gemms(x, q13, s13, q2, s2, weights, ids, cfg, u):
    """Each GEMM against torch on the dequantized weights and the quantized activations: the
    kernel's exact arithmetic, so only fp32 accumulation and the roundings to the dtype remain
    (the bound of the module doc with the FP8 dot_gamma). The down GEMM's exact input is the
    kernel's own intermediate, quantized. Returns the slot outputs [T*k, H]."""
    hidden, inter, k, num_experts = x.shape[1], q2.shape[2], ids.shape[1], q13.shape[0]
    sorted_ids, block_experts, _ = moe_align.align_tokens_to_experts(ids, num_experts, cfg.block_m)
    inter_out = fm.moe_gate_up(x, q13, sorted_ids, block_experts, k, cfg, s13)
    xq, xs = torch_quantize_activations(x)
    xd = Bounded(dequantize(xq, expand_groups(xs, hidden)))
    w13d = Bounded(dequantize(q13, expand_blocks(s13, 2 * inter, hidden)))
    w2d = Bounded(dequantize(q2, expand_blocks(s2, hidden, inter)))
    h_ref, _ = reference_slots(xd, w13d, w2d, ids, weights, u, fp8=True)
    assert_within(inter_out, h_ref, "gate_up")
    slot_out = fm.moe_down(inter_out, q2, weights, sorted_ids, block_experts, cfg, s2)
    hq, hs = torch_quantize_activations(inter_out)
    hd = dequantize(hq, expand_groups(hs, inter))
    _, y_ref = reference_slots(xd, w13d, w2d, ids, weights, u, fp8=True, down_input=lambda h, slots: Bounded(hd[slots]))
    assert_within(slot_out, y_ref, "down")
    return slot_out


def check_fp8_vs_full_precision(out, x, w13, s13, w2, s2, weights, ids, u):
    """FP8 output against the unquantized weights and activations. Quantizing x, w13, the
    intermediate and w2 costs <= 2^-4 relative each (plus a subnormal floor of 2^-10 scale),
    propagated elementwise through the same model: a bound of about 4 * 2^-4 * S. The typical
    error is smaller: e4m3 rounding has an rms relative error of 2^-4..2^-3 / sqrt(12) (~2.6%)
    per quantized value; x and w13 make ~3.7% in gate and up, ~5.2% in silu(gate) * up, with
    the intermediate's and w2's quantization ~6.4% normwise (measured: 5.3-7.0% on the CPU
    cases over several seeds). Checked against 0.1."""
    hidden, inter = x.shape[1], w2.shape[2]
    _, xs = torch_quantize_activations(x)
    xb = fp8_input(x, expand_groups(xs, hidden))
    w13b = fp8_input(w13, expand_blocks(s13, 2 * inter, hidden))
    w2b = fp8_input(w2, expand_blocks(s2, hidden, inter))

    def quantized_intermediate(h: Bounded, slots) -> Bounded:
        # The group scale of the computed intermediate is at most max(|h| + err) over the group / 448.
        mag = F.pad(h.mag, (0, -inter % 128)).view(h.mag.shape[0], -1, 128).amax(-1).clamp(min=1e-10) / 448
        return Bounded(h.value, h.err + FP8_REL * h.mag + FP8_SUB * expand_groups(mag, inter))

    assert_within(out, reference_moe(xb, w13b, w2b, ids, weights, u, fp8=True, down_input=quantized_intermediate),
                  "fp8 output vs full precision")
    full = reference_moe(x, w13, w2, ids, weights, 0.0).value
    rel = (out.double() - full).norm() / full.norm()
    assert rel < 0.1, f"normwise error {rel:.3g} of the FP8 path against full precision"


@pytest.mark.parametrize("case", list(FP8_CASES))
def test_fp8_fused_moe(case):
    num_tokens, hidden, inter, num_experts, k, experts, dtype = FP8_CASES[case]
    x = torch.randn(num_tokens, hidden, device=DEVICE).to(dtype)
    w13, w2 = random_experts(num_experts, hidden, inter, torch.float32)
    (q13, s13), (q2, s2) = quantize_weight_blocks(w13), quantize_weight_blocks(w2)
    weights, ids = random_routing(num_tokens, num_experts, k, experts)
    out = fm.fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    assert out.dtype == dtype
    u = UNIT_ROUNDOFF[dtype]
    slot_out = check_fp8_gemms(x, q13, s13, q2, s2, weights, ids, fm.get_config(num_tokens, k, num_experts, True), u)
    assert_same(slot_out.view(num_tokens, k, -1).sum(1), out, "fused_moe vs its steps")
    check_fp8_vs_full_precision(out, x, w13, s13, w2, s2, weights, ids, u)


def test_fp8_rejects_bad_scales():
    x = torch.randn(2, 128)
    w13, w2 = random_experts(2, 128, 128, torch.float32, device="cpu")
    (q13, s13), (q2, s2) = quantize_weight_blocks(w13), quantize_weight_blocks(w2)
    weights, ids = random_routing(2, 2, 1, device="cpu")
    with pytest.raises(ValueError, match="w2_scale"):
        fm.fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=torch.ones(2, 2, 1))
    with pytest.raises(ValueError, match="w13_scale"):
        fm.fused_moe(x, q13, q2, weights, ids, w13_scale=s13.double(), w2_scale=s2)
    w13, w2 = random_experts(2, 128, 64, torch.float32, device="cpu")
    (q13, s13), (q2, s2) = quantize_weight_blocks(w13), quantize_weight_blocks(w2)
    with pytest.raises(ValueError, match="multiple of 128"):
        fm.fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)


# ----------------------------------------------------------------------------- GPU


QWEN3_30B = dict(hidden=2048, inter=768, num_experts=128, k=8)


def qwen3_30b_problem(num_tokens, dtype=torch.bfloat16):
    h, i, e, k = QWEN3_30B["hidden"], QWEN3_30B["inter"], QWEN3_30B["num_experts"], QWEN3_30B["k"]
    x = torch.randn(num_tokens, h, device="cuda").to(dtype)
    w13, w2 = random_experts(e, h, i, dtype, device="cuda")
    weights, ids = route_topk(torch.randn(num_tokens, e, device="cuda"), k, True)
    return x, w13, w2, weights, ids


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 256, 2048])
def test_gpu_bf16_qwen3_30b_shapes(num_tokens):
    x, w13, w2, weights, ids = qwen3_30b_problem(num_tokens)
    out = fm.fused_moe(x, w13, w2, weights, ids)
    assert_within(out, reference_moe(x, w13, w2, ids, weights, UNIT_ROUNDOFF[torch.bfloat16]))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 256, 2048])
def test_gpu_fp8_qwen3_30b_shapes(num_tokens):
    x, w13, w2, weights, ids = qwen3_30b_problem(num_tokens, torch.float32)
    x = x.bfloat16()
    (q13, s13), (q2, s2) = quantize_weight_blocks(w13), quantize_weight_blocks(w2)
    out = fm.fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    u = UNIT_ROUNDOFF[torch.bfloat16]
    slot_out = check_fp8_gemms(x, q13, s13, q2, s2, weights, ids, fm.get_config(num_tokens, 8, 128, True), u)
    assert_same(slot_out.view(num_tokens, 8, -1).sum(1), out, "fused_moe vs its steps")
    check_fp8_vs_full_precision(out, x, w13, s13, w2, s2, weights, ids, u)


@pytest.mark.gpu
def test_gpu_quantize_fp8_activations_equals_torch():
    x = torch.randn(300, 2048, device="cuda", dtype=torch.bfloat16) * 10
    x[7] = 0
    q, scale = quantize_fp8_activations(x)
    want_q, want_scale = torch_quantize_activations(x)
    assert_same(scale, want_scale, "scales")
    assert_same(q, want_q.contiguous(), "quantized values")


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 64, 512])  # 512: the three-kernel alignment
def test_gpu_fused_moe_cuda_graph_replay(num_tokens, fp8):
    """Captured once, replayed with new routing and activations copied into the static inputs:
    bit-identical to eager (deterministic kernels, no atomics)."""
    x, w13, w2, weights, ids = qwen3_30b_problem(num_tokens)
    scales = {}
    if fp8:
        (w13, s13), (w2, s2) = quantize_weight_blocks(w13.float()), quantize_weight_blocks(w2.float())
        scales = dict(w13_scale=s13, w2_scale=s2)
    run = lambda: fm.fused_moe(x, w13, w2, weights, ids, **scales)  # noqa: E731
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        new_weights, new_ids = route_topk(torch.randn(num_tokens, 128, device="cuda"), 8, True)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        eager = run()
        assert torch.isfinite(out).all()
        assert_same(out, eager, "graph replay vs eager")
