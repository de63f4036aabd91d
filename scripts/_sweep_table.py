import json, sys
rows = json.load(open(sys.argv[1]))
for r in rows:
    t = r.get("timed", {})
    best = sorted(t.items(), key=lambda kv: kv[1])[:4]
    print(f"{r['gemm']:<8}{r['m']:>5} bf16 {r['bf16_us']:>7} choose {r['int4_us']:>7} | " + "  ".join(f"{c.replace(' ', '')}:{v}" for c, v in best))
