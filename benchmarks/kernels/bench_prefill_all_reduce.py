"""Prefill-sized row-parallel GEMM + all-reduce + residual RMSNorm on 2 GPUs: one after the
other (what the engine does), the GEMM cut into row chunks whose all-reduces (NCCL, async)
may overlap the next chunk's GEMM (on NCCL's default or a high-priority stream), and the fused
symmetric-memory kernel instead of NCCL + norm, and the copy-engine variant: each chunk's rows
are copied into the peer's receive buffer by cudaMemcpyAsync on a side stream (a copy engine,
no SMs, so it can run beside cuBLAS), followed by a flag word written with cuStreamWriteValue32;
the norm waits for the peer's last flag and adds the received rows (CopyEngineAllReduce in
nanovllm/parallel/copy_engine.py, what the engine uses for 8k-16k rows at TP=2).

Measured on 2xH200 (BENCHMARKS.md): the chunks do not overlap on the default stream, nor with
torch._C._set_sm_carveout_experimental (which cuBLAS's nvjet kernels ignore); the
high-priority variant has not run yet.

    PYTHONPATH=. python3 benchmarks/kernels/bench_prefill_all_reduce.py

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

from timing import HIDDEN, row_parallel_gemms  # benchmarks/kernels/timing.py (this folder)

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
    from nanovllm.parallel.copy_engine import CopyEngineAllReduce
    from nanovllm.parallel.fused_all_reduce import FusedAllReduceNorm

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
    exchange = CopyEngineAllReduce.create(dist.group.WORLD, device, dtype, HIDDEN, max(ROWS))
    if exchange is None:
        raise SystemExit("the copy-engine all-reduce is unavailable here (its reason is logged)")
    exchange.MIN_ROWS = min(ROWS)  # this sweep also times it below the engine's threshold

    def copy_engine(x, w, n, residual):
        exchange.CHUNK_ROWS = x.shape[0] // n
        return exchange.finish(exchange.linear(x, lambda a, out: torch.mm(a, w.t(), out=out)), residual, norm_w, 1e-6)

    probe = torch.randn(max(ROWS), HIDDEN, dtype=dtype, device=device)
    copy_ms = _ms(lambda: exchange.peer_recv[0].copy_(probe, non_blocking=True))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        exchange.peer_recv[0].copy_(probe, non_blocking=True)
        torch.cuda.synchronize()
    copy_kinds = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
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
            for n in (1, 2, 4, 8):
                t[f"ce{n}"] = _ms(lambda: copy_engine(x, w, n, residual))
            want = serial()
            got = copy_engine(x, w, 4, residual)
            t["ce err"] = ((got[0].float() - want[0].float()).abs().max() / want[0].float().abs().max()).item()
            if fused is not None:
                t["fused"] = _ms(lambda: fused(F.linear(x, w), residual, norm_w, 1e-6))
            lines.append(f"{name:>6}{rows:>7}" + "".join(f"{v:>9.3f}" for v in t.values()))
    if rank == 0:
        print("row-parallel GEMM + all-reduce + RMSNorm, ms per call, bf16,", world, "GPUs")
        print(f"{'gemm':>6}{'rows':>7}" + "".join(f"{c:>9}" for c in t))
        print("cN: N row chunks, each chunk's NCCL all-reduce async behind the next chunk's GEMM; "
              "-hp: NCCL on a high-priority stream")
        print("ceN: N row chunks, each copied to the peer by copy engine behind the next chunk's GEMM; "
              "ce err: max |ce4 - serial| / max |serial| of the normed rows")
        print(f"copy of {max(ROWS)} rows to the peer alone: {copy_ms:.3f} ms "
              f"({max(ROWS) * HIDDEN * 2 / copy_ms / 1e6:.0f} GB/s); device activity: {copy_kinds}")
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
