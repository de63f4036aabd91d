"""The sampler's fused Triton kernel: temperature, threshold mask, Gumbel noise and argmax in one
pass over the logits (core/random_draw.py has the torch version of the same arithmetic)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _lowbias32(h):
    # uint32: shifts are logical and products wrap, exactly like _mix32_.
    h ^= h >> 16
    h *= 0x7FEB352D
    h ^= h >> 15
    h *= 0x846CA68B
    h ^= h >> 16
    return h


@triton.jit
def _row_key(seed_ptr, offset_ptr, row):
    """The row's 32-bit noise key from its int64 seed and offset, as _row_keys computes it."""
    seed = tl.load(seed_ptr + row)
    offset = tl.load(offset_ptr + row)
    key = _lowbias32(0x9E3779B9 ^ (seed & 0xFFFFFFFF).to(tl.uint32))
    key = _lowbias32(key ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    key = _lowbias32(key ^ (offset & 0xFFFFFFFF).to(tl.uint32))
    return _lowbias32(key ^ ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def _log_exp_noise(ids, key):
    """log(-log u) with u = hash_uniform of token ids under the row key: x minus this is
    x plus Gumbel noise (every kernel that samples uses this, so their noise is bitwise one)."""
    h = _lowbias32(_lowbias32(ids.to(tl.uint32)) ^ key)
    u = (h >> 9).to(tl.float32) * 1.1920928955078125e-07 + 5.960464477539063e-08
    return tl.log(-tl.log(u))


@triton.jit
def _gumbel_argmax_kernel(x_ptr, x_stride, thr_ptr, temp_ptr, seed_ptr, offset_ptr, val_ptr,
                          idx_ptr, vocab, n_chunks, first_id,
                          CHUNK: tl.constexpr, BLOCK: tl.constexpr, HAS_THR: tl.constexpr,
                          SCALE: tl.constexpr):
    """Best (score, index) of one CHUNK of one row, score = x - log(-log u), u = hash_uniform.

    Grid (B, n_chunks). x (any float dtype) is upcast to fp32, then with SCALE divided by
    the row's temperature. Tokens whose (scaled) x is below the row's threshold score -inf.
    Column j of x is token first_id + j (a vocabulary shard), for the noise and the index.
    Within a chunk the lowest index wins ties, matching torch.argmax once chunks are
    reduced in order.
    """
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    # Recomputed per program, which beats ~50 tiny launches.
    key = _row_key(seed_ptr, offset_ptr, row)
    x_row = x_ptr + row.to(tl.int64) * x_stride
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32) + chunk * CHUNK + first_id
    if HAS_THR:
        thr = tl.load(thr_ptr + row)
    if SCALE:
        temp = tl.load(temp_ptr + row)
    for start in range(0, CHUNK, BLOCK):
        cols = chunk * CHUNK + start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        if SCALE:
            # Correctly rounded, like torch.div: Triton lowers a plain fp32 `/` to the
            # approximate div.full.f32 on NVIDIA GPUs, which would flip some tokens.
            x = tl.div_rn(x, temp)
        ids = cols + first_id
        s = x - _log_exp_noise(ids, key)
        if HAS_THR:
            s = tl.where(x < thr, float("-inf"), s)
        better = s > best
        best = tl.where(better, s, best)
        best_i = tl.where(better, ids, best_i)
    top = tl.max(best, axis=0)
    top_i = tl.min(tl.where(best == top, best_i, 2147483647), axis=0)
    tl.store(val_ptr + row * n_chunks + chunk, top)
    tl.store(idx_ptr + row * n_chunks + chunk, top_i)


def gumbel_partials_triton(x: torch.Tensor, thr: torch.Tensor | None, seeds: torch.Tensor,
                           offsets: torch.Tensor, temperatures: torch.Tensor | None = None,
                           chunk: int = 8192, block: int = 1024, first_id: int = 0):
    """Best (score fp32, token id int32) of every `chunk` columns of each row: [B, V / chunk] each.

    x: fp32, bf16 or fp16 [B, V] with unit stride along V, upcast to fp32 in the kernel; its
    column j is token first_id + j. temperatures: fp32 [B], all > 0, or None when x is already
    scaled; the division is correctly rounded, so the scores are bitwise those of
    torch.div(x, temperatures[:, None]). thr: fp32 [B] or None, compared with the scaled x.
    seeds, offsets: int64 [B]. chunk, block: powers of two, block <= chunk.
    """
    b, vocab = x.shape
    n_chunks = triton.cdiv(vocab, chunk)
    vals = torch.empty(b, n_chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(b, n_chunks, dtype=torch.int32, device=x.device)
    # Unused pointer arguments get x: the kernel never reads them.
    _gumbel_argmax_kernel[(b, n_chunks)](
        x, x.stride(0), x if thr is None else thr, x if temperatures is None else temperatures,
        seeds, offsets, vals, idx, vocab, n_chunks, first_id,
        CHUNK=chunk, BLOCK=block, HAS_THR=thr is not None, SCALE=temperatures is not None)
    return vals, idx


def gumbel_argmax_triton(x: torch.Tensor, thr: torch.Tensor | None, seeds: torch.Tensor,
                         offsets: torch.Tensor, temperatures: torch.Tensor | None = None,
                         chunk: int = 8192, block: int = 1024):
    """Fused equivalent of dividing x by temperatures, masking x < thr, adding Gumbel noise
    and argmax: token ids int64 [B] (arguments as for gumbel_partials_triton).

    Reads x once and writes only [B, V / chunk] partials, instead of a dozen [B, V] passes.
    """
    vals, idx = gumbel_partials_triton(x, thr, seeds, offsets, temperatures, chunk, block)
    return idx.gather(1, vals.argmax(dim=-1, keepdim=True)).squeeze(1).long()
