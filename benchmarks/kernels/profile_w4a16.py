"""One W4A16 GEMM (or its bf16 F.linear) launched a few times, for Nsight Compute to profile the
last launch (the first ones compile and warm the caches):

    ncu --clock-control none -k regex:mma_kernel --launch-skip 4 --launch-count 1 \
        python3 benchmarks/kernels/profile_w4a16.py --gemm gate_up --m 256 [--cfg 128,128,64,1,8,4] [--bf16]

--cfg: an Mma launch (block_m, block_n, block_k, splits, warps, stages) instead of choose's.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_w4a16 import GEMMS, weights  # noqa: E402  (this folder)
from nanovllm.features.quantization.int4_formats import dequantize  # noqa: E402
from nanovllm.kernels.w4a16 import Mma, w4a16_matmul  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gemm", default="gate_up", choices=sorted(GEMMS))
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--cfg", default=None)
    ap.add_argument("--bf16", action="store_true")
    args = ap.parse_args()
    k, n = GEMMS[args.gemm]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = weights(k, n, 128, gen)
    x = torch.randn(args.m, k, generator=gen, device="cuda").to(torch.bfloat16)
    cfg = Mma(*(int(v) for v in args.cfg.split(","))) if args.cfg else None
    dense = dequantize(w).to(torch.bfloat16).t().contiguous() if args.bf16 else None
    for _ in range(6):
        out = F.linear(x, dense) if args.bf16 else w4a16_matmul(x, w.qweight, w.scales, w.zeros, 128, config=cfg)
    torch.cuda.synchronize()
    print(args.gemm, args.m, cfg, tuple(out.shape))


if __name__ == "__main__":
    main()
