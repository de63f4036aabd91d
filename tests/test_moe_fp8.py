"""FP8 MoE experts (Qwen/Qwen3-30B-A3B-FP8's block format) end to end: loading, the CPU
arithmetic, accuracy against the unquantized engine, tensor parallelism, online quantization,
dummy weights, the bench floor, bad input; GPU tests at Qwen3-30B-A3B's shapes.

The checkpoints are tiny random Qwen3-MoE models quantized by the tests (fp8_checkpoints.py):
hidden 256, moe_intermediate_size 256 (two 128-blocks: one per rank at TP=2), 8 experts, top-2,
3 layers of which layer 1 has a dense MLP (mlp_only_layers), so experts, dense MLPs and the
routers all meet in one model. "16-bit" below means the unquantized engine (fp32 on CPU).

1. loading: the engine's stacked experts hold exactly the checkpoint's per-expert FP8 codes and
   scales (per rank under TP, per-expert and transformers' fused layouts alike); routers stay
   16-bit, with or without Qwen's modules_to_not_convert;
2. the CPU FP8 MoE (features/quantization/fp8_moe.py) against a float64 reference of the same
   arithmetic, step by step with stated bounds, and against the Triton kernel (interpreted);
   the layer against full precision, and the engine against the 16-bit engine (logits, argmax
   of a peaked model), with stated bounds;
3. TP=2 on gloo gives TP=1's tokens; `quantization="fp8"` on a 16-bit checkpoint and dummy
   weights; the bench floor counts the experts at one byte;
4. bad input: a TP shard that cuts a 128-block, a missing expert scale, 16-bit experts in an FP8
   checkpoint, a scale of the wrong shape: each a clear error.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import re
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

import tiny_model as tm  # noqa: E402
from fp8_checkpoints import QWEN_FP8_CONFIG, make_peaked, quantize_checkpoint_fp8, qwen_moe_not_convert  # noqa: E402
from helpers import (assert_idle, copy_checkpoint, edit_json, greedy, make_llm, rand_ids,  # noqa: E402
                     rewrite_safetensors)

from nanovllm.features.moe import MoeExperts, moe_torch, route_topk  # noqa: E402
from nanovllm.features.quantization.fp8_moe import (CheckpointFp8Experts, moe_fp8_down_torch,  # noqa: E402
                                                  moe_fp8_gate_up_torch, moe_fp8_torch,
                                                  quantize_moe_activations_torch)
from nanovllm.features.quantization.fp8_ops import dequantize_weight_block_fp8, quantize_weight_block_fp8  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPS32 = 2.0**-24
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
MOE = dict(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=128, intermediate_size=512, num_layers=3,
           moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1])
PROMPTS = [rand_ids(n, seed=n) for n in (7, 37, 60)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """16-bit source, FP8 with Qwen's 2507-style modules_to_not_convert, FP8 without one (as the
    original Qwen3-30B-A3B-FP8)."""
    root = tmp_path_factory.mktemp("moe_fp8")
    src = tm.make_tiny_qwen3_moe(root / "bf16", **MOE)
    listed = quantize_checkpoint_fp8(src, str(root / "fp8"), not_convert=qwen_moe_not_convert(MOE["num_layers"]))
    plain = quantize_checkpoint_fp8(src, str(root / "fp8-plain"))
    return {"src": src, "fp8": listed, "fp8-plain": plain}


def engine(path, **kw):
    kw.setdefault("num_kvcache_blocks", 64)
    return make_llm(path, **kw)


def tokens(llm, prompts=PROMPTS, n=12):
    return [o["token_ids"] for o in llm.generate(prompts, greedy(n), use_tqdm=False)]


def checkpoint_tensors(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ------------------------------------------------------------------ 1. loading
@pytest.mark.parametrize("name", ["fp8", "fp8-plain"])
def test_engine_holds_the_checkpoint_expert_codes_and_scales(ckpts, name):
    """Every expert's FP8 codes and block scales, stacked; the router 16-bit (with or without
    modules_to_not_convert naming it); the dense MLP and attention in block FP8."""
    t = checkpoint_tensors(ckpts[name])
    assert not any(k.startswith("model.layers.0.mlp.gate.") and "scale" in k for k in t)  # the router is not quantized
    with engine(ckpts[name]) as llm:
        layers = llm.model_runner.model.model.layers
        for i in (0, 2):
            ex = layers[i].mlp.experts
            assert ex.w13.dtype == ex.w2.dtype == torch.float8_e4m3fn
            assert ex.w13_scale_inv.dtype == ex.w2_scale_inv.dtype == torch.float32
            for e in range(MOE["num_experts"]):
                p = f"model.layers.{i}.mlp.experts.{e}"
                gate_up = torch.cat([t[f"{p}.gate_proj.weight"], t[f"{p}.up_proj.weight"]])
                assert torch.equal(codes(ex.w13[e]), codes(gate_up))
                assert torch.equal(codes(ex.w2[e]), codes(t[f"{p}.down_proj.weight"]))
                assert torch.equal(ex.w13_scale_inv[e], torch.cat([t[f"{p}.gate_proj.weight_scale_inv"],
                                                                   t[f"{p}.up_proj.weight_scale_inv"]]).float())
                assert torch.equal(ex.w2_scale_inv[e], t[f"{p}.down_proj.weight_scale_inv"].float())
            gate = layers[i].mlp.gate
            assert gate.quant is None and gate.weight.dtype == torch.float32
            assert torch.equal(gate.weight, t[f"model.layers.{i}.mlp.gate.weight"])
        dense = layers[1].mlp.down_proj
        assert dense.weight.dtype == torch.float8_e4m3fn and dense.weight_scale_inv is not None
        assert layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn


def expert_tensors(num_experts, hidden, inter):
    """Per-expert FP8 checkpoint tensors {(e, proj): (codes, bf16 scale)} of random weights."""
    out = {}
    for e in range(num_experts):
        for proj, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            out[e, proj] = quantize_weight_block_fp8(torch.randn(shape) * 0.05, scale_dtype=torch.bfloat16)
    return out


def load_experts(experts: MoeExperts, tensors: dict, fused: bool) -> None:
    """Through the loader's shard ids: per-expert tensors, or transformers' fused stacks."""
    shard = {"gate": (experts.w13, 0), "up": (experts.w13, 1), "down": (experts.w2, 0)}
    scale = {experts.w13: experts.w13_scale_inv, experts.w2: experts.w2_scale_inv}
    E = experts.num_experts
    if fused:
        for param, parts in ((experts.w13, ("gate", "up")), (experts.w2, ("down",))):
            for i, target in enumerate((param, scale[param])):
                stack = torch.stack([torch.cat([tensors[e, p][i] for p in parts]) for e in range(E)])
                experts.weight_loader(target, stack, "x.fused", "fused")
        return
    for (e, proj), (w_q, s) in tensors.items():
        param, part = shard[proj]
        experts.weight_loader(param, w_q, f"x.{e}.{proj}_proj.weight", (e, part))
        experts.weight_loader(scale[param], s, f"x.{e}.{proj}_proj.weight_scale_inv", (e, part))


def test_fp8_experts_shard_with_their_scales_under_tp(fresh_seed):
    """TP=2: rank r holds gate / up rows and down columns [128 r, 128 (r + 1)) of every expert
    and the matching block row / column of the scales; per-expert and fused tensors load alike;
    the ranks' partial outputs sum to the TP=1 output (activation groups of 128 are the same on
    a rank as in the whole: only fp32 summation order differs, bound 1e-5 relative)."""
    from nanovllm.parallel.group import TPGroup, use_tp_group

    E, H, I = 3, 200, 256  # H = 200: partial last blocks along H
    tensors = expert_tensors(E, H, I)
    whole = {}
    for tp in (1, 2):
        for rank in range(tp):
            mods = []
            for fused in (False, True):
                with use_tp_group(TPGroup(rank=rank, size=tp)):
                    ex = MoeExperts(E, H, I)
                ex.quant = CheckpointFp8Experts()
                ex.quant.create(ex, "x")
                for p in ex.parameters():
                    p.data.view(torch.uint8).fill_(0xFF)  # poison: NaN codes / scales if left unloaded
                load_experts(ex, tensors, fused)
                mods.append(ex)
            a, b = mods
            for name in ("w13", "w2", "w13_scale_inv", "w2_scale_inv"):
                assert torch.equal(getattr(a, name).view(torch.uint8), getattr(b, name).view(torch.uint8)), name
            n, nb = I // tp, I // tp // 128
            rows, blocks = slice(rank * n, (rank + 1) * n), slice(rank * nb, (rank + 1) * nb)
            for e in range(E):
                (gq, gs), (uq, us), (dq, ds) = tensors[e, "gate"], tensors[e, "up"], tensors[e, "down"]
                assert torch.equal(codes(a.w13[e]), codes(torch.cat([gq[rows], uq[rows]])))
                assert torch.equal(codes(a.w2[e]), codes(dq[:, rows]))
                assert torch.equal(a.w13_scale_inv[e], torch.cat([gs[blocks], us[blocks]]).float())
                assert torch.equal(a.w2_scale_inv[e], ds[:, blocks].float())
            whole.setdefault(tp, []).append(a)
    x = torch.randn(9, H)
    w, ids = route_topk(torch.randn(9, E), 2, True)
    ref = whole[1][0](x, w, ids)
    parts = sum(m(x, w, ids) for m in whole[2])
    torch.testing.assert_close(parts, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_fused_fp8_expert_checkpoints_load_like_per_expert_ones(ckpts, tmp_path):
    folder = copy_checkpoint(ckpts["fp8"], tmp_path / "fused")
    tm.fuse_expert_tensors(folder)  # (scales too: gate_up_proj_scale_inv, down_proj_scale_inv)
    assert "model.layers.0.mlp.experts.gate_up_proj_scale_inv" in checkpoint_tensors(folder)
    with engine(ckpts["fp8"]) as a, engine(folder) as b:
        pa = dict(a.model_runner.model.named_parameters())
        pb = dict(b.model_runner.model.named_parameters())
        assert pa.keys() == pb.keys()
        for name in pa:
            assert torch.equal(pa[name].view(torch.uint8), pb[name].view(torch.uint8)), name
        assert tokens(a) == tokens(b)


def test_dequantized_experts_equal_transformers(ckpts):
    """transformers (with accelerate, on CPU) dequantizes an FP8 checkpoint when it loads: its
    experts equal ours (dimensions of whole blocks here, where its dequantizer is right)."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpts["fp8"], dtype=torch.float32).state_dict()
    with engine(ckpts["fp8"]) as llm:
        ex = llm.model_runner.model.model.layers[0].mlp.experts
        w13 = dequantize_weight_block_fp8(ex.w13, ex.w13_scale_inv)
        w2 = dequantize_weight_block_fp8(ex.w2, ex.w2_scale_inv)
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    if fused in hf:
        assert torch.equal(hf[fused].float(), w13)
        assert torch.equal(hf["model.layers.0.mlp.experts.down_proj"].float(), w2)
    else:
        for e in range(MOE["num_experts"]):
            p = f"model.layers.0.mlp.experts.{e}"
            assert torch.equal(torch.cat([hf[f"{p}.gate_proj.weight"], hf[f"{p}.up_proj.weight"]]).float(), w13[e])
            assert torch.equal(hf[f"{p}.down_proj.weight"].float(), w2[e])


