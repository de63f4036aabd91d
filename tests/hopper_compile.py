"""Compile nano-vllm's Triton kernels for Hopper (sm90) on a machine without a GPU.

    python tests/hopper_compile.py [scenario ...]     # one JSON line per kernel launch

Each scenario calls a kernel wrapper (paged_decode_attention, store_kvcache, ...) with CPU
tensors of the dtypes the H200 runs (bf16 activations, bf16 or FP8 caches and weights). The
launches are caught instead of run (JITFunction.run is replaced): each one's arguments become
a Triton signature (tensors as pointer types, ints, floats, constexprs as given), which
`triton.compile` turns into a cubin for sm90 through Triton's own CUDA front end and ptxas.
That front end type-checks what the interpreter of CI's other kernel tests never does. Must run
without TRITON_INTERPRET (tests/test_kernel_compile.py starts it so). Kernel outputs are never
written, so a wrapper's host code after a launch sees garbage: the scenarios avoid wrappers
that read kernel results back on the host.
"""

from __future__ import annotations

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
         torch.float8_e4m3fn: "fp8e4nv", torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16",
         torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}


def _type_of(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def capture_launches(scenario) -> list[tuple]:
    """Run `scenario()` with every Triton launch caught: [(kernel, args by name, options)]."""
    from triton.runtime.jit import JITFunction

    launches = []
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "num_ctas") if k in kwargs}
        named = dict(zip(self.arg_names, args))
        named.update(kwargs)
        launches.append((self, named, options))

    JITFunction.run = run
    try:
        scenario()
    finally:
        JITFunction.run = original
    return launches


def _aligned(value) -> bool:
    """Whether a launch would specialize this argument as divisible by 16 (a tensor's address, an
    int), as Triton's launcher does: its vector loads and the SASS read from it depend on it."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def compile_launch(kernel, named: dict, options: dict, capability: int = 90):
    """triton.compile of one caught launch for sm90, or another capability (a missing argument
    keeps its default), with the divisibility a real launch would specialize."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        if p.name in named:
            value = named[p.name]
        elif p.has_default:
            value = p.default
        else:
            raise TypeError(f"{kernel.fn.__name__}: no value for {p.name}")
        if p.is_constexpr or value is None:
            signature[p.name] = "constexpr"
            constexprs[(i,)] = value
        else:
            signature[p.name] = _type_of(value)
            if _aligned(value) and not p.do_not_specialize and not (isinstance(value, torch.Tensor)
                                                                     and p.do_not_specialize_on_alignment):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)


# ---------------------------------------------------------------------------- scenarios
def _paged_decode(cache_dtype, num_splits):
    from nanovllm.kernels.paged_decode import paged_decode_attention

    q = torch.randn(5, 16, 128).to(BF16)
    k_cache = torch.zeros(8, 256, 8, 128).to(cache_dtype)
    v_cache = torch.zeros(8, 256, 8, 128).to(cache_dtype)
    tables = torch.zeros(5, 4, dtype=torch.int32)
    lens = torch.full((5,), 300, dtype=torch.int32)
    scales = (torch.ones(1), torch.ones(1)) if cache_dtype == FP8 else (None, None)
    paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.088, num_splits, k_scale=scales[0], v_scale=scales[1])


def _paged_prefill(cache_dtype):
    from nanovllm.kernels.paged_prefill import paged_prefill_attention

    caches = [torch.zeros(8, 256, 8, 128).to(cache_dtype) for _ in range(2)]
    scales = dict(k_scale=torch.ones(1), v_scale=torch.ones(1)) if cache_dtype == FP8 else {}
    paged_prefill_attention(torch.randn(40, 32, 128).to(BF16), *caches, torch.zeros(2, 4, dtype=torch.int32),
                            torch.tensor([0, 30, 40], dtype=torch.int32), torch.tensor([300, 10], dtype=torch.int32),
                            30, 0.088, **scales)


