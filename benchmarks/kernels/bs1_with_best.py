"""Temporary A/B helper: bench.py with kernels/w4a16.py's M = 1 launch changed.
    bs1_with_best.py w4a16.json ARGS   # the best launch per shape from a sweep
    bs1_with_best.py nopdl ARGS        # choose()'s launch without PDL
"""
import json, runpy, sys
import torch
import nanovllm.kernels.w4a16 as w

orig = w.choose
if sys.argv[1] == "nopdl":
    w.choose = lambda m, n, k, g=128, d=torch.bfloat16: (lambda c: c._replace(pdl=False) if isinstance(c, w.Strips) else c)(
        orig(m, n, k, g, d))
else:
    best = {}
    for r in json.load(open(sys.argv[1])):
        if r["m"] == 1 and "best_config" in r:
            cfg = tuple(r["best_config"])
            best[(r["n"], r["k"])] = w.Strips(*cfg) if len(cfg) == 5 else w.Gemv(*cfg)
    print("best launches", best)
    w.choose = lambda m, n, k, g=128, d=torch.bfloat16: best[(n, k)] if m == 1 and (n, k) in best else orig(m, n, k, g, d)
sys.argv = ["bench.py"] + sys.argv[2:]
runpy.run_path("bench.py", run_name="__main__")
