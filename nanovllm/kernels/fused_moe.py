"""Fused mixture-of-experts for Qwen3-MoE: routing, token/expert alignment and two grouped GEMMs.

What a Qwen3-MoE block computes (transformers' `Qwen3MoeSparseMoeBlock`): per token t,
router probabilities softmax(logits[t]) in fp32, the top k of them (renormalised to sum 1 when
`norm_topk_prob`), and

    out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = id[t, j].

Each (token, choice) pair is a *slot* s = t * k + j. The pipeline:

1. `route_topk`: router logits -> (weights fp32 [T, k], expert ids int32 [T, k]).
2. `align_tokens_to_experts` (moe_align.py): a list of the T*k slots grouped by expert, every group padded to a
   multiple of BLOCK_M, and the expert of each BLOCK_M-block -- so each program of the GEMMs
   below works on rows of one expert only. Built on the device, with sizes fixed by (T, k, E),
   so it can be captured in a CUDA graph.
3. `moe_gate_up`: per block of slots, x[slot // k] @ w13[e]^T for the gate and the up rows at
   once, silu(gate) * up in the epilogue -> intermediate [T*k, I].
4. `moe_down`: intermediate[slot] @ w2[e]^T times the slot's router weight -> [T*k, H]; the k
   rows of each token are then summed by torch (a fixed order: deterministic, no atomics).

Both GEMMs are one Triton kernel (`_moe_gemm_kernel`) with constexpr switches. Weights are
stacked per layer: w13 [E, 2I, H] (rows 0..I-1 gate_proj, I..2I-1 up_proj) and w2 [E, H, I]. A
tensor-parallel rank passes its slice of I; the caller all-reduces the partial outputs.

Block FP8 (Qwen3-*-FP8 checkpoints): w13 / w2 in float8_e4m3fn with one fp32 scale per 128x128
block of each expert matrix; activations are quantized at run time per row in groups of 128
along K (`quantize_fp8_activations`, moe_fp8_activations.py), and the kernel multiplies every 128-wide K-step's partial
dot by a_scale[row, k-block] * w_scale[column block, k-block]. Scales multiply (weight =
q * scale): they are the checkpoints' `weight_scale_inv` tensors, stacked like the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# QUANT_BLOCK: weight scales per 128x128 block, activation scales per 128 columns; shared with
# the plain-torch twin of the FP8 path (features/quantization/fp8_moe.py).
from nanovllm.kernels.fp8_format import BLOCK as QUANT_BLOCK
from nanovllm.kernels.fp8_format import FP8_DTYPE
from nanovllm.kernels.moe_align import align_tokens_to_experts
from nanovllm.kernels.moe_fp8_activations import quantize_fp8_activations

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------- tile configs


@dataclass(frozen=True)
class GemmConfig:
    """Tiles of one grouped GEMM: BLOCK_N output columns x BLOCK_K reduction per step."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoEConfig:
    """block_m (the row block both GEMMs and the alignment share) and each GEMM's tiles."""

    block_m: int
    gate_up: GemmConfig
    down: GemmConfig


def get_config(num_tokens: int, top_k: int, num_experts: int, fp8: bool = False) -> MoEConfig:
    """The tile config for a batch, chosen by the mean number of slots per expert (T*k/E).

    A small fixed table instead of autotuning at first call (no compile storm at start-up):
    - <= 4 slots per expert (decode): the GEMMs stream weights, one mostly-padded 16-row block
      per expert. Narrow column tiles give enough programs to keep every SM loading (with k = 8
      of 128 experts and T = 1 there are only 8 expert blocks).
    - more rows per expert: taller row blocks so each expert's weights are read by fewer
      programs, wider tiles once the GEMMs turn compute-bound (thousands of tokens).
    For gate_up, block_n counts intermediate columns: the program holds two accumulators (gate
    and up), so its register tile is twice as wide. FP8 needs block_k = QUANT_BLOCK. Not yet
    tuned on a GPU (all compile for sm_90 without spills); benchmarks/kernels/bench_fused_moe.py
    --sweep times alternatives.
    """
    per_expert = num_tokens * top_k / max(num_experts, 1)
    bk = QUANT_BLOCK if fp8 else 64
    if per_expert <= 4:
        return MoEConfig(16, GemmConfig(32, 128, 4, 4), GemmConfig(64, 128, 4, 4))
    if per_expert <= 32:
        return MoEConfig(32, GemmConfig(64, bk, 4, 4), GemmConfig(64, bk, 4, 4))
    if per_expert <= 128:
        return MoEConfig(64, GemmConfig(64, bk, 4, 4), GemmConfig(128, bk, 4, 4))
    return MoEConfig(128, GemmConfig(64, bk, 8, 3), GemmConfig(128, bk, 8, 3))