def _store(cache_dtype):
    from nanovllm.kernels.kv_store import store_kvcache

    k, v = torch.randn(7, 8, 128).to(BF16), torch.randn(7, 8, 128).to(BF16)
    k_cache = torch.zeros(4, 256, 8, 128).to(cache_dtype)
    v_cache = torch.zeros(4, 256, 8, 128).to(cache_dtype)
    scales = (torch.ones(1), torch.ones(1)) if cache_dtype == FP8 else (None, None)
    store_kvcache(k, v, k_cache, v_cache, torch.arange(7), *scales)


def _qk_norm_rope(cache_dtype, norm, row_scale=False):
    from nanovllm.kernels.qk_norm_rope import qk_norm_rope
    from nanovllm.model.layers.rotary_embedding import RotaryEmbedding

    nh, nkv, hd, tokens = 16, 8, 128, 6
    qkv = torch.randn(tokens, (nh + 2 * nkv) * hd).to(BF16)
    w = [torch.ones(hd).to(BF16), torch.ones(hd).to(BF16)] if norm else [None, None]
    cos_sin = RotaryEmbedding(hd, 4096, 1e6).cos_sin
    positions = torch.arange(tokens)
    kw = dict(row_scale=torch.ones(tokens)) if row_scale else {}
    if cache_dtype is not None:
        caches = [torch.zeros(4, 256, nkv, hd).to(cache_dtype) for _ in range(2)]
        scales = (torch.ones(1), torch.ones(1)) if cache_dtype == FP8 else (None, None)
        kw.update(k_cache=caches[0], v_cache=caches[1], slot_mapping=torch.arange(tokens), k_scale=scales[0],
                  v_scale=scales[1])
    qk_norm_rope(qkv, w[0], w[1], cos_sin, positions, nh, nkv, hd, 1e-6, **kw)


def _rms_norm_and_silu():
    from nanovllm.kernels.fused_ops import norm_parts, rms_norm, silu_and_mul

    x, w = torch.randn(6, 1024).to(BF16), torch.ones(1024).to(BF16)
    rms_norm(x, w, 1e-6)
    rms_norm(x, w, 1e-6, torch.randn(6, 1024).to(BF16))
    silu_and_mul(torch.randn(6, 2 * 3072).to(BF16))
    norm_parts(x[:1].contiguous(), w)  # the norm chain's first norm


def _fp8_gemm():
    from nanovllm.kernels.fp8_gemm import fp8_block_matmul, quantize_fp8_per_tensor, quantize_fp8_per_token_group

    x = torch.randn(9, 512).to(BF16)
    quantize_fp8_per_token_group(x)
    quantize_fp8_per_tensor(x)
    a_q, a_s = torch.zeros(9, 512).to(FP8), torch.ones(9, 4)
    w_q, w_s = torch.zeros(384, 512).to(FP8), torch.ones(3, 4)
    fp8_block_matmul(a_q, a_s, w_q, w_s, BF16)


def _fp8_rows():
    from nanovllm.kernels.fp8_rows import add_norm_quant, quantize_rows, silu_mul_quant

    x, w, s = torch.randn(6, 4096).to(BF16), torch.ones(4096).to(BF16), torch.ones(6)
    add_norm_quant(x, None, None, w, 1e-6)  # the first layer's input norm
    add_norm_quant(x, s, x.clone(), w, 1e-6)
    add_norm_quant(x, s, x.clone(), w, 1e-6, quantize=False)  # the final norm
    silu_mul_quant(torch.randn(6, 2 * 12288).to(BF16), s)
    quantize_rows(x)


def _fused_moe(fp8, tokens=5, experts=8, k=2):
    from nanovllm.kernels import fused_moe as fm

    hidden, inter = 256, 128
    x = torch.randn(tokens, hidden).to(BF16)
    weights = torch.full((tokens, k), 0.5)
    ids = torch.randint(0, experts, (tokens, k), dtype=torch.int32)
    if fp8:
        w13, w2 = torch.zeros(experts, 2 * inter, hidden).to(FP8), torch.zeros(experts, hidden, inter).to(FP8)
        s13, s2 = torch.ones(experts, 2 * inter // 128, hidden // 128), torch.ones(experts, hidden // 128, inter // 128)
        fm.fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2)
    else:
        w13, w2 = torch.zeros(experts, 2 * inter, hidden).to(BF16), torch.zeros(experts, hidden, inter).to(BF16)
        fm.fused_moe(x, w13, w2, weights, ids)


