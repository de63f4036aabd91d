"""Experiment (not the engine's): the W4A16 tensor-core GEMM with x and the words loaded by TMA
(w4a16_tma_probe_kernel.py) against choose's launch, at 16-256 rows on Qwen3-8B's GEMMs, each
checked against the fp32 product. (The pair order it timed as an experiment is branch
int4-loop-trim's.)

    PYTHONPATH=. python3 benchmarks/kernels/w4a16_tma_probe.py 16,64,128,256

Timed once (H100, 2026-12-07, on branch int4-loop-trim): no faster than choose's launches
overall (BENCHMARKS.md, INT4)."""

from __future__ import annotations

import sys

import torch
import triton

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_w4a16 import GEMMS, rotating, weights  # noqa: E402
from timing import cuda_graph_us  # noqa: E402
from w4a16_tma_probe_kernel import mma_tma  # noqa: E402
from nanovllm.features.quantization.int4_formats import dequantize  # noqa: E402
from nanovllm.kernels.w4a16 import Mma, choose, w4a16_matmul  # noqa: E402


def configs(m: int, n: int):
    if m <= 64:
        for bm in ((16, 32) if m <= 32 else (64,)):
            for bn, wp in ((64, 4), (128, 8)):
                for sp in ((1, 4) if n <= 8192 else (1,)):
                    yield Mma(bm, bn, 128, sp, wp, 3)
        return
    for bm in (64, 128):
        for bn, wp in ((64, 4), (128, 8)):
            for sp in ((1, 4) if n <= 8192 else (1,)):
                for st in (3, 4):
                    yield Mma(bm, bn, 64, sp, wp, st)


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m in (int(v) for v in sys.argv[1].split(",")):
        for name, (k, n) in GEMMS.items():
            w, next_w = rotating(lambda: weights(k, n, 128, gen), k * n // 2)
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            ref = x.float() @ dequantize(w)
            base = cuda_graph_us(lambda: (lambda v: w4a16_matmul(x, v.qweight, v.scales, v.zeros, 128))(next_w()), median=True)
            timed = []
            for cfg in configs(m, n):
                try:
                    got = mma_tma(x, w.qweight, w.scales, w.zeros, 128, cfg)
                    ok = ((got.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
                    t = cuda_graph_us(lambda: (lambda q: mma_tma(x, q.qweight, q.scales, q.zeros, 128, cfg))(next_w()),
                                      median=True)
                    timed.append((t, tuple(cfg), ok))
                except Exception as e:  # noqa: BLE001  (a tile too large for shared memory, a compile failure)
                    print("  skip", tuple(cfg), type(e).__name__, str(e)[:80], flush=True)
            best = f"tma {min(timed)[0]:.1f} {min(timed)[1]}{'' if min(timed)[2] else ' WRONG'}" if timed else ""
            print(f"{name:<8}{m:>5} choose {base:7.2f} | {best}", flush=True)


if __name__ == "__main__":
    main()