def test_ignored_modules_match_whole_names():
    from nanovllm.features.quantization.fp8 import Fp8Config

    ignored = ["model.layers.1.mlp.gate", "lm_head"]
    cfg = Fp8Config.from_checkpoint({**QWEN_FP8_CONFIG, "modules_to_not_convert": ignored})
    assert not cfg.quantizes("model.layers.1.mlp.gate") and not cfg.quantizes("lm_head")
    assert cfg.quantizes("model.layers.1.mlp.gate_up_proj")  # not a name's prefix: whole dotted parts
    assert cfg.quantizes("model.layers.11.mlp.gate") and cfg.quantizes("model.layers.1.mlp.experts")
    assert not Fp8Config("block", ("model.layers.1.mlp",)).quantizes("model.layers.1.mlp.experts")


# ------------------------------------------------------------------ 2. the CPU arithmetic
def test_stacked_block_quantization_is_per_expert(fresh_seed):
    """quantize / dequantize_weight_block_fp8 on [E, N, K]: each expert blocked on its own (N and
    K not multiples of 128, so partial blocks never straddle two experts)."""
    w = torch.randn(3, 200, 300) * torch.tensor([1.0, 100.0, 0.01])[:, None, None]
    q, s = quantize_weight_block_fp8(w, scale_dtype=torch.bfloat16)
    assert q.shape == w.shape and s.shape == (3, 2, 3) and s.dtype == torch.bfloat16
    for e in range(3):
        qe, se = quantize_weight_block_fp8(w[e], scale_dtype=torch.bfloat16)
        assert torch.equal(codes(q[e]), codes(qe)) and torch.equal(s[e], se)
        assert torch.equal(dequantize_weight_block_fp8(q, s)[e], dequantize_weight_block_fp8(qe, se))


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty returns NaN-filled float tensors: an output row left unwritten shows up."""
    empty = torch.empty

    def poisoned(*a, **k):
        t = empty(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


def ref_quantize(x):
    """The kernel's convention, written independently: scale = max(amax, 1e-10) / 448 per row and
    128-column group, q = clamp(x / scale, +-448) (clamped first: torch's CPU cast does not
    saturate)."""
    rows, cols = x.shape
    g = -(-cols // 128)
    xf = F.pad(x.float(), (0, g * 128 - cols)).view(rows, g, 128)
    scale = xf.abs().amax(-1).clamp(min=1e-10) / torch.tensor(448.0)
    q = (xf / scale[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(rows, -1)[:, :cols]
    return q, scale


def exact(q, scale):
    """q * scale per 128-group along the last dim, exact in float64."""
    return q.double() * scale.double().repeat_interleave(128, -1)[..., :q.shape[-1]]


def per_element(s, rows, cols):
    """[..., ceil(rows/128), ceil(cols/128)] block values -> [..., rows, cols]."""
    return s.repeat_interleave(128, -2)[..., :rows, :].repeat_interleave(128, -1)[..., :cols]


def exact_weights(q, s):
    return q.double() * per_element(s.double(), *q.shape[-2:])


def fp8_problem(T, H, I, E, k, dtype, scale_dtype=torch.float32):
    x = torch.randn(T, H).to(dtype)
    x[1, :128] *= 50  # an outlier group: its own scale, the row's other groups unaffected
    w13, w2 = torch.randn(E, 2 * I, H) / math.sqrt(H), torch.randn(E, H, I) / math.sqrt(I)
    for w in (w13, w2):  # magnitudes differing by block (x 1/8 .. 8), so a block's scale is its own
        e, r, c = w.shape
        w *= per_element(2.0 ** torch.randint(-3, 4, (e, -(-r // 128), -(-c // 128))), r, c)
    (q13, s13), (q2, s2) = quantize_weight_block_fp8(w13), quantize_weight_block_fp8(w2)
    w, ids = route_topk(torch.randn(T, E), k, True)
    return x, (w13, q13, s13), (w2, q2, s2), w, ids


def gate_up_reference(x, q13, s13, ids, u, gamma=None, epilogue=8 * EPS32):
    """Exact silu(gate) * up of every slot from the test-quantized activations and the exact
    weights, and a bound on any fp32 computation of it rounded to unit roundoff u: a dot of H
    terms off by gamma * sum |a||w| (default (H + 4) eps: the CPU's two dequantizing products
    and fp32 sum), |silu'| <= 1.1 (plus 1/4 d^2), the fp32 epilogue's few operations (8 eps
    relative; `epilogue`) and the final rounding."""
    k, I, H = ids.shape[1], q13.shape[1] // 2, x.shape[1]
    gamma = (H + 4) * EPS32 if gamma is None else gamma
    xd = exact(*ref_quantize(x))
    w = exact_weights(q13, s13)
    slots = ids.reshape(-1).long()
    xs, ws = xd[torch.arange(slots.numel()) // k], w[slots]
    g, up = (ws[:, :I] @ xs[..., None])[..., 0], (ws[:, I:] @ xs[..., None])[..., 0]
    eg = gamma * (ws[:, :I].abs() @ xs.abs()[..., None])[..., 0]
    eu = gamma * (ws[:, I:].abs() @ xs.abs()[..., None])[..., 0]
    silu = F.silu(g)
    h = silu * up
    err = (1.1 * eg + 0.25 * eg**2) * (up.abs() + eu) + silu.abs() * eu
    return h, err + (epilogue + u) * (h.abs() + err)


def down_reference(inter, q2, s2, w, ids, u, gamma=None):
    """Exact weight * (quantized intermediate @ w2_e^T) per slot, with the bound of a dot over I
    terms (gamma, default the CPU's (I + 4) eps), the weight's product and the rounding to u."""
    I = inter.shape[1]
    gamma = (I + 4) * EPS32 if gamma is None else gamma
    hq = exact(*ref_quantize(inter))
    w2 = exact_weights(q2, s2)[ids.reshape(-1).long()]
    ws = w.reshape(-1).double()[:, None]
    y = ws * (w2 @ hq[..., None])[..., 0]
    err = gamma * ws.abs() * (w2.abs() @ hq.abs()[..., None])[..., 0]
    return y, err + (2 * EPS32 + u) * (y.abs() + err)


def assert_within(got, want, bound, what):
    assert torch.isfinite(got).all(), f"{what}: non-finite elements (left unwritten?)"
    diff = (got.double() - want).abs()
    worst = (diff / bound.clamp_min(1e-300)).max().item()
    bad = (diff > bound).sum().item()
    assert bad == 0, f"{what}: {bad} elements out of bound (worst |err| / bound {worst:.3g})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_fp8_moe_equals_the_same_arithmetic(fresh_seed, poisoned_empty, dtype):
    """moe_fp8_torch step by step against float64 on the same quantized operands: the
    activation codes and scales bit for bit, gate_up and down within the fp32 bounds above (the
    down step fed the function's own intermediate: a rounding flip of its FP8 codes is not an
    error), and the output the sum of the slots."""
    T, H, I, E, k = 7, 200, 256, 4, 2
    x, (_, q13, s13), (_, q2, s2), w, ids = fp8_problem(T, H, I, E, k, dtype)
    u = UNIT_ROUNDOFF[dtype]
    q, s = quantize_moe_activations_torch(x)
    tq, ts = ref_quantize(x)
    assert torch.equal(codes(q), codes(tq)) and torch.equal(s, ts)
    inter = moe_fp8_gate_up_torch(x, q13, s13, ids)
    assert inter.dtype == dtype and inter.shape == (T * k, I)
    assert_within(inter, *gate_up_reference(x, q13, s13, ids, u), "gate_up")
    slot_out = moe_fp8_down_torch(inter, q2, s2, w, ids)
    assert_within(slot_out, *down_reference(inter, q2, s2, w, ids, u), "down")
    out = moe_fp8_torch(x, q13, q2, w, ids, s13, s2)
    assert torch.equal(out, slot_out.view(T, k, H).sum(1))


def test_cpu_fp8_moe_is_the_kernels_arithmetic(fresh_seed):
    """The Triton kernel (interpreted on CPU, fp32 activations) and the CPU path, each GEMM on
    the same inputs: both within the fp32 bound of the exact result, so within twice it of each
    other; the activation quantizers bit for bit."""
    from nanovllm.kernels import fused_moe as fm
    from nanovllm.kernels.moe_align import align_tokens_to_experts
    from nanovllm.kernels.moe_fp8_activations import quantize_fp8_activations

    T, H, I, E, k = 5, 200, 128, 3, 2
    x, (_, q13, s13), (_, q2, s2), w, ids = fp8_problem(T, H, I, E, k, torch.float32)
    kq, ks = quantize_fp8_activations(x)
    q, s = quantize_moe_activations_torch(x)
    assert torch.equal(codes(kq), codes(q)) and torch.equal(ks, s)
    cfg = fm.get_config(T, k, E, True)
    sorted_ids, blocks, _ = align_tokens_to_experts(ids, E, cfg.block_m)
    k_inter = fm.moe_gate_up(x, q13, sorted_ids, blocks, k, cfg, s13)
    _, bound = gate_up_reference(x, q13, s13, ids, EPS32)
    assert_within(k_inter, moe_fp8_gate_up_torch(x, q13, s13, ids).double(), 2 * bound, "kernel vs torch gate_up")
    k_slots = fm.moe_down(k_inter, q2, w, sorted_ids, blocks, cfg, s2)
    _, bound = down_reference(k_inter, q2, s2, w, ids, EPS32)
    assert_within(k_slots, moe_fp8_down_torch(k_inter, q2, s2, w, ids).double(), 2 * bound, "kernel vs torch down")


def test_fp8_moe_layer_is_bounded_against_full_precision(fresh_seed):
    """FP8 experts vs the unquantized ones (moe_torch, fp32) on the same weights. Four e4m3
    roundings (activations, w13, intermediate, w2) of <= 2**-4 relative each; their rms is
    2**-4..2**-3 / sqrt(12) ~ 2.6% per value, ~6.4% normwise through the layer (measured 4.5-8.6%
    normwise, <= 9.7% on a token's row, over 40 seeds). Bound: 12% normwise, 20% on every row.
    Block magnitudes differ here (x 1/8 .. 8), so scales applied to the wrong blocks give > 45%
    (measured; checked against 20%)."""
    T, H, I, E, k = 16, 256, 256, 8, 2
    x, (w13, q13, s13), (w2, q2, s2), w, ids = fp8_problem(T, H, I, E, k, torch.float32)
    ref = moe_torch(x, w13, w2, w, ids)
    got = moe_fp8_torch(x, q13, q2, w, ids, s13, s2)
    rows = (got - ref).norm(dim=1) / ref.norm(dim=1)
    assert relative_error(got, ref) < 0.12 and rows.max().item() < 0.20, (relative_error(got, ref), rows)
    assert relative_error(moe_fp8_torch(x, q13, q2, w, ids, s13.flip(1), s2), ref) > 0.20


def test_cpu_fp8_moe_rejects_bad_arguments():
    x, (_, q13, s13), (_, q2, s2), w, ids = fp8_problem(3, 128, 128, 2, 1, torch.float32)
    with pytest.raises(ValueError, match="w13_scale must be float32"):
        moe_fp8_torch(x, q13, q2, w, ids, s13[:, :1], s2)
    with pytest.raises(ValueError, match="w2_scale must be float32"):
        moe_fp8_torch(x, q13, q2, w, ids, s13, s2.bfloat16())
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        moe_fp8_torch(x, q13.float(), q2, w, ids, s13, s2)
    with pytest.raises(ValueError, match="multiple of 128"):
        moe_fp8_torch(x, q13[:, :128], q2[:, :, :64], w, ids, s13[:, :1], s2)
    with pytest.raises(ValueError, match=r"topk_ids must be in \[0, 2\)"):
        moe_fp8_torch(x, q13, q2, w, ids + 2, s13, s2)


# ------------------------------------------------------------------ accuracy of the engine
def relative_error(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("how", ["checkpoint", "online"])
def test_logits_stay_close_to_the_16_bit_engine(ckpts, how):
    """Teacher-forced logits, FP8 vs the fp32 engine on the same (dequantized or original)
    weights: 3 layers of FP8 GEMMs (4 per layer, the experts' 2 per routed token), each rounding
    both operands by <= 2**-4 (~3.5% per GEMM), compounded by this random model's gain of ~3 per
    linear and the router's choices flipping where two experts' logits are close; measured
    28% (checkpoint) and 34% (online). Bound 50%; a wrong expert scale exceeds 100%."""
    seq = rand_ids(90, seed=3)
    with engine(ckpts["src"]) as ref:
        want = ref.model_runner.score(seq)
    path = ckpts["fp8"] if how == "checkpoint" else ckpts["src"]
    with engine(path, quantization="fp8") as llm:
        got = llm.model_runner.score(seq)
    assert relative_error(got, want) < 0.50


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """Linear and expert weights x0.3 (the tiny model's gain of ~3 per linear compounds errors
    as no trained model does), LM head x3 (peaked logits): its greedy choices mean something."""
    root = tmp_path_factory.mktemp("moe_peaked")
    src = tm.make_tiny_qwen3_moe(root / "bf16", **MOE)
    make_peaked(src)
    return src, quantize_checkpoint_fp8(src, str(root / "fp8"), not_convert=qwen_moe_not_convert(MOE["num_layers"]))


@pytest.mark.parametrize("how", ["checkpoint", "online"])
def test_greedy_tokens_agree_with_the_16_bit_engine_on_a_peaked_model(peaked, how):
    """The greedy token at each of 300 teacher-forced positions (mean top probability 0.82): >= 80%
    agree with the fp32 engine's (measured 88% checkpoint, 86% online; a wrong scale gives a
    few percent), and the logits are within 15% (measured 8-9%). Free-running, the first
    disagreement changes everything after it: the agreeing prefixes of 6 continuations of 24
    tokens cover >= 10% of them (measured 15% and 19%; unrelated models agree on ~0%)."""
    src, fp8 = peaked
    seqs = [rand_ids(100, seed=s) for s in (1, 2, 3)]
    prompts = [rand_ids(n, seed=n) for n in (20, 41, 63, 80, 99, 120)]
    with engine(src) as ref:
        want = [ref.model_runner.score(s) for s in seqs]
        want_tokens = tokens(ref, prompts, 24)
    with engine(fp8 if how == "checkpoint" else src, quantization="fp8") as llm:
        got = [llm.model_runner.score(s) for s in seqs]
        got_tokens = tokens(llm, prompts, 24)
    share = sum((g.argmax(-1) == w.argmax(-1)).sum().item() for g, w in zip(got, want)) / 300
    err = max(relative_error(g, w) for g, w in zip(got, want))
    agree = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                for x, y in zip(got_tokens, want_tokens))
    assert share >= 0.80 and err < 0.15 and agree >= 0.10 * 6 * 24, (share, err, agree)


# ------------------------------------------------------------------ 3. TP, online, dummy, bench
def test_tp2_equals_tp1_with_fp8_experts(ckpts):
    """TP=2 (gloo) of the FP8 checkpoint gives TP=1's greedy tokens. (Online quantization is not
    compared: its dense linears take one scale per rank's shard, so TP=2 quantizes them
    differently from TP=1 by design; its experts' blocks are the same, test above.)"""
    with engine(ckpts["fp8"]) as llm:
        ref = tokens(llm)
    with engine(ckpts["fp8"], tensor_parallel_size=2) as llm:
        assert tokens(llm) == ref


def test_online_quantization_of_a_16_bit_moe_checkpoint(ckpts):
    """quantization="fp8": experts in 128x128 blocks (exactly quantize_weight_block_fp8 of the
    checkpoint's weights), dense linears per tensor, routers 16-bit; it generates."""
    t = checkpoint_tensors(ckpts["src"])
    with engine(ckpts["src"], quantization="fp8") as llm:
        layers = llm.model_runner.model.model.layers
        ex = layers[2].mlp.experts
        p = "model.layers.2.mlp.experts"
        w13 = torch.stack([torch.cat([t[f"{p}.{e}.gate_proj.weight"], t[f"{p}.{e}.up_proj.weight"]]) for e in range(8)])
        q13, s13 = quantize_weight_block_fp8(w13)
        assert torch.equal(codes(ex.w13), codes(q13)) and torch.equal(ex.w13_scale_inv, s13)
        q2, s2 = quantize_weight_block_fp8(torch.stack([t[f"{p}.{e}.down_proj.weight"] for e in range(8)]))
        assert torch.equal(codes(ex.w2), codes(q2)) and torch.equal(ex.w2_scale_inv, s2)
        assert layers[2].mlp.gate.weight.dtype == torch.float32 and layers[2].mlp.gate.quant is None
        assert layers[1].mlp.gate_up_proj.weight_scale.numel() == 1  # the dense MLP: per-tensor scale
        assert all(len(o) == 12 for o in tokens(llm))
        assert_idle(llm)


@pytest.mark.parametrize("how", ["checkpoint-config", "online"])
def test_dummy_weights_draw_fp8_experts(ckpts, tmp_path, how):
    """load_format="dummy" with an FP8 MoE config (random FP8 experts of the checkpoint format)
    or with quantization="fp8": no safetensors needed, FP8 experts with finite positive scales
    whose dequantized weights have the dummy weights' spread (N(0, 0.02)), and it generates."""
    import shutil

    base = ckpts["src"] if how == "online" else ckpts["fp8"]
    folder = tmp_path / "config-only"
    folder.mkdir()
    for f in os.listdir(base):
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(base, f), folder)
    kw = dict(quantization="fp8") if how == "online" else {}
    with engine(str(folder), load_format="dummy", **kw) as llm:
        ex = llm.model_runner.model.model.layers[0].mlp.experts
        assert ex.w13.dtype == torch.float8_e4m3fn
        for q, s in ((ex.w13, ex.w13_scale_inv), (ex.w2, ex.w2_scale_inv)):
            assert torch.isfinite(s).all() and (s > 0).all()
            std = dequantize_weight_block_fp8(q, s).std().item()
            assert 0.018 < std < 0.022, std
        assert all(len(o) == 8 for o in tokens(llm, n=8))
        assert_idle(llm)


def test_bench_floor_counts_fp8_experts_at_one_byte(ckpts):
    """The floor's weight bytes per decode step with every expert read equal the engine's
    parameter bytes: experts and linears at 1 byte + their block scales, the rest 4 (fp32)."""
    sys.path.insert(0, ROOT)
    import bench

    with engine(ckpts["fp8"]) as llm:
        params = {id(p): p for p in llm.model_runner.model.parameters()}.values()
        held = sum(p.numel() * p.element_size() for p in params)
        kv_bytes, linear_bytes = bench.weight_element_bytes(llm)
        opts = bench.decoder_options(llm.config.hf_config)
        assert bench.weight_bytes_per_step(opts, 4, None, linear_bytes) == pytest.approx(held, rel=1e-9)
    with engine(ckpts["src"], quantization="fp8") as llm:  # online: the experts are 1 byte too
        ex = llm.model_runner.model.model.layers[0].mlp.experts
        assert ex.w13.element_size() == ex.w2.element_size() == 1
        assert bench.weight_element_bytes(llm)[1] == 1.0


# ------------------------------------------------------------------ 4. bad input
@pytest.mark.parametrize("how", ["checkpoint", "online"])
def test_tp_shard_that_cuts_an_expert_block_is_an_error(tmp_path_factory, monkeypatch, how):
    """moe_intermediate_size 128 at TP=2: 64 rows per rank cut a 128-row block of the scales.
    Refused when the config is read: before any process starts or weight loads. At TP=1 the
    same model is fine."""
    from nanovllm.core import model_runner

    root = tmp_path_factory.mktemp("moe_cut")
    src = tm.make_tiny_qwen3_moe(root / "bf16", **{**MOE, "moe_intermediate_size": 128})
    if how == "checkpoint":
        path, kw = quantize_checkpoint_fp8(src, str(root / "fp8")), {}
    else:
        path, kw = src, dict(quantization="fp8")
    with monkeypatch.context() as m:
        m.setattr(model_runner, "load_model", lambda *a: pytest.fail("weights were loaded"))
        with pytest.raises(ValueError, match=r"moe_intermediate_size = 128 gives 64 rows per rank.*cuts a 128"):
            engine(path, tensor_parallel_size=2, **kw)
    assert not mp.active_children()
    with engine(path, **kw) as llm:
        assert all(len(o) == 12 for o in tokens(llm, PROMPTS[:1]))


@pytest.mark.parametrize("case", ["missing_scale", "16_bit_expert", "scale_shape"])
def test_bad_fp8_expert_tensors_are_named(ckpts, tmp_path, case):
    folder = copy_checkpoint(ckpts["fp8"], tmp_path / "bad")
    name = "model.layers.2.mlp.experts.5.up_proj.weight"

    def edit(t):
        if case == "missing_scale":
            del t[name + "_scale_inv"]
        elif case == "16_bit_expert":
            t[name] = t[name].float()
        else:
            t[name + "_scale_inv"] = t[name + "_scale_inv"][:1]

    rewrite_safetensors(folder, edit)
    esc = re.escape(name)
    pattern = {"missing_scale": f"missing tensor.*{esc}_scale_inv",
               "16_bit_expert": f"{esc}.*float32, expected torch.float8",
               "scale_shape": f"{esc}_scale_inv.*shape"}[case]
    with pytest.raises(ValueError, match=pattern):
        engine(folder)


def test_fp8_experts_without_a_quantization_config_are_named(ckpts, tmp_path):
    """FP8 codes where config.json promises 16-bit weights: named, not cast into garbage."""
    folder = copy_checkpoint(ckpts["fp8"], tmp_path / "noconfig")
    def drop(cfg):
        del cfg["quantization_config"]

    edit_json(os.path.join(folder, "config.json"), drop)
    with pytest.raises(ValueError, match=r"experts\.0\.down_proj\.weight: checkpoint tensor is torch\.float8_e4m3fn, "
                                         r"expected torch\.float32"):
        engine(folder)


# ------------------------------------------------------------------ 5. on the GPU
QWEN3_30B = dict(hidden=2048, inter=768, num_experts=128, k=8)


def gpu_fp8_gamma(k_dim: int) -> float:
    """The fused kernel's FP8 dot error on Hopper, in units of sum |a||w| (as in
    tests/test_fused_moe_kernel.py): its FP8 MMA keeps ~14 bits inside each 128-wide K-step
    (DeepSeek-V3 report, sec. 3.3.2), promoted to fp32 after every step; and fp32 products/sums
    with possibly truncating tensor cores (twice the rounding) for the scale multiplies."""
    return 128 * 2.0**-13 + 2 * (k_dim // 128 + 4) * EPS32


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2])
def test_gpu_fp8_moe_layer_against_the_cpu_arithmetic(fresh_seed, tp):
    """MoeExperts with block-FP8 weights on CUDA (the fused kernel) at Qwen3-30B-A3B's shapes
    (a rank's share at TP=2: I = 384), 5 bf16 tokens, against moe_fp8_torch's steps on the CPU:
    gate_up and down each within the CPU's fp32 bound plus the GPU's (its FP8 MMA: 2**-6 of
    sum |a||w|, DeepSeek-V3's 14-bit accumulation within a 128-block, promoted to fp32 after
    each), the down step fed the kernel's intermediate; the layer's output the kernel's slots
    summed, and within 5% normwise of the CPU layer (which differs only where the two
    intermediates' FP8 codes round apart: one e4m3 step, 2**-3 relative, on a few elements)."""
    from nanovllm.parallel.group import TPGroup, use_tp_group
    from nanovllm.kernels import fused_moe as fm
    from nanovllm.kernels.moe_align import align_tokens_to_experts

    H, I, E, k, T = QWEN3_30B["hidden"], QWEN3_30B["inter"] // tp, QWEN3_30B["num_experts"], QWEN3_30B["k"], 5
    with torch.device("cuda"), use_tp_group(TPGroup(rank=0, size=1)):
        ex = MoeExperts(E, H, I)
    ex.quant = CheckpointFp8Experts()
    ex.quant.create(ex, "experts")
    ex.quant.init_dummy(ex, torch.Generator(device="cuda").manual_seed(fresh_seed))
    x = torch.randn(T, H, device="cuda").bfloat16()
    w, ids = route_topk(torch.randn(T, E, device="cuda"), k, True)
    out = ex(x, w, ids)
    cfg = fm.get_config(T, k, E, True)
    sorted_ids, blocks, _ = align_tokens_to_experts(ids, E, cfg.block_m)
    k_inter = fm.moe_gate_up(x, ex.w13, sorted_ids, blocks, k, cfg, ex.w13_scale_inv)
    k_slots = fm.moe_down(k_inter, ex.w2, w, sorted_ids, blocks, cfg, ex.w2_scale_inv)
    assert torch.equal(out, k_slots.view(T, k, H).sum(1))
    xc, q13, s13, q2, s2, wc, idc = (t.cpu() for t in (x, ex.w13, ex.w13_scale_inv, ex.w2, ex.w2_scale_inv, w, ids))
    k_inter, k_slots = k_inter.cpu(), k_slots.cpu()
    u = UNIT_ROUNDOFF[torch.bfloat16]
    # |CUDA - CPU| <= CPU bound + CUDA bound, both around the exact result of the same operands;
    # the CUDA epilogue's exp2 is approximate (32 eps allowed, as in the kernel's tests).
    _, cpu_bound = gate_up_reference(xc, q13, s13, idc, u)
    _, gpu_bound = gate_up_reference(xc, q13, s13, idc, u, gamma=gpu_fp8_gamma(H), epilogue=32 * EPS32)
    c_inter = moe_fp8_gate_up_torch(xc, q13, s13, idc)
    assert_within(k_inter, c_inter.double(), cpu_bound + gpu_bound, "CUDA vs CPU gate_up")
    _, cpu_bound = down_reference(k_inter, q2, s2, wc, idc, u)
    _, gpu_bound = down_reference(k_inter, q2, s2, wc, idc, u, gamma=gpu_fp8_gamma(I))
    c_slots = moe_fp8_down_torch(k_inter, q2, s2, wc, idc)
    assert_within(k_slots, c_slots.double(), cpu_bound + gpu_bound, "CUDA vs CPU down")
    c_out = moe_fp8_torch(xc, q13, q2, wc, idc, s13, s2)
    assert relative_error(out.cpu().float(), c_out.float()) < 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["checkpoint-config", "online"])
