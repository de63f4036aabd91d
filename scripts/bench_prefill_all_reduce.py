"""Prefill-sized row-parallel GEMM + all-reduce + residual RMSNorm on 2 GPUs: one after the
other (what the engine does), the GEMM cut into row chunks whose all-reduces (NCCL, async)
may overlap the next chunk's GEMM (on NCCL's default or a high-priority stream), and the fused
symmetric-memory kernel instead of NCCL + norm.

Measured on 2xH200 (BENCHMARKS.md): the chunks do not overlap on the default stream, nor with
torch._C._set_sm_carveout_experimental (which cuBLAS's nvjet kernels ignore); the
high-priority variant has not run yet.

    PYTHONPATH=.:scripts python3 scripts/bench_prefill_all_reduce.py

Qwen3-8B at TP=2: o_proj (K=2048) and down_proj (K=6144) into hidden 4096, bf16; eager (prefill
does not run from CUDA graphs); milliseconds per call on rank 0, CUDA events over 10 calls.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from timing import HIDDEN, row_parallel_gemms  # scripts/timing.py

ROWS = (4096, 8192, 16384)


def _ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _worker(rank: int, world: int, init_file: str) -> None:
    from nanovllm.kernels.fused_ops import rms_norm
    from nanovllm.utils.dist import FusedAllReduceNorm

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    device, dtype = torch.device("cuda", rank), torch.bfloat16
    fused = FusedAllReduceNorm.create(dist.group.WORLD, device, dtype, HIDDEN, max_bytes=max(ROWS) * HIDDEN * 2)
    norm_w = torch.ones(HIDDEN, dtype=dtype, device=device)
    # NCCL on a high-priority stream: its blocks are dispatched ahead of the GEMM's as SMs free up.
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    high_priority = dist.new_group(list(range(world)), backend="nccl", pg_options=options)
    lines = []
    for name, k in row_parallel_gemms(2):
        w = torch.randn(HIDDEN, k, dtype=dtype, device=device) / k ** 0.5
        for rows in ROWS:
            x = torch.randn(rows, k, dtype=dtype, device=device)
            residual = torch.randn(rows, HIDDEN, dtype=dtype, device=device)

            def serial():
                y = F.linear(x, w)
                dist.all_reduce(y)
                return rms_norm(y, norm_w, 1e-6, residual)

            def chunked(n, group=None):
                y = torch.empty(rows, HIDDEN, dtype=dtype, device=device)
                works = []
                for xc, yc in zip(x.chunk(n), y.chunk(n)):
                    torch.matmul(xc, w.t(), out=yc)
                    works.append(dist.all_reduce(yc, group=group, async_op=True))
                for work in works:
                    work.wait()
                return rms_norm(y, norm_w, 1e-6, residual)

            t = {"gemm": _ms(lambda: F.linear(x, w)), "serial": _ms(serial)}
            for n in (2, 4):
                t[f"c{n}"] = _ms(lambda: chunked(n))
            for n in (2, 4):
                t[f"c{n}-hp"] = _ms(lambda: chunked(n, high_priority))
            if fused is not None:
                t["fused"] = _ms(lambda: fused(F.linear(x, w), residual, norm_w, 1e-6))
            lines.append(f"{name:>6}{rows:>7}" + "".join(f"{v:>9.3f}" for v in t.values()))
    if rank == 0:
        print("row-parallel GEMM + all-reduce + RMSNorm, ms per call, bf16,", world, "GPUs")
        print(f"{'gemm':>6}{'rows':>7}" + "".join(f"{c:>9}" for c in t))
        print("cN: N row chunks, each chunk's NCCL all-reduce async behind the next chunk's GEMM; "
              "-hp: NCCL on a high-priority stream")
        print("\n".join(lines))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    world = min(2, torch.cuda.device_count())  # the shapes are TP=2's
    if world < 2:
        raise SystemExit("needs at least 2 GPUs")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init")), nprocs=world)


if __name__ == "__main__":
    main()
