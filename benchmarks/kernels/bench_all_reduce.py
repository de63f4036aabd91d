"""Microbenchmark of the fused all-reduce + residual + RMSNorm kernel against NCCL + RMSNorm,
on every GPU of the machine (one process per GPU), per row count.

    PYTHONPATH=. python3 benchmarks/kernels/bench_all_reduce.py [--hidden 4096] [--rows 1 64 128 256 512]

Each measurement replays a CUDA graph of 36 calls (what a decode step of a 36-layer model
does between two GEMMs, without the GEMMs) and reports microseconds per call on rank 0.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from timing import cuda_graph_us  # benchmarks/kernels/timing.py (this folder)



def _worker(rank: int, world: int, init_file: str, args) -> None:
    from nanovllm.kernels.fused_ops import rms_norm
    from nanovllm.parallel.fused_all_reduce import FusedAllReduceNorm

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    device, dtype = torch.device("cuda", rank), torch.bfloat16
    fused = FusedAllReduceNorm.create(dist.group.WORLD, device, dtype, args.hidden)
    if fused is None:
        raise SystemExit("the fused all-reduce is not available on this machine")
    weight = torch.ones(args.hidden, dtype=dtype, device=device)
    lines = []
    for rows in args.rows:
        x = torch.randn(rows, args.hidden, dtype=dtype, device=device)
        residual = torch.randn_like(x)
        fused_us = cuda_graph_us(lambda: fused(x, residual, weight, 1e-6), 36, 30, dist.barrier)

        def nccl():
            s = x.clone()
            dist.all_reduce(s)
            return rms_norm(s, weight, 1e-6, residual)

        nccl_us = cuda_graph_us(nccl, 36, 30, dist.barrier)
        lines.append(f"{rows:>6}{fused_us:>9.2f}{nccl_us:>9.2f}")
    if rank == 0:
        print(f"fused all-reduce + RMSNorm, hidden {args.hidden}, bf16, {world} GPUs, {fused.phase.numel()} programs; us per call")
        print(f"{'rows':>6}{'fused':>9}{'nccl':>9}")
        print("\n".join(lines))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128, 192, 256, 384, 512])
    args = ap.parse_args()
    world = torch.cuda.device_count()
    if world < 2:
        raise SystemExit("needs at least 2 GPUs")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), args), nprocs=world)


if __name__ == "__main__":
    main()
