"""Online FP8's per-row decode chain (features/quantization/fp8_chain.py) and its kernels
(kernels/fp8_rows.py, qk_norm_rope's row_scale), through Triton's interpreter in fp16 (which it
rounds as the GPU does; tests/conftest.py), against torch.

Kernels: exact. Each kernel's 16-bit part (scaled input, residual add, norm, SiLU * up) is
compared with the kernel or torch op it shares its arithmetic with, and its codes and scales
with fp8_ops' per-token quantizer applied to that part's output, byte for byte.

The chain: against the same arithmetic in torch (`reference`: torch norms, RoPE and attention,
the GEMM of fp8_chain.gemm). The two differ only by ulp-level rsqrt / exp results, which now and
then move a value across an e4m3 rounding boundary (one code step, 2^-4 relative, on one element
of a 48-96 wide product); through three layers that stays below 2e-2 on outputs of size ~1.
Against the 16-bit forward on the same weights the chain's error is FP8's own, about that of the
per-tensor layer-by-layer path (rms within 1.5x of it), where a skipped scale moves outputs by O(1).
Where torch runs FP8 `_scaled_mm` on CPU, the chain also runs through the call CUDA makes
(`scaled_gemm`, the unit activation scale) against the fp32 product.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import nanovllm.features.quantization.fp8 as fp8
import nanovllm.features.quantization.fp8_chain as fp8_chain
from nanovllm.features.quantization.fp8_chain import Fp8RowChain, gemm
from nanovllm.features.quantization.fp8_ops import quantize_per_token_group_torch
from nanovllm.kernels.fp8_rows import add_norm_quant, quantize_rows, silu_mul_quant
from nanovllm.kernels.fused_ops import rms_norm, silu_and_mul
from nanovllm.kernels.qk_norm_rope import qk_norm_rope
from nanovllm.model.attention import AttentionMetadata
from nanovllm.model.attention.torch_backend import TorchBackend
from nanovllm.model.decoder import DecoderModel, DecoderOptions

DTYPE = torch.float16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def fp16_chains(monkeypatch):
    """Engines take the chain in bf16 only (fp16's range: fp8_chain.CHAIN_DTYPES); its arithmetic
    is the same in fp16, which the interpreter rounds exactly, and these values stay far inside it."""
    monkeypatch.setattr(fp8_chain, "CHAIN_DTYPES", (torch.bfloat16, torch.float16))


def rows_torch(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = quantize_per_token_group_torch(y, group_size=y.shape[-1])
    return q, s[:, 0]


def scaled(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (x.float() * s[:, None]).to(x.dtype)


def assert_same_codes(got, want):
    (q, s), (q_ref, s_ref) = got, want
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def randn(*shape, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(DTYPE)


@pytest.mark.parametrize("rows, hidden", [(1, 64), (5, 200), (3, 1024)])
@pytest.mark.parametrize("with_scale, with_residual", [(False, False), (True, True), (True, False)])
def test_add_norm_quant(rows, hidden, with_scale, with_residual):
    x = randn(rows, hidden, scale=40.0 if with_scale else 1.0)
    xs = torch.rand(rows, device=DEVICE) * 0.05 + 0.01 if with_scale else None
    res = randn(rows, hidden) if with_residual else None
    w = randn(hidden, scale=0.2) + 1
    x_in = scaled(x, xs) if with_scale else x
    y_ref, s_ref = rms_norm(x_in, w, 1e-6, residual=res) if with_residual else (rms_norm(x_in, w, 1e-6), None)
    y, s = add_norm_quant(x, xs, res, w, 1e-6, quantize=False)
    assert torch.equal(y, y_ref) and (s is None if res is None else torch.equal(s, s_ref))
    codes, s2 = add_norm_quant(x, xs, res, w, 1e-6)
    assert_same_codes(codes, rows_torch(y_ref))
    assert (s2 is None) == (res is None) and (s2 is None or torch.equal(s2, s_ref))


@pytest.mark.parametrize("rows, d", [(1, 48), (4, 300), (2, 2048)])
@pytest.mark.parametrize("with_scale", [False, True])
def test_silu_mul_quant(rows, d, with_scale):
    x = randn(rows, 2 * d, scale=30.0 if with_scale else 2.0)
    xs = torch.rand(rows, device=DEVICE) * 0.1 if with_scale else None
    act = silu_and_mul(scaled(x, xs) if with_scale else x)
    assert_same_codes(silu_mul_quant(x, xs), rows_torch(act))


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # (the interpreter's reduction of the NaN row)
def test_a_nan_makes_its_rows_scale_nan():
    """As torch's amax (and the per-tensor quantizer) propagate it; the other rows stay finite."""
    x = randn(3, 256)
    x[1, 40] = float("nan")
    for _, s in (quantize_rows(x), add_norm_quant(x, None, None, randn(256) + 1, 1e-6)[0],
                 silu_mul_quant(torch.cat([x, x], dim=1), None)):
        assert s[1].isnan() and s[[0, 2]].isfinite().all()
    assert rows_torch(x)[1][1].isnan()


def test_quantize_rows_and_a_zero_row():
    x = randn(6, 512, scale=3.0)
    x[2] = 0.0  # scale 1e-12, codes 0
    x[4, 17] = 300.0  # one outlier coarsens its own row only
    got = quantize_rows(x)
    assert_same_codes(got, rows_torch(x))
    assert got[1][2] == 1e-12 and got[1][4] > 10 * got[1][3]


def test_bad_inputs_name_the_field():
    x = randn(3, 64)
    with pytest.raises(ValueError, match="x_scale"):
        add_norm_quant(x, torch.ones(2, device=DEVICE), None, x[0], 1e-6)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        quantize_rows(x.float())
    with pytest.raises(ValueError, match="2 \\* d"):
        silu_mul_quant(randn(3, 63), None)
    with pytest.raises(ValueError, match="weight"):
        add_norm_quant(x, None, None, randn(32), 1e-6)


def _rope_table(head_dim: int, positions: int = 32) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    freqs = torch.arange(positions, device=DEVICE).float()[:, None] * inv[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).unsqueeze(1)


@pytest.mark.parametrize("fp8_cache", [False, True])
def test_qk_norm_rope_row_scale_is_the_scaled_input(fp8_cache):
    """q, k and both caches as qk_norm_rope of the rows times their scales (rounded to fp16)."""
    tokens, heads, kv_heads, hd = 4, 4, 2, 16
    qkv = randn(tokens, (heads + 2 * kv_heads) * hd, scale=20.0)
    rs = torch.rand(tokens, device=DEVICE) * 0.1 + 0.02
    w_q, w_k = randn(hd, scale=0.2) + 1, randn(hd, scale=0.2) + 1
    pos = torch.tensor([3, 0, 9, 5], device=DEVICE)
    outs = []
    for rows, row_scale in ((qkv, rs), (scaled(qkv, rs), None)):
        dt = torch.float8_e4m3fn if fp8_cache else DTYPE
        caches = [torch.zeros(3, 4, kv_heads, hd, device=DEVICE).to(dt) for _ in range(2)]
        extra = dict(k_scale=torch.full((1,), 0.05, device=DEVICE), v_scale=torch.full((1,), 0.04, device=DEVICE)) \
            if fp8_cache else {}
        q, k, _ = qk_norm_rope(rows, w_q, w_k, _rope_table(hd), pos, heads, kv_heads, hd, 1e-6, k_cache=caches[0],
                               v_cache=caches[1], slot_mapping=torch.tensor([1, 6, -1, 11], device=DEVICE),
                               row_scale=row_scale, **extra)
        outs.append([q, k] + [c.view(torch.uint8) if fp8_cache else c for c in caches])
    for got, want in zip(*outs):
        assert torch.equal(got, want)
    assert outs[0][3].float().abs().sum() > 0  # v reached the cache
    with pytest.raises(ValueError, match="row_scale"):
        qk_norm_rope(qkv, w_q, w_k, _rope_table(hd), pos, heads, kv_heads, hd, 1e-6, row_scale=rs)


# ----------------------------------------------------------------------------- the chain


def tiny_model(seed: int = 3, qk_norm: bool = True) -> DecoderModel:
    opts = DecoderOptions(vocab_size=40, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                          intermediate_size=48, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
                          qk_norm=qk_norm)
    model = DecoderModel(opts)
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        norm_like = p.dim() == 1 and p.shape[0] in (16, 64)
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if norm_like else 0.0))
    rope = model.layers[0].self_attn.rotary_emb
    cos_sin = rope.cos_sin
    model.to(DTYPE).to(DEVICE)
    rope.cos_sin = cos_sin.to(DEVICE)
    for layer in model.layers:
        attn = layer.self_attn.attn
        attn.backend = TorchBackend()
        attn.k_cache, attn.v_cache = (torch.randn(2, 6, 4, 2, 16, generator=gen) * 0.5).to(DTYPE).to(DEVICE)
    return model


