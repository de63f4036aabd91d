"""The Triton paged-decode kernel on rows in random order against rows sorted longest context
first (the scheduler's decode order), at choose_num_splits' split count.

    PYTHONPATH=. python3 benchmarks/kernels/bench_decode_order.py

Batch sizes 32-256, 4 and 8 kv heads (Qwen3-8B at TP=2 and TP=1), three context-length
ranges; block size 256, head_dim 128, 4 query heads per kv head, bf16. Microseconds per call
from CUDA graphs; the last line sums every shape.
"""

from __future__ import annotations

import torch

from nanovllm.kernels.paged_decode import choose_num_splits, paged_decode_attention
from timing import cuda_graph_us, random_paged_batch  # benchmarks/kernels/timing.py (this folder)

BLOCK, HEAD_DIM, GROUP, WIDTH = 256, 128, 4, 16


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = HEAD_DIM ** -0.5
    print(f"{'B':>4}{'kvh':>4}{'ctx':>11}{'splits':>7}{'random':>9}{'sorted':>9}")
    total = [0.0, 0.0]
    for kvh in (4, 8):
        for lo, hi in ((100, 1100), (500, 2000), (200, 4000)):
            for batch in (256, 192, 128, 64, 32):
                q, k, v, tables, ctx = random_paged_batch(batch, kvh, WIDTH, (lo, hi), gen, BLOCK, HEAD_DIM, GROUP)
                order = torch.argsort(ctx, descending=True, stable=True)
                q_s, tables_s, ctx_s = q[order].contiguous(), tables[order].contiguous(), ctx[order].contiguous()
                splits = choose_num_splits(batch, kvh, WIDTH, num_sms=sms)
                want = paged_decode_attention(q, k, v, tables, ctx, scale, splits)[order].float()
                got = paged_decode_attention(q_s, k, v, tables_s, ctx_s, scale, splits).float()
                if not torch.allclose(got, want, atol=2e-2):
                    raise SystemExit("sorted rows gave a different result")
                t = (cuda_graph_us(lambda: paged_decode_attention(q, k, v, tables, ctx, scale, splits)),
                     cuda_graph_us(lambda: paged_decode_attention(q_s, k, v, tables_s, ctx_s, scale, splits)))
                total = [a + b for a, b in zip(total, t)]
                print(f"{batch:>4}{kvh:>4}{f'{lo}-{hi}':>11}{splits:>7}{t[0]:>9.1f}{t[1]:>9.1f}")
                del k, v
    print(f"{'all':>26}{total[0]:>9.1f}{total[1]:>9.1f}  ({total[1] / total[0] - 1:+.1%})")


if __name__ == "__main__":
    main()
