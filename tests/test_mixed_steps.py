"""Mixed steps (LLM(mixed_steps=True), the server's scheduling): decode rows ride along with
prompt chunks in one prefill-shaped step. In-process on a tiny random checkpoint (CPU, fp32):

1. a long prompt being prefilled does not stop a running request from getting a token in each
   of those steps (and without mixed steps it does: the test can tell the two apart);
2. mixed schedules give the same greedy tokens as split ones (prefill steps and decode steps
   apart), with chunking, prefix hits, n > 1 forks, preemption and overlap scheduling's
   on-device tokens (a decode row's input taken from the previous step's sampled tokens).

The scheduler's own invariants under mixed steps are fuzzed in test_scheduler.py.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from helpers import assert_idle, greedy, make_llm, rand_ids, tiny_checkpoint  # noqa: E402

from nanovllm import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory, "gqa")


def record_batches(llm) -> list[tuple[bool, int, int]]:
    """(is_prefill, decode rows, preempted) of every batch the scheduler hands out from now on;
    a decode row computes the newest token of a sequence that has generated some."""
    batches = []
    schedule = llm.scheduler.schedule

    def recording():
        batch = schedule()
        if batch is not None:
            decoding = sum(1 for s in batch.seqs if s.num_uncomputed_tokens == 1 and s.num_completion_tokens > 0)
            batches.append((batch.is_prefill, decoding, len(batch.preempted)))
        return batch

    llm.scheduler.schedule = recording
    return batches


def tokens_during_prefill(path: str, mixed: bool, **options) -> tuple[list[int], int]:
    """Start request a, let it decode, then add b with a 120-token prompt (budget 16: eight
    prefill steps). Returns how many tokens a got in each step until b's first token, and the
    number of steps that took."""
    llm = make_llm(path, max_num_batched_tokens=16, mixed_steps=mixed, **options)
    try:
        a = llm.add_request(rand_ids(5, seed=1), greedy(40))
        for _ in range(3):
            llm.step()
        b = llm.add_request(rand_ids(120, seed=2), greedy(2))
        per_step = []
        for _ in range(30):  # bounded: b needs 8 prefill steps (+1 in flight)
            outputs, _, _ = llm.step()
            if any(o.seq is b for o in outputs):
                break
            per_step.append(sum(len(o.new_token_ids) for o in outputs if o.seq is a))
        else:
            raise AssertionError("b never got its first token")
        llm.abort(a)
        while llm.has_unfinished():
            llm.step()
        assert_idle(llm)
        return per_step, len(per_step)
    finally:
        llm.shutdown()


def test_a_long_prefill_does_not_stall_a_running_request(gqa):
    per_step, steps = tokens_during_prefill(gqa, mixed=True)
    assert steps >= 120 // 16, per_step
    assert per_step == [1] * steps, f"tokens of the running request per step while b prefills: {per_step}"
    # The split policy prefills b first: a gets nothing for most of those steps.
    split, _ = tokens_during_prefill(gqa, mixed=False)
    assert split.count(0) >= 120 // 16 - 1, split


@pytest.mark.parametrize("budget,blocks", [(24, 128), (64, 12)], ids=["chunked", "preempting"])
def test_mixed_schedules_give_the_same_greedy_tokens_as_split_ones(gqa, budget, blocks):
    # Prompts of 1 to 70 tokens, two sharing a 32-token prefix (prefix hits), one with n=2
    # (greedy: both samples equal), max_tokens up to 24; a budget of 24 chunks most prompts
    # beside running decodes; 12 blocks of 16 tokens force preemption by recompute.
    shared = rand_ids(32, seed=7)
    prompts = [rand_ids(n, seed=10 + n) for n in (1, 9, 17, 40, 70, 3)] + [shared + [5], shared + [6, 7]]
    params = [greedy(8 + 2 * i) for i in range(len(prompts))]
    params[2] = greedy(12, n=2)
    results = {}
    for mixed in (False, True):
        llm = make_llm(gqa, max_num_batched_tokens=budget, num_kvcache_blocks=blocks, max_num_seqs=6,
                       mixed_steps=mixed)
        try:
            batches = record_batches(llm)
            out = llm.generate(prompts, params, use_tqdm=False)
            results[mixed] = [[c.token_ids for c in o.outputs] for o in out]
            assert_idle(llm)
            mixed_rows = sum(rows for prefill, rows, _ in batches if prefill)
            preempted = sum(n for _, _, n in batches)
            assert (mixed_rows > 0) == mixed, "mixed decode rows into prompt work, or did not"
            if blocks == 12:
                assert preempted > 0, "the small cache did not preempt"
        finally:
            llm.shutdown()
    assert results[True] == results[False]
    assert results[True][2][0] == results[True][2][1]


def test_mixed_steps_with_penalties_and_logprobs_match_split_ones(gqa):
    """Rows that process logits (repetition penalty: device token counts updated from each
    step's samples) and ask for logprobs, decoded inside mixed steps."""
    prompts = [rand_ids(n, seed=40 + n) for n in (4, 50, 30)]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3, logprobs=2),
              greedy(6), greedy(10, presence_penalty=0.5)]
    results = {}
    for mixed in (False, True):
        llm = make_llm(gqa, max_num_batched_tokens=16, mixed_steps=mixed)
        try:
            out = llm.generate(prompts, params, use_tqdm=False)
            results[mixed] = out
        finally:
            llm.shutdown()
    for split, mixed in zip(results[False], results[True]):
        assert mixed.outputs[0].token_ids == split.outputs[0].token_ids
    lp_split, lp_mixed = results[False][0].outputs[0].logprobs, results[True][0].outputs[0].logprobs
    for a, b in zip(lp_split, lp_mixed):
        assert a.keys() == b.keys()
        # The same fp32 logits computed by the decode path and by the varlen prefill path:
        # summation order differs, so allow a few fp32 ulps of a logit of magnitude ~10.
        assert all(abs(a[t].logprob - b[t].logprob) <= 1e-4 for t in a)


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_mixed_steps_on_cuda_give_the_split_greedy_tokens(gqa, enforce_eager):
    """On the GPU (Triton backend, CUDA graphs for the plain decode steps, pinned host copies):
    decode rows of mixed steps take their input token from the device buffer inside a varlen
    prefill step. fp32, so that both schedules compute the same numbers up to summation order."""
    prompts = [rand_ids(n, seed=60 + n) for n in (3, 20, 90, 45, 130, 7)]
    params = [greedy(10 + 3 * i) for i in range(len(prompts))]
    results = {}
    for mixed in (False, True):
        llm = make_llm(gqa, device="cuda", dtype="float32", max_num_batched_tokens=32, mixed_steps=mixed,
                       enforce_eager=enforce_eager)
        try:
            results[mixed] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert_idle(llm)
        finally:
            llm.shutdown()
    assert results[True] == results[False]
    per_step, steps = tokens_during_prefill(gqa, mixed=True, device="cuda", dtype="float32")
    assert per_step == [1] * steps


