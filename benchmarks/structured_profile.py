"""Where a constrained step's time goes (structured_bench.py's workload, one process): the
worker's fill time, the engine thread's wait for it, and variants of the schedule, each timed.

    python benchmarks/structured_profile.py [--variants current,inline,switch] [--num-seqs 256]
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "benchmarks"))

from bench import workload  # noqa: E402
from structured_bench import model_folder, run  # noqa: E402

TIMES = collections.defaultdict(float)
COUNTS = collections.Counter()


def timed(cls, name, key):
    """Wrap cls.name so its wall time adds to TIMES[key]."""
    fn = getattr(cls, name)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TIMES[key] += time.perf_counter() - t
            COUNTS[key] += 1
    setattr(cls, name, wrapper)
    return fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="now:0.2,now:5,now:0.05,now:0.2:14")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--vocab-file", help="a tiktoken file of real tokens (see structured_bench.py)")
    args = ap.parse_args()
    from nanovllm import LLM
    from nanovllm.core.engine import LLMEngine
    from nanovllm.core.lifecycle import InFlightStep
    from nanovllm.core.model_runner import ModelRunner
    from nanovllm.features.structured.masks import StructuredOutputs, xgr

    folder = model_folder("qwen3-0.6b", 151_643, args.vocab_file)
    llm = LLM(folder, load_format="dummy", max_model_len=4096)
    prompts, max_tokens = workload(args.num_seqs, 1024, 1024, max_id=10000)
    out = sum(max_tokens)
    timed(StructuredOutputs, "_fill", "worker fill")
    timed(StructuredOutputs, "_feed", "worker feed")
    timed(StructuredOutputs, "transform", "main transform (waits fill)")
    timed(StructuredOutputs, "prepare", "main prepare")
    timed(StructuredOutputs, "build", "main build")
    timed(ModelRunner, "launch", "main launch")
    timed(InFlightStep, "resolve", "main resolve")
    timed(LLMEngine, "step", "main step")
    prepare = StructuredOutputs.prepare
    setting = {}

    def prepare_with(self, *a, **k):
        if getattr(self, "_threads", "auto") != setting["threads"]:
            self.batch, self._threads = xgr.BatchGrammarMatcher(setting["threads"]), setting["threads"]
        return prepare(self, *a, **k) and not setting["inline"]
    StructuredOutputs.prepare = prepare_with
    for variant in ["unconstrained"] + args.variants.split(","):
        # name[:switch interval ms[:xgrammar threads]], "inline" in the name: no deferral
        name, switch, threads = (variant.split(":") + ["5", "auto"])[:3] if ":" in variant else (variant, "5", "auto")
        TIMES.clear()
        COUNTS.clear()
        sys.setswitchinterval(float(switch) / 1e3)
        setting.update(threads=threads if threads == "auto" else int(threads), inline="inline" in name)
        s = run(llm, prompts, max_tokens, variant != "unconstrained")
        steps = max(COUNTS["main step"], 1)
        print(f"== {variant}: {out / s:,.0f} tok/s, {s:.2f} s, {steps} steps, {1e3 * s / steps:.2f} ms/step")
        for k in sorted(TIMES):
            print(f"   {k:32s} {1e3 * TIMES[k] / steps:7.3f} ms/step  ({COUNTS[k]} calls)")
    llm.shutdown()


if __name__ == "__main__":
    main()