def test_gpu_dummy_qwen3_30b_fp8_engine_runs_to_completion(tmp_path, how):
    """Qwen3-30B-A3B's shapes with FP8 experts (random weights of the FP8 checkpoint format, or
    quantization="fp8" on random 16-bit ones), CUDA graphs on: 32 requests of the bench workload
    (max_tokens capped at 128) to the last token, every KV block freed."""
    import json

    sys.path.insert(0, ROOT)
    import bench

    from nanovllm import LLM, SamplingParams

    src = os.path.join(ROOT, bench.DUMMY_CONFIGS["qwen3-30b-a3b"])
    kw = dict(quantization="fp8")
    if how == "checkpoint-config":
        with open(os.path.join(src, "config.json")) as f:
            cfg = json.load(f)
        cfg["quantization_config"] = {**QWEN_FP8_CONFIG, "modules_to_not_convert": qwen_moe_not_convert(48)}
        with open(tmp_path / "config.json", "w") as f:
            json.dump(cfg, f)
        src, kw = str(tmp_path), {}
    prompts, max_tokens = bench.workload(32)
    max_tokens = [min(n, 128) for n in max_tokens]
    llm = LLM(src, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, gpu_memory_utilization=0.6, **kw)
    ex = llm.model_runner.model.model.layers[0].mlp.experts
    assert ex.w13.dtype == torch.float8_e4m3fn and ex.w13_scale_inv.shape == (128, 12, 16)
    outs = llm.generate(prompts, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens],
                        use_tqdm=False)
    assert [len(o["token_ids"]) for o in outs] == max_tokens
    assert_idle(llm)
    llm.shutdown()