def fp8_weights(model: DecoderModel) -> None:
    """Online FP8 as a load gives it: every projection TensorFp8Linear, the chain in `chains`."""
    for layer in model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            proj.quant = fp8.TensorFp8Linear()
            proj.quant.after_loading(proj)
    model.chains.append(Fp8RowChain(fp8.TensorFp8Linear))


def decode_meta(ctx: list[int]) -> AttentionMetadata:
    """One new token a sequence at position ctx - 1 (blocks of 4; sequence i owns blocks 2i, 2i + 1)."""
    tables = torch.tensor([[2 * i, 2 * i + 1] for i in range(len(ctx))], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([2 * i * 4 + c - 1 for i, c in enumerate(ctx)], device=DEVICE)
    return AttentionMetadata(is_prefill=False, slot_mapping=slots, context_lens=torch.tensor(ctx, dtype=torch.int32,
                             device=DEVICE), block_tables=tables, query_lens=[1] * len(ctx), kv_lens=list(ctx))


def reference(model: DecoderModel, hidden, positions, meta) -> torch.Tensor:
    """fp8_chain's arithmetic in torch: rows quantized by fp8_ops' per-token quantizer, each GEMM
    output times its rows' scales (rounded to fp16), torch norms, RoPE, attention and SiLU."""
    x, stream = hidden, None
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.use_kernels = False
        if stream is None:
            stream, normed = hidden, layer.input_layernorm(hidden)
        else:
            normed, stream = layer.input_layernorm(x, stream)
        codes, s = rows_torch(normed)
        out = attn.attend(positions, scaled(gemm(codes, attn.qkv_proj, DTYPE), s), meta)
        codes, s = rows_torch(out)
        normed, stream = layer.post_attention_layernorm(scaled(gemm(codes, attn.o_proj, DTYPE), s), stream)
        codes, s = rows_torch(normed)
        gate, up = scaled(gemm(codes, mlp.gate_up_proj, DTYPE), s).chunk(2, dim=-1)
        act = (F.silu(gate.float()).to(DTYPE).float() * up.float()).to(DTYPE)
        codes, s = rows_torch(act)
        x = scaled(gemm(codes, mlp.down_proj, DTYPE), s)
    return model.norm(x, stream)[0]


def _caches(model):
    return [t.clone() for layer in model.layers for t in (layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache)]


def _restore(model, saved):
    for layer, k, v in zip(model.layers, saved[0::2], saved[1::2]):
        layer.self_attn.attn.k_cache.copy_(k)
        layer.self_attn.attn.v_cache.copy_(v)


def _rms(t: torch.Tensor) -> float:
    return t.float().pow(2).mean().sqrt().item()


@pytest.mark.parametrize("qk_norm", [True, False])  # Qwen3; Llama 3 and Qwen2.5 (RoPE alone)
def test_the_chain_against_its_torch_arithmetic_and_the_16_bit_forward(monkeypatch, qk_norm):
    model = tiny_model(qk_norm=qk_norm)
    ids, ctx = torch.tensor([7, 1, 30], device=DEVICE), [5, 8, 2]
    positions, meta = torch.tensor([c - 1 for c in ctx], device=DEVICE), decode_meta(ctx)
    saved = _caches(model)
    full = model(ids, positions, meta)  # 16-bit weights, layer by layer
    fp8_weights(model)
    _restore(model, saved)
    model.use_kernels = False  # the layer-by-layer FP8 path (on CUDA, None would take the chain)
    per_tensor = model(ids, positions, meta)
    _restore(model, saved)
    want = reference(model, model.embed_tokens(ids), positions, meta)
    want_caches = _caches(model)
    _restore(model, saved)
    calls = []
    real = Fp8RowChain.forward
    monkeypatch.setattr(Fp8RowChain, "forward", lambda self, *a: calls.append(1) or real(self, *a))
    model.use_kernels = True
    got = model(ids, positions, meta)
    assert calls == [1] and got.shape == (3, 64) and got.dtype == DTYPE
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2)
    for c, w in zip(_caches(model), want_caches):
        torch.testing.assert_close(c, w, rtol=0, atol=2e-2)
    # FP8's own error: about the per-tensor path's (rms 0.18-0.32 on outputs of rms 1.0 here, this
    # random model amplifying each rounding); a scale skipped or applied twice gives O(1) and more.
    assert _rms(got - full) <= 1.5 * _rms(per_tensor - full)
    assert (got - full).abs().max() <= 1.5 * (per_tensor - full).abs().max()
    assert _rms(got - per_tensor) > 1e-3 and _rms(full) > 0.5  # per-row and per-tensor scales do differ


