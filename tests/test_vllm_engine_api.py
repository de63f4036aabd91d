"""vLLM's LLMEngine step API (drop-in round 2): vLLM's llm_engine_example with the import changed,
output kinds (CUMULATIVE, DELTA, FINAL_ONLY) against generate() on the same requests, aborts."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from helpers import assert_idle, greedy  # noqa: E402

from nanovllm import SamplingParams  # noqa: E402
from nanovllm.sampling_params import RequestOutputKind  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# vLLM's examples/offline_inference/llm_engine_example.py, the import line changed (and argparse
# for vLLM's FlexibleArgumentParser, max_tokens added to keep it short on the CPU).
LLM_ENGINE_EXAMPLE = '''
import argparse
from nanovllm import EngineArgs, LLMEngine, RequestOutput, SamplingParams


def create_test_prompts():
    return [
        ("A robot may not injure a human being", SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1,
                                                               max_tokens=8)),
        ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2, max_tokens=8)),
        ("What is the meaning of life?", SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1,
                                                        max_tokens=8)),
    ]


def process_requests(engine, test_prompts):
    request_id = 0
    while test_prompts or engine.has_unfinished_requests():
        if test_prompts:
            prompt, sampling_params = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params)
            request_id += 1
        request_outputs: list[RequestOutput] = engine.step()
        for request_output in request_outputs:
            if request_output.finished:
                print(request_output.request_id, len(request_output.outputs), repr(request_output.outputs[0].text))


def main(args):
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    process_requests(engine, create_test_prompts())


parser = argparse.ArgumentParser(description="Demo on using the LLMEngine class directly")
parser = EngineArgs.add_cli_args(parser)
main(parser.parse_args(ARGV))
'''


def test_vllms_llm_engine_example_runs(ckpt):
    out = io.StringIO()
    argv = ["--model", ckpt, "--device", "cpu", "--kvcache-block-size", "16", "--num-kvcache-blocks", "64"]
    with contextlib.redirect_stdout(out):
        exec(compile(LLM_ENGINE_EXAMPLE, "<llm_engine_example.py>", "exec"), {"__name__": "__main__", "ARGV": argv})
    lines = sorted(out.getvalue().strip().splitlines())
    assert [line.split()[:2] for line in lines] == [["0", "1"], ["1", "1"], ["2", "2"]]


def same_logprobs(a, b) -> bool:
    """Per position the same tokens, ranks and decoded text, and logprobs up to float32 noise: the
    step API batches the three requests, generate() ran each alone (another GEMM shape)."""
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all((x[t].rank, x[t].decoded_token) == (y[t].rank, y[t].decoded_token)
                                     and abs(x[t].logprob - y[t].logprob) <= 1e-4 for t in x) for x, y in zip(a, b))


def run(engine, requests: dict) -> dict:
    """Drive the step API to the end: every output of every request, in order."""
    for rid, (prompt, sp) in requests.items():
        engine.add_request(rid, prompt, sp)
    seen = {rid: [] for rid in requests}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            seen[out.request_id].append(out)
    return seen


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_output_kinds_add_up_to_what_generate_returns(llm, kind):
    prompts = {"a": "Hello, world!", "b": [5, 6, 7, 8], "c": "To be or not to be"}
    params = {"a": greedy(9, output_kind=kind), "b": greedy(5, output_kind=kind, logprobs=2),
              "c": SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6, output_kind=kind)}
    ref = {rid: llm.generate([prompts[rid]], params[rid], use_tqdm=False)[0] for rid in prompts}
    seen = run(llm.llm_engine, {rid: (prompts[rid], params[rid]) for rid in prompts})
    for rid, outs in seen.items():
        assert outs[-1].finished and not any(o.finished for o in outs[:-1]) and outs[-1].request_id == rid
        want = ref[rid].outputs
        if kind == RequestOutputKind.FINAL_ONLY:
            assert len(outs) == 1
        if kind == RequestOutputKind.DELTA:
            for i, w in enumerate(want):
                assert [t for o in outs for t in o.outputs[i].token_ids] == w.token_ids
                assert "".join(o.outputs[i].text for o in outs) == w.text
                if w.logprobs is not None:
                    assert same_logprobs([lp for o in outs for lp in o.outputs[i].logprobs], w.logprobs)
            assert sum(o.prompt_logprobs is not None for o in outs) <= 1
        else:
            assert len(outs) > 1 or kind == RequestOutputKind.FINAL_ONLY
            final = outs[-1].outputs
            assert [c.token_ids for c in final] == [w.token_ids for w in want]
            assert [c.text for c in final] == [w.text for w in want]
            assert all(same_logprobs(c.logprobs, w.logprobs) for c, w in zip(final, want))
            assert outs[-1].prompt_token_ids == ref[rid].prompt_token_ids
            if kind == RequestOutputKind.CUMULATIVE:  # each output holds everything so far
                lengths = [len(o.outputs[0].token_ids) for o in outs]
                assert lengths == sorted(lengths) and lengths[-1] == len(want[0].token_ids)
    assert_idle(llm)


def test_abort_and_bad_requests(llm):
    engine = llm.llm_engine
    assert engine is llm.llm_engine  # one per LLM
    engine.add_request("x", "Hello, world!", greedy(50))
    engine.add_request("y", "Hello", greedy(3))
    with pytest.raises(ValueError, match="request_id 'x' is already running"):
        engine.add_request("x", "again", greedy(3))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("z", "Hello", SamplingParams(max_tokens=0))
    engine.step()
    engine.abort_request("x")
    engine.abort_request(["nope", "x"])  # unknown and finished ids are ignored
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    assert {o.request_id for o in seen} == {"y"} and seen[-1].finished
    assert engine.get_num_unfinished_requests() == 0
    assert_idle(llm)


def test_engine_args_from_the_command_line(ckpt):
    from nanovllm import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--model", ckpt, "--max-num-seqs", "8", "--no-enable-prefix-caching",
                                                       "--hf-overrides", '{"max_position_embeddings": 96}']))
    assert args.model == ckpt and args.kwargs == {"max_num_seqs": 8, "enable_prefix_caching": False,
                                                  "hf_overrides": {"max_position_embeddings": 96}}
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", ckpt, "--max-num-seqs", "x"])