# ----------------------------------------------------------------------------- grouped GEMM


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, weight_ptr, sorted_slot_ptr, block_expert_ptr,
    N, K, num_slots,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
    SLOTS_PER_A_ROW: tl.constexpr, GATE_UP: tl.constexpr, FP8: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, QB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One BLOCK_M block of slots (all of one expert e) x BLOCK_N output columns.

    Row r of the block is slot s = sorted_slot[block * BLOCK_M + r] (s >= num_slots: padding,
    masked); its A row is s // SLOTS_PER_A_ROW (the token, for gate_up: k slots share it; the
    slot itself, for down). B is the expert's [N(, +N), K] matrix at b_ptr + e * stride_be.
    out[s, n] = sum_k A[row, k] * B[n, k], fp32 accumulation, stored in c's dtype at
    c_ptr + s * stride_cm + n * stride_cn.
    - GATE_UP: also accumulates the up rows N + n of B and stores silu(gate) * up.
    - not GATE_UP (down): the result is multiplied by weight[s] (the router weight, any float).
    - FP8: A and B hold float8e4nv; each K-step (BLOCK_K == QB) dot is multiplied by
      a_scale[row, kb] * b_scale[e, n // QB, kb] before it is added (fp32).
    - EVEN_K: K % BLOCK_K == 0, no K masks in the loop.
    Grid: (max_blocks * cdiv(N, BLOCK_N),), the column tile varying fastest, so the programs in
    flight together share a block's A rows and sweep its expert's weights once; blocks marked
    -1 (past the last group) return at once.
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slot_ptr + offs_m)
    row_ok = slots < num_slots
    a_rows = (slots // SLOTS_PER_A_ROW).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    up_shift = N * stride_bn
    if FP8:
        a_scale_ptrs = a_scale_ptr + a_rows * stride_asm
        b_scale_row = b_scale_ptr + expert * stride_bse
        b_scale_ptrs = b_scale_row + (offs_n // QB) * stride_bsn
        up_scale_ptrs = b_scale_row + ((N + offs_n) // QB) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a_mask = row_ok[:, None]
            b_mask = col_ok[None, :]
        else:
            k_ok = offs_k < K - kb * BLOCK_K
            a_mask = row_ok[:, None] & k_ok[None, :]
            b_mask = col_ok[None, :] & k_ok[:, None]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        if GATE_UP:
            b_up = tl.load(b_ptrs + up_shift, mask=b_mask, other=0.0)
        if FP8:
            a_s = tl.load(a_scale_ptrs + kb * stride_ask, mask=row_ok, other=0.0)
            b_s = tl.load(b_scale_ptrs + kb * stride_bsk, mask=col_ok, other=0.0)
            acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
            if GATE_UP:
                up_s = tl.load(up_scale_ptrs + kb * stride_bsk, mask=col_ok, other=0.0)
                acc_up += tl.dot(a, b_up) * (a_s[:, None] * up_s[None, :])
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            if GATE_UP:
                acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if GATE_UP:
        out = acc * tl.sigmoid(acc) * acc_up
    else:
        w = tl.load(weight_ptr + slots, mask=row_ok, other=0.0).to(tl.float32)
        out = acc * w[:, None]
    c_ptrs = c_ptr + slots[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _launch_gemm(a, a_scale, b, b_scale, out, weights, sorted_slot_ids, block_expert_ids, n, k_dim, num_slots,
                 slots_per_a_row, gate_up, block_m, cfg: GemmConfig):
    fp8 = b.dtype == FP8_DTYPE
    if fp8 and cfg.block_k != QUANT_BLOCK:
        raise ValueError(f"FP8 needs block_k == {QUANT_BLOCK}, got {cfg.block_k}")
    if block_m < 16 or cfg.block_n < 16 or cfg.block_k < 16:
        raise ValueError(f"tile sizes must be >= 16 (tl.dot), got block_m={block_m} {cfg}")
    if block_expert_ids.numel() * block_m != sorted_slot_ids.numel():
        raise ValueError(f"sorted_slot_ids ({sorted_slot_ids.numel()}) and block_expert_ids "
                         f"({block_expert_ids.numel()}) do not match block_m {block_m}")
    a_scale = a_scale if fp8 else a  # unused pointers without FP8
    b_scale = b_scale if fp8 else b
    grid = (block_expert_ids.numel() * triton.cdiv(n, cfg.block_n),)
    _moe_gemm_kernel[grid](
        a, b, out, a_scale, b_scale, weights, sorted_slot_ids, block_expert_ids,
        n, k_dim, num_slots,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1), b_scale.stride(2),
        SLOTS_PER_A_ROW=slots_per_a_row, GATE_UP=gate_up, FP8=fp8, EVEN_K=k_dim % cfg.block_k == 0,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32", QB=QUANT_BLOCK,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _check_scale(name: str, scale: torch.Tensor | None, weight: torch.Tensor) -> None:
    e, rows, cols = weight.shape
    want = (e, triton.cdiv(rows, QUANT_BLOCK), triton.cdiv(cols, QUANT_BLOCK))
    if scale is None:
        raise ValueError(f"{name} is required with float8_e4m3fn weights")
    if tuple(scale.shape) != want or scale.dtype != torch.float32:
        raise ValueError(f"{name} must be float32 {list(want)}, got {scale.dtype} {list(scale.shape)}")
    if scale.device != weight.device:
        raise ValueError(f"{name} is on {scale.device}, its weight on {weight.device}")


def _check_routing(sorted_slot_ids, block_expert_ids, device):
    for name, t in (("sorted_slot_ids", sorted_slot_ids), ("block_expert_ids", block_expert_ids)):
        if t.dim() != 1 or t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D int32 tensor (align_tokens_to_experts)")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the activations on {device}")


def moe_gate_up(hidden: torch.Tensor, w13: torch.Tensor, sorted_slot_ids: torch.Tensor,
                block_expert_ids: torch.Tensor, top_k: int, config: MoEConfig,
                w13_scale: torch.Tensor | None = None) -> torch.Tensor:
    """intermediate[s] = silu(x[t] @ gate_e^T) * (x[t] @ up_e^T) for every slot s = t*k + j.

    hidden: [T, H] float16/bfloat16/float32. w13: [E, 2I, H], rows 0..I-1 the gate, I..2I-1 the
    up projection: hidden's dtype, or float8_e4m3fn with w13_scale fp32 [E, ceil(2I/128),
    ceil(H/128)] (then hidden is quantized per row in groups of 128 first, and I % 128 == 0).
    sorted_slot_ids / block_expert_ids: align_tokens_to_experts(topk_ids, E, config.block_m).
    Returns [T*k, I] in hidden's dtype (fp32 accumulation, silu * up in fp32, one rounding).
    """
    num_tokens, hidden_size = hidden.shape
    inter = w13.shape[1] // 2
    num_slots = num_tokens * top_k
    _check_routing(sorted_slot_ids, block_expert_ids, hidden.device)
    out = torch.empty((num_slots, inter), dtype=hidden.dtype, device=hidden.device)
    if num_slots == 0:
        return out
    a, a_scale = hidden, None
    if w13.dtype == FP8_DTYPE:
        _check_scale("w13_scale", w13_scale, w13)
        a, a_scale = quantize_fp8_activations(hidden)
    _launch_gemm(a, a_scale, w13, w13_scale, out, out, sorted_slot_ids, block_expert_ids, inter, hidden_size,
                 num_slots, top_k, True, config.block_m, config.gate_up)
    return out


def moe_down(intermediate: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             sorted_slot_ids: torch.Tensor, block_expert_ids: torch.Tensor, config: MoEConfig,
             w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """out[s] = topk_weights.flatten()[s] * (intermediate[s] @ w2_e^T) for every slot s.

    intermediate: [T*k, I] float16/bfloat16/float32 (moe_gate_up's output). w2: [E, H, I] in
    intermediate's dtype, or float8_e4m3fn with w2_scale fp32 [E, ceil(H/128), ceil(I/128)]
    (the intermediate is then quantized per row in groups of 128). topk_weights: [T, k] float
    (read as fp32). Returns [T*k, H] in intermediate's dtype: the product and the weight
    multiply in fp32, one rounding.
    """
    num_slots, inter = intermediate.shape
    hidden_size = w2.shape[1]
    _check_routing(sorted_slot_ids, block_expert_ids, intermediate.device)
    if topk_weights.numel() != num_slots:
        raise ValueError(f"topk_weights has {topk_weights.numel()} elements for {num_slots} slots")
    weights = topk_weights.contiguous()
    out = torch.empty((num_slots, hidden_size), dtype=intermediate.dtype, device=intermediate.device)
    if num_slots == 0:
        return out
    a, a_scale = intermediate, None
    if w2.dtype == FP8_DTYPE:
        _check_scale("w2_scale", w2_scale, w2)
        a, a_scale = quantize_fp8_activations(intermediate)
    _launch_gemm(a, a_scale, w2, w2_scale, out, weights, sorted_slot_ids, block_expert_ids, hidden_size, inter,
                 num_slots, 1, False, config.block_m, config.down)
    return out


def _check_inputs(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale):
    for name, t in (("hidden", hidden), ("w13", w13), ("w2", w2), ("topk_weights", topk_weights),
                    ("topk_ids", topk_ids)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [tokens, hidden], got {list(hidden.shape)}")
    if hidden.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"hidden must be float16, bfloat16 or float32, got {hidden.dtype}")
    num_tokens, hidden_size = hidden.shape
    if w13.dim() != 3 or w13.shape[1] % 2 or w13.shape[2] != hidden_size or w13.shape[1] == 0:
        raise ValueError(f"w13 must be [experts, 2 * intermediate, {hidden_size}], got {list(w13.shape)}")
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (num_experts, hidden_size, inter):
        raise ValueError(f"w2 must be [{num_experts}, {hidden_size}, {inter}] (w13 is {list(w13.shape)}), "
                         f"got {list(w2.shape)}")
    fp8 = w13.dtype == FP8_DTYPE
    if fp8 != (w2.dtype == FP8_DTYPE) or (not fp8 and (w13.dtype != hidden.dtype or w2.dtype != hidden.dtype)):
        raise TypeError(f"w13 and w2 must both be hidden's dtype ({hidden.dtype}) or both float8_e4m3fn, "
                        f"got {w13.dtype} and {w2.dtype}")
    if fp8:
        _check_scale("w13_scale", w13_scale, w13)
        _check_scale("w2_scale", w2_scale, w2)
        if inter % QUANT_BLOCK:
            raise ValueError(f"block-FP8 experts need the intermediate size ({inter}) to be a multiple of "
                             f"{QUANT_BLOCK}: scale blocks must not straddle gate and up rows")
    elif w13_scale is not None or w2_scale is not None:
        raise ValueError("w13_scale / w2_scale are only for float8_e4m3fn weights")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids must be [{num_tokens}, top_k], got {list(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights {list(topk_weights.shape)} must match topk_ids {list(topk_ids.shape)}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be a float tensor, got {topk_weights.dtype}")
    if topk_ids.shape[1] < 1 or topk_ids.shape[1] > num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {topk_ids.shape[1]}")
    devices = {t.device for t in (hidden, w13, w2, topk_weights, topk_ids)}
    if len(devices) != 1:
        raise ValueError(f"hidden, w13, w2, topk_weights, topk_ids must be on one device, got {sorted(map(str, devices))}")
    return num_tokens, hidden_size, num_experts, fp8


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, config: MoEConfig | None = None) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = topk_ids[t, j].

    hidden: [T, H] float16/bfloat16/float32 (any strides). w13: [E, 2I, H] (gate rows then up
    rows per expert), w2: [E, H, I]: both hidden's dtype, or both float8_e4m3fn with fp32
    block scales w13_scale [E, 2I/128, ceil(H/128)] and w2_scale [E, ceil(H/128), I/128]
    (I % 128 == 0). topk_weights: [T, k] float; topk_ids: [T, k] int32/int64 in [0, E) (not
    checked: that needs a host sync). config: tiles, default get_config(T, k, E, fp8).
    Returns a new [T, H] tensor in hidden's dtype; T = 0 gives an empty one. Each slot's output
    is rounded to hidden's dtype before the k of a token are summed (in fp32, rounded once).
    No host syncs and shapes fixed by (T, k, E, H, I): capturable in a CUDA graph.
    """
    num_tokens, hidden_size, num_experts, fp8 = _check_inputs(hidden, w13, w2, topk_weights, topk_ids,
                                                               w13_scale, w2_scale)
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.empty((0, hidden_size), dtype=hidden.dtype, device=hidden.device)
    cfg = config or get_config(num_tokens, top_k, num_experts, fp8)
    sorted_slot_ids, block_expert_ids, _ = align_tokens_to_experts(topk_ids, num_experts, cfg.block_m)
    intermediate = moe_gate_up(hidden, w13, sorted_slot_ids, block_expert_ids, top_k, cfg, w13_scale)
    slot_out = moe_down(intermediate, w2, topk_weights, sorted_slot_ids, block_expert_ids, cfg, w2_scale)
    if top_k == 1:
        return slot_out
    return slot_out.view(num_tokens, top_k, hidden_size).sum(dim=1)
