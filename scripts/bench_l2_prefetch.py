"""Does warming L2 with the next GEMM's weight, from a kernel that leaves HBM idle, make that
GEMM faster? One GPU, Qwen3-8B's decode GEMMs at TP=2 and TP=1.

    PYTHONPATH=.:scripts python3 scripts/bench_l2_prefetch.py

Each timed iteration, in a CUDA graph: read a 256 MiB buffer (evicts L2), run a kernel of 128
programs that warms the first X MiB of the weight one way or another and then spins for 10 us
(stands in for the all-reduce + RMSNorm), then F.linear(x, W). The GEMM's time after the warm
kernel is t(flush, kernel, GEMM) - t(flush, kernel); "cold" is the GEMM after no warming.
Methods: load (plain loads, summed into a store nobody reads), bulk (cp.async.bulk.prefetch.L2
per 16 KiB, prefetch_l2 below), bulk_last (the same with an evict_last cache policy),
line (prefetch.global.L2::evict_last per 128 B line).

Outcome on an H200 (2026-11-30, BENCHMARKS.md): no method pays. Even a weight fully read into
L2 just before (load) saves only ~1-1.5 us of a 10-16 us GEMM at M = 1, nothing at M = 256:
cuBLAS's skinny GEMMs are bound by their own ramp, not by HBM, so the idle HBM during the
all-reduce is not worth filling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from timing import cuda_graph_us, qwen3_8b_gemms

# Bytes per bulk prefetch instruction. Large enough that a 32 MiB window is ~16 instructions
# per program, small enough that 128 programs split it evenly.
PREFETCH_CHUNK = 16384


@triton.jit
def prefetch_l2(base, nbytes, pid, num_programs, CHUNK: tl.constexpr, LANES: tl.constexpr,
                EVICT_LAST: tl.constexpr = False):
    """Program `pid` of `num_programs` asks L2 to fetch its share of bytes [0, nbytes) at the
    int64 address `base` (16-byte aligned; nbytes a multiple of 16), CHUNK bytes per
    instruction, LANES instructions at a time (one per thread: LANES = 32 * num_warps), with
    an evict_last cache policy if EVICT_LAST. A hint only: returns at once and never faults on
    the data's values."""
    if EVICT_LAST:
        asm: tl.constexpr = ("{ .reg .pred p; .reg .b64 pol; setp.ne.b32 p, $3, 0; "
                             "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
                             "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }")
    else:
        asm: tl.constexpr = ("{ .reg .pred p; setp.ne.b32 p, $3, 0; "
                             "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }")
    n_chunks = tl.cdiv(nbytes, CHUNK)
    lanes = tl.arange(0, LANES)
    # Chunk c goes to program c % num_programs: each SM's bulk-copy unit gets an equal share
    # (one program taking LANES consecutive chunks put up to 2 MiB on a few SMs: ~8 us).
    for first in range(0, n_chunks, num_programs * LANES):
        idx = first + pid + lanes * num_programs
        offset = idx.to(tl.int64) * CHUNK
        size = tl.minimum(nbytes - offset, CHUNK).to(tl.int32)
        live = (idx < n_chunks).to(tl.int32)
        tl.inline_asm_elementwise(asm, "=r,l,r,r", [base + offset, size, live], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _clock():
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["cycles", "base", "nbytes"])
def _warm_kernel(out_ptr, cycles, w_ptr, base, nbytes, METHOD: tl.constexpr, CHUNK: tl.constexpr, LANES: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lanes = tl.arange(0, LANES)
    if METHOD == 1:  # plain loads, 16 B per thread per step
        acc = tl.zeros([LANES * 8], dtype=tl.float32)
        offs = tl.arange(0, LANES * 8)
        n = nbytes // 2
        for start in range(pid * LANES * 8, n, nprog * LANES * 8):
            acc += tl.load(w_ptr + start + offs, mask=start + offs < n, other=0.0).to(tl.float32)
        s = tl.sum(acc, axis=0)
        if s == 12345.678:
            tl.store(out_ptr + pid, 1)
    elif METHOD == 2:
        prefetch_l2(base, nbytes, pid, nprog, CHUNK, LANES)
    elif METHOD == 3:
        prefetch_l2(base, nbytes, pid, nprog, CHUNK, LANES, EVICT_LAST=True)
    elif METHOD == 4:
        n_lines = nbytes // 128
        for first in range(0, n_lines, nprog * LANES):
            idx = first + pid + lanes * nprog
            live = (idx < n_lines).to(tl.int32)
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
                "=r,l,r", [base + idx.to(tl.int64) * 128, live], dtype=tl.int32, is_pure=False, pack=1)
    start = _clock()
    while _clock() - start < cycles:
        pass


METHODS = {"load": 1, "bulk": 2, "bulk_last": 3, "line": 4}


def main() -> None:
    torch.manual_seed(0)
    flush = torch.randn(128 << 20, device="cuda", dtype=torch.bfloat16)  # 256 MiB
    out = torch.zeros(128, dtype=torch.int32, device="cuda")
    cycles = int(10 * 1.98e3)
    print(f"{'tp':>3}{'gemm':>8}{'MiB':>6}{'M':>5}{'warm MiB':>9}{'cold':>7}" + "".join(f"{m:>10}" for m in METHODS)
          + "   (us: GEMM after the warm kernel)")
    for tp in (2, 1):
        for name, k, n in qwen3_8b_gemms(tp):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            wbytes = w.numel() * 2
            for m in (1, 256):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                for mb in (16, 32):
                    nb = min(wbytes, mb << 20)

                    def it(method, gemm):
                        flush.amax()
                        _warm_kernel[(128,)](out, cycles, w, w.data_ptr(), nb, METHOD=method, CHUNK=PREFETCH_CHUNK, LANES=128,
                                             num_warps=4)
                        if gemm:
                            F.linear(x, w)

                    t = {}
                    for label, method in [("cold", 0)] + list(METHODS.items()):
                        t[label] = cuda_graph_us(lambda: it(method, True)) - cuda_graph_us(lambda: it(method, False))
                    print(f"{tp:>3}{name:>8}{wbytes / 2**20:>6.0f}{m:>5}{nb / 2**20:>9.0f}{t['cold']:>7.1f}"
                          + "".join(f"{t[k_]:>10.1f}" for k_ in METHODS), flush=True)
                    if nb == wbytes:
                        break


if __name__ == "__main__":
    main()
