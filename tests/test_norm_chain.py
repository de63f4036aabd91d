"""The decoder's batch-1 forward with its RMSNorms folded into the GEMVs (model/norm_chain.py: CUDA
only in an engine; here through Triton's interpreter in fp16, tests/conftest.py) against the
layer-by-layer forward on the same weights, and the models it must leave alone.

Bound: the chain rounds every residual add as the unfused kernels do; each normed input is
rounded once (the stream times the norm weight) where the norm kernel rounds twice, so it may
differ by one rounding (fp16: 2^-11 relative), and each norm's sum of squares is added in
another order (fp32, ~1e-7). Through three layers and the final norm that stays far below 1e-2
absolute on outputs of size ~1 in fp16 (a skipped norm weight, residual or SiLU moves them by
O(1)). INT4 runs in bf16 (its GEMV takes no other), whose roundings are 8x coarser and which the
interpreter truncates: 5e-2 there, still far below O(1)."""

from __future__ import annotations

import pytest
import torch

import nanovllm.kernels.dense_gemv as dense
from nanovllm.kernels.fused_ops import norm_parts
from nanovllm.model import norm_chain
from nanovllm.model.attention import prefill_metadata
from nanovllm.model.attention.torch_backend import TorchBackend
from nanovllm.model.decoder import DecoderModel, DecoderOptions

DTYPE = torch.float16  # the interpreter rounds fp16 as the GPU does (bf16 it truncates)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # real Triton takes no CPU tensors
ENGINE_DTYPES = norm_chain.CHAIN_DTYPES


@pytest.fixture(autouse=True)
def fp16_chains(monkeypatch):
    """The chain's arithmetic is the same in either 16-bit dtype; engines take it in bf16 only
    (fp16's range), the tests in fp16 for the interpreter's exact roundings (the values here
    stay far inside fp16's range)."""
    monkeypatch.setattr(norm_chain, "CHAIN_DTYPES", (torch.bfloat16, torch.float16))


def tiny_model(seed: int, bias: bool = False, dtype: torch.dtype = DTYPE, intermediate: int = 48) -> DecoderModel:
    opts = DecoderOptions(vocab_size=40, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                          intermediate_size=intermediate, rms_norm_eps=1e-6, rope_theta=10000.0,
                          max_position_embeddings=64, qk_norm=True, qkv_bias=bias, o_bias=bias, mlp_bias=bias)
    model = DecoderModel(opts)
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        norm_like = p.dim() == 1 and p.shape[0] in (16, 64) and not bias
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if norm_like else 0.0))
    rope = model.layers[0].self_attn.rotary_emb  # one table shared by the layers
    cos_sin = rope.cos_sin
    model.to(dtype).to(DEVICE)
    rope.cos_sin = cos_sin.to(DEVICE)  # fp32, as an engine keeps it (the CUDA RoPE kernel takes no other)
    for layer in model.layers:
        layer.self_attn.attn.backend = TorchBackend()
        layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache = torch.zeros(2, 4, 4, 2, 16, dtype=dtype,
                                                                                 device=DEVICE)
    return model


def one_token(model: DecoderModel, chained: bool, token: int = 7):
    model.use_kernels = chained
    meta = prefill_metadata([1], [1], torch.tensor([0]), torch.tensor([[0]], dtype=torch.int32, device=DEVICE), DEVICE)
    return model(torch.tensor([token], device=DEVICE), torch.tensor([0], device=DEVICE), meta)


def fp8_weights(model: DecoderModel, monkeypatch) -> None:
    """Online FP8 (one scale per tensor) on every projection; its layer-by-layer path at one row
    is the same GEMV (CUDA only in an engine: one_row widened to CPU rows here)."""
    import nanovllm.features.quantization.fp8 as fp8

    monkeypatch.setattr(fp8, "one_row", lambda x: x.dim() == 2 and x.shape[0] == 1 and x.dtype == DTYPE)
    for layer in model.layers:
        for proj in norm_chain.projections(layer):
            proj.quant = fp8.TensorFp8Linear()
            proj.quant.after_loading(proj)