def _cpu_scaled_mm() -> bool:
    """Whether this torch runs FP8 torch._scaled_mm on CPU (2.13's CPU build does)."""
    try:
        one = torch.ones(1)
        torch._scaled_mm(torch.zeros(16, 16).to(torch.float8_e4m3fn), torch.zeros(16, 16).to(torch.float8_e4m3fn).t(),
                         one, one, out_dtype=DTYPE)
        return True
    except (RuntimeError, NotImplementedError):
        return False


@pytest.mark.skipif(DEVICE != "cpu" or not _cpu_scaled_mm(), reason="the GEMM CUDA takes, run on CPU")
def test_the_chain_through_the_gemm_cuda_takes(monkeypatch):
    """The chain with scaled_gemm (torch._scaled_mm with the unit activation scale, the call CUDA
    makes) instead of the fp32 product the CPU path multiplies: outputs and caches as close as
    two roundings of the same products (one fp16 ulp of a GEMM output, through three layers)."""
    model = tiny_model()
    fp8_weights(model)
    ids, ctx = torch.tensor([7, 1, 30], device=DEVICE), [5, 8, 2]
    positions, meta = torch.tensor([c - 1 for c in ctx], device=DEVICE), decode_meta(ctx)
    saved, results, calls = _caches(model), [], []
    real = Fp8RowChain.forward
    monkeypatch.setattr(Fp8RowChain, "forward", lambda self, *a: calls.append(1) or real(self, *a))
    model.use_kernels = True
    for product in (gemm, fp8_chain.scaled_gemm):
        _restore(model, saved)
        monkeypatch.setattr(fp8_chain, "gemm", product)
        results.append((model(ids, positions, meta), _caches(model)))
    (want, want_caches), (got, got_caches) = results
    assert calls == [1, 1] and _rms(want) > 0.5
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2)
    for c, w in zip(got_caches, want_caches):
        torch.testing.assert_close(c, w, rtol=0, atol=2e-2)


