"""vLLM's offline metrics (drop-in round 2): `LLM(disable_log_stats=False)`, `RequestOutput.metrics`
and `llm.get_metrics()` with the server's names; vLLM's metrics example with the import changed.
The figures are checked against what the requests did (token counts, finish reasons, the order
of the times), never against the machine's speed."""

from __future__ import annotations

import contextlib
import io
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from helpers import greedy, make_llm  # noqa: E402

from nanovllm import SamplingParams  # noqa: E402
from nanovllm.metrics import Counter, Gauge, Histogram  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# vLLM's examples/offline_inference/metrics.py, the imports changed (vllm.v1.metrics.reader is
# nanovllm.metrics) and the model a tiny one.
METRICS_EXAMPLE = '''
from nanovllm import LLM, SamplingParams
from nanovllm.metrics import Counter, Gauge, Histogram, Vector

prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is",
           "The future of AI is"]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=6)

llm = LLM(model=MODEL, disable_log_stats=False, device="cpu", kvcache_block_size=16, num_kvcache_blocks=64)
outputs = llm.generate(prompts, sampling_params, use_tqdm=False)
for metric in llm.get_metrics():
    if isinstance(metric, Gauge):
        print(f"{metric.name} (gauge) = {metric.value}")
    elif isinstance(metric, Counter):
        print(f"{metric.name} (counter) = {metric.value}")
    elif isinstance(metric, Vector):
        print(f"{metric.name} (vector) = {metric.values}")
    elif isinstance(metric, Histogram):
        print(f"{metric.name} (histogram)")
        print(f"    sum = {metric.sum}")
        print(f"    count = {metric.count}")
        for bucket_le, value in metric.buckets.items():
            print(f"    {bucket_le} = {value}")
'''


def test_vllms_metrics_example_runs(ckpt):
    out, scope = io.StringIO(), {"__name__": "__main__", "MODEL": ckpt}
    with contextlib.redirect_stdout(out):
        exec(compile(METRICS_EXAMPLE, "<metrics.py>", "exec"), scope)
    text, generated = out.getvalue(), sum(len(o.outputs[0].token_ids) for o in scope["outputs"])
    assert f"vllm:generation_tokens (counter) = {generated}\n" in text
    assert "vllm:time_to_first_token_seconds (histogram)\n" in text and "    count = 4\n" in text
    scope["llm"].shutdown()


def by_name(metrics) -> dict:
    return {(m.name, tuple(sorted(m.labels.items()))): m for m in metrics}


def test_request_metrics_and_engine_counters_match_what_the_requests_did(ckpt):
    llm = make_llm(ckpt, disable_log_stats=False)
    prompts = ["Hello, world!", [5, 6, 7], "To be or not"]
    params = [greedy(5), SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=4), greedy(30, stop_token_ids=[])]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
        assert m.num_generation_tokens == len(out.outputs[0].token_ids) and m.time_in_queue >= 0
    got = by_name(llm.get_metrics())
    samples = [c for o in outs for c in o.outputs]
    assert got[("vllm:prompt_tokens", ())].value == sum(len(o.prompt_token_ids) for o in outs)
    assert got[("vllm:generation_tokens", ())].value == sum(len(c.token_ids) for c in samples)
    reasons = {}
    for c in samples:
        reasons[c.finish_reason] = reasons.get(c.finish_reason, 0) + 1
    for reason, n in reasons.items():
        assert got[("vllm:request_success", (("finished_reason", reason),))].value == n
    ttft, itl, e2e = (got[(name, ())] for name in ("vllm:time_to_first_token_seconds",
                                                    "vllm:inter_token_latency_seconds",
                                                    "vllm:e2e_request_latency_seconds"))
    assert ttft.count == e2e.count == len(samples)
    assert itl.count == sum(len(c.token_ids) - 1 for c in samples)  # one token a step per sample
    for h in (ttft, itl, e2e):
        counts = list(h.buckets.values())
        assert counts == sorted(counts) and counts[-1] == h.count and h.sum >= 0
    assert got[("vllm:num_requests_running", ())].value == 0 and isinstance(got[("vllm:kv_cache_usage_perc", ())], Gauge)
    assert isinstance(got[("vllm:prompt_tokens", ())], Counter) and isinstance(ttft, Histogram)
    # The step API's final outputs carry them too.
    engine = llm.llm_engine
    engine.add_request("r", "Hello", greedy(3))
    final = []
    while engine.has_unfinished_requests():
        final += [o for o in engine.step() if o.finished]
    assert final[0].metrics.num_generation_tokens == 3
    llm.shutdown()


def test_statistics_are_off_by_default(llm):
    out = llm.generate(["Hello"], greedy(2), use_tqdm=False)[0]
    assert out.metrics is None
    with pytest.raises(RuntimeError, match="disable_log_stats=False"):
        llm.get_metrics()


def test_aborted_requests_leave_no_times_behind(ckpt):
    llm = make_llm(ckpt, disable_log_stats=False)
    engine = llm.llm_engine
    engine.add_request("a", "Hello", SamplingParams(n=2, temperature=0.8, max_tokens=20))
    engine.step()
    engine.abort_request("a")
    assert llm._stats_recorder.times == {}
    llm.shutdown()