def int4_weights(model: DecoderModel, act_order: bool) -> None:
    """Random INT4 weights (groups of 32) on every projection; the layer-by-layer path multiplies
    them as Int4Linear.apply does (CPU: dequantized in torch; CUDA: kernels/w4a16.py), the chain
    in the INT4 GEMV (CPU: the interpreter)."""
    import nanovllm.features.quantization.int4 as int4
    from nanovllm.features.quantization.int4_formats import Int4Weights

    gen = torch.Generator().manual_seed(17)
    for layer in model.layers:
        for proj in norm_chain.projections(layer):
            n, k = proj.weight.shape
            perm = torch.randperm(k, generator=gen).to(DEVICE) if act_order else None
            proj.int4 = Int4Weights(
                torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=gen).to(torch.int32).to(DEVICE),
                (torch.rand(k // 32, n, generator=gen) * 0.03).to(torch.bfloat16).to(DEVICE),
                torch.full((k // 32, n), 8.0, dtype=torch.bfloat16, device=DEVICE), 32, perm)
            proj.int4_dtype, proj.quant = torch.bfloat16, int4.Int4Linear(int4.Int4Config("gptq", 32))


@pytest.mark.parametrize("bias, weights", [(False, "16-bit"), (True, "16-bit"), (False, "fp8"), (True, "fp8"),
                                           (False, "int4"), (True, "int4-act-order")])
def test_the_chain_equals_the_layer_by_layer_forward(monkeypatch, bias, weights):
    """SiLU * up from gate_up's epilogue, the norms from the sums of squares its neighbours wrote."""
    int4 = weights.startswith("int4")
    model = tiny_model(3 + bias, bias, torch.bfloat16 if int4 else DTYPE, 64 if int4 else 48)
    if weights == "fp8":
        fp8_weights(model, monkeypatch)
    if int4:
        int4_weights(model, weights.endswith("act-order"))
    launches = []
    for name in ("dense_gemv", "int4_gemv"):
        real = getattr(norm_chain, name)
        monkeypatch.setattr(norm_chain, name, lambda *a, real=real, **kw: launches.append(kw) or real(*a, **kw))
    plain = one_token(model, chained=False)
    assert not launches
    chained = one_token(model, chained=True)
    assert len(launches) == 4 * 3  # qkv, o, gate_up, down per layer, norms inside them
    assert all(("scale" not in kw) == int4 and (kw.get("scale") is not None) == (weights == "fp8") for kw in launches)
    assert sum("add_residual" in kw for kw in launches) == 6 and sum("norm_parts" in kw for kw in launches) == 6
    assert sum(kw.get("next_norm_weight") is not None for kw in launches) == 5  # the last: the final norm's kernel
    assert sum(kw.get("silu_mul", False) for kw in launches) == 3
    assert chained.shape == plain.shape == (1, 64) and chained.dtype == model.norm.weight.dtype
    torch.testing.assert_close(chained, plain, rtol=0, atol=5e-2 if int4 else 1e-2)
    assert plain.abs().max() > 0.3  # outputs of size ~1: the bound above is tight against them


def test_models_it_cannot_serve_take_the_layer_by_layer_forward(monkeypatch):
    model = tiny_model(5)
    row = torch.zeros(1, 64, dtype=DTYPE, device=DEVICE)
    assert norm_chain.operands(model, row) is not None
    assert norm_chain.operands(model, torch.zeros(2, 64, dtype=DTYPE, device=DEVICE)) is None  # more than one row
    assert norm_chain.operands(model, torch.zeros(1, 64, device=DEVICE)) is None  # fp32
    monkeypatch.setattr(norm_chain, "CHAIN_DTYPES", ENGINE_DTYPES)
    assert norm_chain.operands(model, row) is None  # fp16 in an engine: |s * norm weight| may pass 65504
    assert norm_chain.operands(model.to(torch.bfloat16), row.to(torch.bfloat16)) is not None
    model.to(DTYPE)
    monkeypatch.setattr(norm_chain, "CHAIN_DTYPES", (torch.bfloat16, torch.float16))
    handle = model.layers[1].register_forward_pre_hook(lambda *_: None)  # EAGLE-3's kept layer inputs
    assert norm_chain.operands(model, row) is None
    handle.remove()
    model.layers[2].mlp.down_proj.quant = object()  # LoRA, or a method without gemv_operands (INT4)
    assert norm_chain.operands(model, row) is None
    model.layers[2].mlp.down_proj.quant = None
    gate_up = model.layers[1].mlp.gate_up_proj  # FP8 block scales with gate / up off a block row
    gate_up.quant = type("Blocks", (), {"gemv_operands": lambda self, layer: (layer.weight, torch.ones(1, 1))})()
    assert norm_chain.operands(model, row) is None
    gate_up.quant = None
    model.layers[0].mlp = torch.nn.Identity()  # a mixture-of-experts block: no gate_up / down
    assert norm_chain.operands(model, row) is None


@pytest.mark.parametrize("hidden", [1, 72, 1000])
def test_norm_parts_of_one_row(hidden):
    """The first norm of model/norm_chain.py: the row's fp32 sum of squares (another order than
    torch's: within 1e-5) and its product with the weight, rounded once (fp16: the interpreter
    rounds it as the GPU does; each factor exact in fp32, their product too: bit for bit)."""
    dtype = torch.float16
    x = torch.randn(1, hidden, device=DEVICE).to(dtype)
    w = (1 + 0.2 * torch.randn(hidden, device=DEVICE)).to(dtype)
    parts, scaled = norm_parts(x, w)
    total = x.float().square().sum()
    assert parts.shape == (1,) and parts.dtype == torch.float32 and abs(parts[0] - total) <= 1e-5 * total
    assert torch.equal(scaled, (x.float() * w.float()).to(dtype))
    for bad_x, bad_w in ((x.repeat(2, 1), w), (x, w[:-1] if hidden > 1 else w.float()), (x.float(), w.float())):
        with pytest.raises(ValueError):
            norm_parts(bad_x, bad_w)