def test_steps_and_models_it_declines(monkeypatch):
    model = tiny_model()
    fp8_weights(model)
    chain = model.chains[0]
    rows, meta = torch.zeros(2, 64, dtype=DTYPE, device=DEVICE), decode_meta([3, 4])
    assert chain.operands(model, rows, meta) is not None
    assert chain.operands(model, rows, None) is None
    assert chain.operands(model, rows, AttentionMetadata(**{**vars(meta), "is_prefill": True})) is None
    assert chain.operands(model, rows.float(), meta) is None
    monkeypatch.setattr(fp8_chain, "CHAIN_DTYPES", (torch.bfloat16,))
    assert chain.operands(model, rows, meta) is None  # fp16 in an engine (the module's CHAIN_DTYPES)
    monkeypatch.setattr(fp8_chain, "CHAIN_DTYPES", (torch.bfloat16, torch.float16))
    qkv = model.layers[0].self_attn.qkv_proj
    qkv.tp_size = 2  # tensor parallelism: a row's scale would differ by rank
    assert chain.operands(model, rows, meta) is None
    qkv.tp_size = 1
    monkeypatch.setattr(fp8_chain, "MAX_ROW", 63)  # a row past what one program of fp8_rows holds
    assert chain.operands(model, rows, meta) is None
    monkeypatch.setattr(fp8_chain, "MAX_ROW", 64)
    assert chain.operands(model, rows, meta) is not None
    model.layers[1].self_attn.fused_rope = False  # a head size the fused q/k kernel does not take
    assert chain.operands(model, rows, meta) is None
    model.layers[1].self_attn.fused_rope = True
    handle = model.layers[1].register_forward_pre_hook(lambda *_: None)  # EAGLE-3's kept layer inputs
    assert chain.operands(model, rows, meta) is None
    handle.remove()
    down = model.layers[2].mlp.down_proj
    down.quant = object()  # LoRA's wrapper or another scheme
    assert chain.operands(model, rows, meta) is None
    down.quant = fp8.TensorFp8Linear()
    down.bias = torch.nn.Parameter(torch.zeros(64, dtype=DTYPE, device=DEVICE), requires_grad=False)
    assert chain.operands(model, rows, meta) is None
    down.bias = None
    mlp, model.layers[1].mlp = model.layers[1].mlp, torch.nn.Identity()  # a mixture-of-experts block
    assert chain.operands(model, rows, meta) is None
    model.layers[1].mlp = mlp
    assert chain.operands(model, rows, meta) is not None
    model.layers[0].self_attn.attn.k_cache = torch.empty(0)  # start-up forwards: no cache yet
    assert chain.operands(model, rows, meta) is None


