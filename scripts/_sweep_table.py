"""The four fastest launches per GEMM and row count of a bench_w4a16.py --sweep (its w4a16.json),
next to bf16 and choose's launch: python3 scripts/_sweep_table.py w4a16.json"""

import json
import sys

rows = json.load(open(sys.argv[1]))
for r in rows:
    best = sorted(r.get("timed", {}).items(), key=lambda kv: kv[1])[:4]
    print(f"{r['gemm']:<8}{r['m']:>5} bf16 {r['bf16_us']:>7} choose {r['int4_us']:>7} | "
          + "  ".join(f"{c.replace(' ', '')}:{v}" for c, v in best))