def _sampling(dtype):
    from nanovllm.kernels.sampling import gumbel_argmax_triton

    b = 4
    x = torch.randn(b, 20_000).to(dtype)
    seeds, offsets = torch.arange(b, dtype=torch.int64), torch.arange(b, dtype=torch.int64)
    gumbel_argmax_triton(x, None, seeds, offsets, torch.full((b,), 0.7))
    gumbel_argmax_triton(x, torch.full((b,), -1.0), seeds, offsets)


def _filtered_sampling(dtype, top_k=True, top_p=True, min_p=True, scale=True, rounds=1):
    from nanovllm.kernels.top_p import filtered_sample_triton

    b = 4
    x = torch.randn(b, 20_000).to(dtype)
    full = lambda v: torch.full((b,), v)  # noqa: E731
    filtered_sample_triton(x, torch.tensor([0.0, 0.7, 1.0, 1.3]), full(1.0) if top_k else None,
                           full(0.9) if top_p else None, full(-3.0) if min_p else None,
                           torch.arange(b, dtype=torch.int64), torch.arange(b, dtype=torch.int64), scale=scale,
                           rounds=rounds)


def _w4a16(m, group_size, dtype=BF16, config=None, silu_mul=False, folds=False):
    from nanovllm.kernels.w4a16 import choose, w4a16_matmul
    from nanovllm.kernels.w4a16_gemv import gemv

    k, n = 4096, 6144
    qweight = torch.zeros(k // 8, n, dtype=torch.int32)
    scales = torch.ones(k // group_size, n).to(dtype)
    if silu_mul:  # gate_up's batch-1 GEMV with SiLU * up in its epilogue (and the norm chain's scaling)
        gemv(torch.randn(1, k).to(dtype), qweight, scales, scales, group_size, choose(1, n, k), silu_mul=True,
             norm_parts=torch.ones(256))
        return
    if folds:  # o_proj / down_proj in the norm chain; qkv with its bias and the norm's scaling
        x, cfg = torch.randn(1, k).to(dtype), choose(1, n, k)
        gemv(x, qweight, scales, scales, group_size, cfg, add_residual=torch.randn(1, n).to(dtype),
             next_norm_weight=torch.ones(n).to(dtype))
        gemv(x, qweight, scales, scales, group_size, cfg, bias=torch.ones(n).to(dtype), norm_parts=torch.ones(256))
        return
    w4a16_matmul(torch.randn(m, k).to(dtype), qweight, scales, scales, group_size, config=config)


def _dense_gemv(weight_dtype, prologue, k=1024, n=4096, block=False):
    from nanovllm.kernels.dense_gemv import Prologue, dense_gemv

    silu_mul = prologue.endswith("SILU_MUL")  # the epilogue of gate_up's [2I, K] weight (not a Prologue)
    prologue = prologue.removesuffix("+SILU_MUL")
    p = Prologue.PLAIN if prologue in ("SILU_MUL", "ADD_RESIDUAL") else Prologue[prologue]
    scale = (torch.ones(-(-n // 128), -(-k // 128)) if block else torch.ones(1)) if weight_dtype == FP8 else None
    extra = dict(residual=torch.randn(1, k).to(BF16), norm_weight=torch.ones(k).to(BF16)) if p == Prologue.RMS_NORM else {}
    if p == Prologue.NORM_PARTS:
        extra = dict(norm_parts=torch.ones(256))
    if prologue == "ADD_RESIDUAL":  # o_proj / down_proj in the norm chain: the next norm's product too
        extra = dict(add_residual=torch.randn(1, n).to(BF16), next_norm_weight=torch.ones(n).to(BF16))
    dense_gemv(torch.randn(1, k).to(BF16), torch.zeros(n, k).to(weight_dtype), scale=scale, prologue=p,
               silu_mul=silu_mul, **extra)


def _fused_moe_int4(tokens, permuted, experts=8, k=2):
    from nanovllm.kernels.fused_moe_int4 import Int4Stack, fused_moe_int4

    hidden, inter, group = 256, 128, 128

    def stack(k_in, n):
        scales = torch.ones(experts, k_in // group, n).to(BF16)
        perm = torch.zeros(experts, k_in, dtype=torch.int32) if permuted else None
        return Int4Stack(torch.zeros(experts, k_in // 8, n, dtype=torch.int32), scales, scales, group, perm)

    ids = torch.randint(0, experts, (tokens, k), dtype=torch.int32)
    fused_moe_int4(torch.randn(tokens, hidden).to(BF16), stack(hidden, 2 * inter), stack(inter, hidden),
                   torch.full((tokens, k), 0.5), ids)


def _lora(tokens, rank, parts, in_features=4096, slots=8):
    from nanovllm.kernels.lora import LoraTiles, lora_expand, lora_shrink

    tiles = LoraTiles.allocate(512, slots, "cpu")
    width = len(parts) * rank
    xa = lora_shrink(torch.randn(tokens, in_features).to(BF16), torch.zeros(slots, width, in_features).to(BF16), tiles)
    lora_expand(xa, torch.zeros(sum(parts), slots * width).to(BF16), torch.zeros(tokens, sum(parts)).to(BF16), tiles)


SCENARIOS = {
    "paged_decode_bf16": lambda: _paged_decode(BF16, 1),
    "paged_decode_bf16_splits": lambda: _paged_decode(BF16, 3),
    "paged_decode_fp8": lambda: _paged_decode(FP8, 1),
    "paged_decode_fp8_splits": lambda: _paged_decode(FP8, 3),
    "store_kvcache_bf16": lambda: _store(BF16),
    "store_kvcache_fp8": lambda: _store(FP8),
    "qk_norm_rope": lambda: _qk_norm_rope(None, True),
    "qk_norm_rope_store_bf16": lambda: _qk_norm_rope(BF16, True),
    "qk_norm_rope_store_fp8": lambda: _qk_norm_rope(FP8, True),
    "rope_only_store_fp8": lambda: _qk_norm_rope(FP8, False),
    "qk_norm_rope_store_fp8_row_scale": lambda: _qk_norm_rope(FP8, True, row_scale=True),  # online FP8's chain
    "rms_norm_silu": _rms_norm_and_silu,
    "fp8_rows": _fp8_rows,
    "fp8_gemm": _fp8_gemm,
    "fused_moe_bf16": lambda: _fused_moe(False),
    "fused_moe_fp8": lambda: _fused_moe(True),
    # Many routed slots: the chunked alignment kernels, and the GEMM tiles of large batches.
    "fused_moe_bf16_prefill": lambda: _fused_moe(False, tokens=2048, experts=128, k=8),
    "fused_moe_fp8_prefill": lambda: _fused_moe(True, tokens=2048, experts=128, k=8),
    # INT4 weights: the GEMVs (decode), split-K tiles with atomic fp32 sums (group 32), 128-row
    # tiles, the dequantizing kernel of prefills.
    "paged_prefill_bf16": lambda: _paged_prefill(BF16),
    "paged_prefill_fp8": lambda: _paged_prefill(FP8),
    "w4a16_decode": lambda: _w4a16(1, 128),
    "w4a16_decode_silu": lambda: _w4a16(1, 128, silu_mul=True),
    "w4a16_decode_norm_folds": lambda: _w4a16(1, 128, folds=True),
    "w4a16_decode_fp16": lambda: _w4a16(1, 128, torch.float16),  # one fp16 row: the FMA GEMV
    "w4a16_split_k_g32": lambda: _w4a16(64, 32),
    "w4a16_large_m": lambda: _w4a16(300, 128),  # 128-row tensor-core tiles
    "w4a16_prefill": lambda: _w4a16(600, 128),
    # The unpacking tensor-core kernel's inline PTX in fp16 (bf16: w4a16_split_k_g32).
    "w4a16_mma_g32_fp16": lambda: _w4a16(8, 32, torch.float16),
    "w4a16_mma_g128": lambda: _w4a16(16, 128),  # the tile in one group: a scale per column
    "w4a16_mma_g128_sm80": lambda: _w4a16(16, 128),  # (its PTX must not need sm_90: see ON_SM80)
    # The batch-1 GEMV of 16-bit and FP8 weights, with each prologue; K not a multiple of the tile.
    "dense_gemv_bf16": lambda: _dense_gemv(BF16, "PLAIN"),
    "dense_gemv_bf16_norm": lambda: _dense_gemv(BF16, "RMS_NORM"),
    "dense_gemv_bf16_silu": lambda: _dense_gemv(BF16, "SILU_MUL", n=6144),
    "dense_gemv_bf16_add_residual": lambda: _dense_gemv(BF16, "ADD_RESIDUAL", k=2048, n=1024),
    "dense_gemv_fp8_norm_parts": lambda: _dense_gemv(FP8, "NORM_PARTS", n=6144),
    "dense_gemv_bf16_norm_parts_silu": lambda: _dense_gemv(BF16, "NORM_PARTS+SILU_MUL", n=6144),
    "dense_gemv_fp8_silu": lambda: _dense_gemv(FP8, "SILU_MUL", n=6144),
    "dense_gemv_fp8_norm_odd_k": lambda: _dense_gemv(FP8, "RMS_NORM", k=1000, n=300),
    "dense_gemv_fp8_block_silu": lambda: _dense_gemv(FP8, "SILU_MUL", n=6144, block=True),
    # INT4 experts: decode's blocks, and larger ones with act-order perms.
    "fused_moe_int4_decode": lambda: _fused_moe_int4(1, False),
    "fused_moe_int4_act_order": lambda: _fused_moe_int4(200, True),
    # LoRA: the shrink (split-K into fp32) and expand (in place) of Qwen3-8B's qkv at rank 16
    # for a decode step, and a rank-64 down projection of a prefill.
    "lora_qkv_decode": lambda: _lora(64, 16, [4096, 1024, 1024]),
    "lora_down_prefill": lambda: _lora(500, 64, [4096], in_features=12288),
    "sampling_bf16": lambda: _sampling(BF16),
    "sampling_fp32": lambda: _sampling(torch.float32),
    # Every launch of filtered_sample_triton: round 0, a chunked round and the last (looping) decide.
    "filtered_sampling_bf16": lambda: _filtered_sampling(BF16),
    "filtered_sampling_fp32_prescaled_top_p": lambda: _filtered_sampling(torch.float32, top_k=False, min_p=False,
                                                                         scale=False, rounds=0),
    "filtered_sampling_min_p_bf16": lambda: _filtered_sampling(BF16, top_k=False, top_p=False),
    "filtered_sampling_greedy_mix_bf16": lambda: _filtered_sampling(BF16, top_k=False, top_p=False, min_p=False),
}


# Scenarios compiled for sm_80 (A100) instead: inline PTX that Hopper alone would take.
ON_SM80 = {"w4a16_mma_g128_sm80"}


def main(names: list[str]) -> None:
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("run without TRITON_INTERPRET: the interpreter's @triton.jit cannot be compiled")
    for name in names or list(SCENARIOS):
        try:
            launches = capture_launches(SCENARIOS[name])
        except Exception as e:  # noqa: BLE001 (reported, the next scenario runs)
            print(json.dumps({"scenario": name, "ok": False, "error": f"calling the wrapper: {type(e).__name__}: {e}"}))
            continue
        if not launches:
            print(json.dumps({"scenario": name, "ok": False, "error": "no kernel was launched"}))
        for kernel, named, options in launches:
            result = {"scenario": name, "kernel": kernel.fn.__name__}
            try:
                capability = 80 if name in ON_SM80 else 90
                result["ok"] = bool(compile_launch(kernel, named, options, capability).asm["cubin"])
            except Exception as e:  # noqa: BLE001
                result.update(ok=False, error=f"{type(e).__name__}: {e}"[:3000])
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