def test_online_fp8_gives_each_decoder_the_chain_and_block_fp8_none():
    for scheme, chained in (("tensor", True), ("block", False)):
        model = DecoderModel(DecoderOptions(vocab_size=40, hidden_size=128, num_layers=1, num_heads=2, num_kv_heads=2,
                                            head_dim=64, intermediate_size=128, rms_norm_eps=1e-6,
                                            rope_theta=1e4, max_position_embeddings=64))
        fp8.Fp8Config(scheme).quantize(model)
        assert [type(c) for c in model.chains] == ([Fp8RowChain] if chained else [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_gpu_the_chain_in_a_cuda_graph_replays_its_eager_result(monkeypatch):
    """bf16 as engines take it; a decode step's forward captured after an eager one (as
    core/cuda_graphs.py does), replayed on the same inputs and caches: the same bytes."""
    monkeypatch.setattr(fp8_chain, "CHAIN_DTYPES", (torch.bfloat16,))
    model = tiny_model()
    rope = model.layers[0].self_attn.rotary_emb
    cos_sin = rope.cos_sin  # kept in fp32, as an engine's load keeps it (qk_norm_rope takes fp32 only)
    model.to(torch.bfloat16)
    rope.cos_sin = cos_sin
    for layer in model.layers:
        attn = layer.self_attn.attn
        attn.k_cache, attn.v_cache = attn.k_cache.to(torch.bfloat16), attn.v_cache.to(torch.bfloat16)
    fp8_weights(model)
    ids, ctx = torch.tensor([7, 1, 30], device=DEVICE), [5, 8, 2]  # (the caches hold 6 blocks: 3 sequences)
    positions, meta = torch.tensor([c - 1 for c in ctx], device=DEVICE), decode_meta(ctx)
    saved = _caches(model)
    eager = model(ids, positions, meta)
    eager_caches = _caches(model)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(ids, positions, meta)
    _restore(model, saved)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and all(torch.equal(a, b) for a, b in zip(_caches(model), eager_caches))
