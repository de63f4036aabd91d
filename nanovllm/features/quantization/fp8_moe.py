"""FP8 (e4m3) MoE experts: Qwen's block format for the stacked expert weights, the arithmetic of
the fused-MoE kernel's FP8 variant in plain torch, and the methods that give `MoeExperts` its
FP8 parameters (an `ExpertsMethod` of features/moe.py).

Format (Qwen/Qwen3-30B-A3B-FP8): each expert's gate_proj / up_proj [I, H] and down_proj [H, I]
is float8_e4m3fn with a `weight_scale_inv` of one scale per 128x128 block, weight = q * scale.
Stacked as the kernel takes them: w13 [E, 2n, H] with w13_scale_inv [E, 2n/128, ceil(H/128)]
and w2 [E, H, n] with w2_scale_inv [E, ceil(H/128), n/128], n = I / tp this rank's share of the
intermediate size. n must be whole 128-blocks: a block of w13 must not straddle gate and up
rows, nor a TP boundary (Fp8Config.check_model refuses other sizes before any weight loads).

Arithmetic (nanovllm/kernels/fused_moe.py on CUDA; `moe_fp8_torch` here, the CPU path and the
kernel's reference): per token, the activations are quantized per row in groups of 128 with the
kernel's convention (scale = max(amax, 1e-10) / 448, q = fp8(clamp(x / scale, -448, 448)), an
IEEE division per element: not the x * (1 / scale) of fp8_ops.py's quantizers); gate and up
accumulate in fp32, silu(gate) * up is rounded to the activation dtype, quantized the same way,
and the down projection's fp32 result times the router weight is rounded to the dtype per
(token, choice) slot; a token's k slots are then summed (fp32, one rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.fp8_format import BLOCK, FP8_DTYPE, FP8_MAX, FP8_MIN_AMAX
from nanovllm.features.quantization.fp8_ops import (dequantize_per_token_group, dequantize_weight_block_fp8,
                                                  quantize_weight_block_fp8)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------- arithmetic


def quantize_moe_activations_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused-MoE kernel's activation quantizer (`quantize_fp8_activations`) in torch, bit
    for bit: x [M, K] fp16/bf16/fp32 -> q [M, K] float8_e4m3fn and scales fp32 [M, ceil(K/128)],
    scale = max(group amax, 1e-10) / 448 and q = fp8(clamp(x / scale, -448, 448)), in fp32."""
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be a [rows, K] float16/bfloat16/float32 tensor, got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    groups = -(-k // BLOCK)
    xp = F.pad(x.float(), (0, groups * BLOCK - k)).view(m, groups, BLOCK)
    amax = xp.abs().amax(dim=2).clamp_min(FP8_MIN_AMAX)
    # Tensor / tensor: CUDA torch turns a division by a Python scalar into a product with its
    # reciprocal, which is not the kernel's correctly rounded division.
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (xp / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, groups * BLOCK)[:, :k].contiguous(), scale


def _check_fp8_experts(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids) -> None:
    if hidden.dim() != 2 or hidden.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"hidden must be a [T, H] float16/bfloat16/float32 tensor, got {hidden.dtype} "
                         f"{tuple(hidden.shape)}")
    if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise ValueError(f"FP8 experts need float8_e4m3fn w13 and w2, got {w13.dtype} and {w2.dtype}")
    (t, h), e = hidden.shape, w13.shape[0]
    if w13.dim() != 3 or w13.shape[1] % (2 * BLOCK) or w13.shape[2] != h:
        raise ValueError(f"w13 must be [E, 2n, {h}] with n a multiple of {BLOCK}, got {tuple(w13.shape)}")
    n = w13.shape[1] // 2
    if tuple(w2.shape) != (e, h, n):
        raise ValueError(f"w2 must be [{e}, {h}, {n}] (w13 is {tuple(w13.shape)}), got {tuple(w2.shape)}")
    for name, s, rows, cols in (("w13_scale", w13_scale, 2 * n, h), ("w2_scale", w2_scale, h, n)):
        want = (e, -(-rows // BLOCK), -(-cols // BLOCK))
        if s is None or s.dtype != torch.float32 or tuple(s.shape) != want:
            got = None if s is None else f"{s.dtype} {tuple(s.shape)}"
            raise ValueError(f"{name} must be float32 {want} (one scale per 128x128 block), got {got}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} "
                         f"must both be [{t}, k]")
    flat = topk_ids.reshape(-1)
    if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < e:
        raise ValueError(f"topk_ids must be in [0, {e})")


def _slots_by_expert(topk_ids: torch.Tensor):
    """(expert, its slots s = t * k + j) for every expert that got a slot, in increasing id."""
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    start = 0
    for e, count in enumerate(torch.bincount(flat).tolist()):
        if count:
            yield e, order[start:start + count]
            start += count


def moe_fp8_gate_up_torch(hidden: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                          topk_ids: torch.Tensor) -> torch.Tensor:
    """intermediate[s] = silu(g) * u for every slot s = t * k + j (the kernel's `moe_gate_up`):
    g, u = the gate and up rows of dequantized w13[e] times token t's quantized activations
    (fp32), e = topk_ids[t, j]; [T * k, n] in hidden's dtype. Shapes: see moe_fp8_torch."""
    n, k = w13.shape[1] // 2, topk_ids.shape[1]
    x = dequantize_per_token_group(*quantize_moe_activations_torch(hidden))  # fp32 [T, H]
    out = torch.empty(topk_ids.numel(), n, dtype=hidden.dtype, device=hidden.device)
    for e, slots in _slots_by_expert(topk_ids):
        gu = x[slots // k] @ dequantize_weight_block_fp8(w13[e], w13_scale[e]).t()
        gate, up = gu[:, :n], gu[:, n:]
        out[slots] = (gate * torch.sigmoid(gate) * up).to(hidden.dtype)  # the kernel's epilogue, in fp32
    return out


def moe_fp8_down_torch(intermediate: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """slot_out[s] = topk_weights.flatten()[s] * (quantized intermediate[s] @ dequantized
    w2[e]^T) for every slot (the kernel's `moe_down`): fp32, rounded once to intermediate's dtype
    [T * k, H]."""
    h = dequantize_per_token_group(*quantize_moe_activations_torch(intermediate))  # fp32 [T*k, n]
    weights = topk_weights.reshape(-1).float()
    out = torch.empty(intermediate.shape[0], w2.shape[1], dtype=intermediate.dtype, device=intermediate.device)
    for e, slots in _slots_by_expert(topk_ids):
        y = h[slots] @ dequantize_weight_block_fp8(w2[e], w2_scale[e]).t()
        out[slots] = (y * weights[slots, None]).to(intermediate.dtype)
    return out


def moe_fp8_torch(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor) -> torch.Tensor:
    """The block-FP8 experts' weighted sum [T, H] in hidden's dtype, the arithmetic of
    `fused_moe(..., w13_scale=, w2_scale=)` in plain torch (module docstring).

    hidden [T, H] fp16/bf16/fp32; w13 [E, 2n, H] and w2 [E, H, n] float8_e4m3fn, n a multiple
    of 128; w13_scale [E, 2n/128, ceil(H/128)] and w2_scale [E, ceil(H/128), n/128] fp32;
    topk_weights [T, k] float, topk_ids [T, k] ints in [0, E). Runs only the experts that got
    slots (the routing is read on the host: a sync, so not for CUDA graphs).
    """
    _check_fp8_experts(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids)
    t, k = topk_ids.shape
    intermediate = moe_fp8_gate_up_torch(hidden, w13, w13_scale, topk_ids)
    slot_out = moe_fp8_down_torch(intermediate, w2, w2_scale, topk_weights, topk_ids)
    return slot_out if k == 1 else slot_out.view(t, k, -1).sum(dim=1)


# ----------------------------------------------------------------------------- MoeExperts methods


def _check_shard(experts, name: str) -> None:
    n = experts.w13.shape[1] // 2
    if n % BLOCK:
        where = f"each rank holds {n} of its rows (tensor_parallel_size={experts.tp_size})" if experts.tp_size > 1 \
            else f"its {n} gate rows are packed with its up rows"
        raise ValueError(f"{name}: FP8 experts are stored in {BLOCK}x{BLOCK} blocks, but moe_intermediate_size = "
                         f"{experts.intermediate_size}: {where}, which cuts a {BLOCK}-row block")


def _replace(experts, name: str, tensor: torch.Tensor, block: bool = False) -> None:
    param = nn.Parameter(tensor, requires_grad=False)
    param.weight_loader = experts.weight_loader
    if block:
        param.block = BLOCK  # loaders count this parameter's rows and columns in blocks
    setattr(experts, name, param)


def fp8_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor) -> torch.Tensor:
    """The block-FP8 experts' weighted sum: the fused-MoE kernel's FP8 variant on CUDA, else
    its arithmetic in torch (moe_fp8_torch)."""
    if hidden.is_cuda:
        from nanovllm.kernels.fused_moe import fused_moe  # (Triton: CUDA only)

        return fused_moe(hidden, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale, w2_scale=w2_scale)
    return moe_fp8_torch(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)


class _Fp8Experts:
    """What both FP8 experts methods share: the weighted sum of the stored experts."""

    def apply(self, experts, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fp8_experts(hidden, experts.w13, experts.w2, topk_weights, topk_ids, experts.w13_scale_inv,
                           experts.w2_scale_inv)


class CheckpointFp8Experts(_Fp8Experts):
    """Experts whose weights come in Qwen's block-FP8 format (checkpoint or dummy weights)."""

    def create(self, experts, name: str) -> None:
        """Empty FP8 weights and fp32 block scales in place of the 16-bit stacks, loaded by the
        experts' own (TP-sharding) loader, before the checkpoint loads."""
        _check_shard(experts, name)
        e, two_n, h = experts.w13.shape
        device = experts.w13.device
        hb = -(-h // BLOCK)
        _replace(experts, "w13", torch.empty(e, two_n, h, dtype=FP8_DTYPE, device=device))
        _replace(experts, "w2", torch.empty(e, h, two_n // 2, dtype=FP8_DTYPE, device=device))
        _replace(experts, "w13_scale_inv", torch.empty(e, two_n // BLOCK, hb, device=device, dtype=torch.float32), True)
        _replace(experts, "w2_scale_inv", torch.empty(e, hb, two_n // 2 // BLOCK, device=device, dtype=torch.float32),
                 True)

    def init_dummy(self, experts, gen: torch.Generator) -> None:
        """Random experts of the checkpoint format (benchmarks without the checkpoint): N(0, 0.02)
        as init_dummy draws 16-bit weights, quantized in 128x128 blocks, one stack at a time."""
        for weight, scale in (("w13", "w13_scale_inv"), ("w2", "w2_scale_inv")):
            param = getattr(experts, weight)
            w = torch.empty(param.shape, dtype=torch.float32, device=param.device).normal_(0.0, 0.02, generator=gen)
            w_q, s = quantize_weight_block_fp8(w)
            del w
            param.data.copy_(w_q)
            getattr(experts, scale).data.copy_(s)

    def after_loading(self, experts) -> None:
        pass


class OnlineFp8Experts(_Fp8Experts):
    """16-bit experts (checkpoint or dummy) quantized in 128x128 blocks once they have loaded:
    `LLM(quantization="fp8")`. Blocks, not one scale per tensor as for the dense linears: the
    fused-MoE kernel's FP8 format, and an expert's outliers stay inside their blocks."""

    def create(self, experts, name: str) -> None:
        _check_shard(experts, name)  # the 16-bit weights load as usual

    def init_dummy(self, experts, gen: torch.Generator) -> None:
        pass  # init_dummy draws the 16-bit weights

    def after_loading(self, experts) -> None:
        for weight, scale in (("w13", "w13_scale_inv"), ("w2", "w2_scale_inv")):
            w_q, s = quantize_weight_block_fp8(getattr(experts, weight).data)
            _replace(experts, weight, w_q)
            _replace(experts, scale, s, True)