@pytest.mark.parametrize("device,dtype,tol", [("cpu", "float32", 1e-5),
                                              pytest.param("cuda", "bfloat16", 1e-2, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("cached,new", [([256, 40, 100, 7], [20, 5, 1, 1]), ([33, 64, 5], [1, 1, 1])],
                         ids=["prefill+decode", "decode-rows-only"])
def test_triton_backend_runs_decode_rows_of_a_mixed_step_through_the_decode_kernel(cached, new, device, dtype, tol,
                                                                                   fresh_seed):
    """TritonBackend on a mixed step's metadata (its last rows one-token decode rows): the
    decode rows go through the paged decode kernel (Triton's interpreter on the CPU), the others
    through the prefill path (the torch reference in fp32 on the CPU; aten's FlashAttention in
    bf16 on the GPU). Against a plain fp32 softmax attention, relative to the output's norm:
    in fp32 only rounding of sums over <= 276 keys (<= 1e-5); in bf16 the inputs' and the
    output's rounding (2**-8 each) dominate (<= 1e-2, test_attention's bound)."""
    import torch

    from test_attention import dense_new_kv, make_cache_scenario, prefill_meta, reference_attention

    from nanovllm.model.attention.triton_backend import TritonBackend

    q, ks, vs, kc, vc, bt = make_cache_scenario(cached, new, 4, 2, 16, 16, getattr(torch, dtype), device,
                                                seed=fresh_seed)
    meta = prefill_meta(cached, new, bt, device)
    meta.num_decode_rows = len(new) - max((i + 1 for i, n in enumerate(new) if n != 1), default=0)
    meta.num_splits = 2
    calls = []
    backend = TritonBackend()
    decode = backend._decode
    backend._decode = lambda *a, **kw: calls.append(a[0].shape[0]) or decode(*a, **kw)
    k_new, v_new = dense_new_kv(ks, vs, new)
    out = backend.forward(q, k_new, v_new, kc, vc, meta, 16 ** -0.5).float()
    ref = reference_attention(q.float(), [k.float() for k in ks], [v.float() for v in vs], new, 16 ** -0.5)
    assert calls == [meta.num_decode_rows]
    assert ((out - ref).norm() / ref.norm()).item() <= tol


def test_step_inputs_mark_the_trailing_decode_rows_for_the_triton_backend():
    import torch

    from nanovllm.core.step_inputs import StepInput, StepInputs

    def meta_of(backend, q_lens, starts):
        inputs = StepInputs(8, 4, 16, torch.device("cpu"), backend, 2)
        inputs.num_splits = lambda bs, width: (bs, width)  # (needs a GPU's SM count otherwise)
        step = StepInput(True, [[3] * n for n in q_lens], starts, [[i] for i in range(len(q_lens))])
        return inputs.prefill(step)[2]

    meta = meta_of("triton", [5, 1, 1], [0, 7, 9])
    assert meta.num_decode_rows == 2 and meta.num_splits == (2, 1)
    assert meta_of("triton", [1, 5], [7, 0]).num_decode_rows == 0   # decode rows come last, or none count
    assert meta_of("triton", [1, 1], [0, 0]).num_decode_rows == 0   # fresh prompts: no cache to read
    assert meta_of("torch", [5, 1], [0, 7]).num_decode_rows == 0    # the other backends take rows as they are
