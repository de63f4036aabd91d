"""What the engine tells its step observers, and its KV-cache use (the hooks bench.py's
per-step floor and KV report are built on): StepTiming's step shape (sequences, context
tokens, attention pairs) and LLMEngine.kv_usage(), checked on tiny CPU runs against counts
made independently from the requests and from the block tables."""

from __future__ import annotations

import pytest

from helpers import BLOCK, greedy, make_llm, rand_ids, tiny_checkpoint
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.kv_usage import KVUsage
from nanovllm.core.step_timing import StepShape
from nanovllm.core.scheduler import ScheduledBatch
from nanovllm.core.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def _seq(n_tokens: int, cached: int) -> Sequence:
    s = Sequence(0, list(range(n_tokens)), SamplingParams(), seed=0)
    s.num_cached_tokens = cached
    return s


def test_step_shape_of_hand_made_batches():
    # Decode: contexts 10 + 1 and 99 + 1.
    decode = ScheduledBatch([_seq(11, 10), _seq(100, 99)], [1, 1], is_prefill=False)
    assert StepShape.of(decode) == (2, 111, 111)
    # Prefill: a fresh 5-token prompt (1 + 2 + ... + 5 = 15 pairs) and the 3-token chunk after 32
    # cached tokens (33 + 34 + 35 = 102 pairs).
    prefill = ScheduledBatch([_seq(5, 0), _seq(40, 32)], [5, 3], is_prefill=True)
    assert StepShape.of(prefill) == (2, 5 + 35, 15 + 102)


def _observe(llm, prompts, params):
    timings = []
    llm.step_observers.append(timings.append)
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.step_observers.remove(timings.append)
    return timings


def _pairs(prompt_len: int, max_tokens: int, hit: int = 0) -> int:
    """(query, key) pairs of every token the engine computes for one request: the prompt's
    causal triangle less its cached prefix, then each decode token (position p + j - 1 sees
    p + j keys, j = 1 .. max_tokens - 1; the last sampled token is never fed back)."""
    prompt = prompt_len * (prompt_len + 1) // 2 - hit * (hit + 1) // 2
    return prompt + sum(prompt_len + j for j in range(1, max_tokens))


def test_step_shapes_of_a_chunked_run_and_of_its_prefix_hits(ckpt):
    """However prefill is chunked and whatever the prefix cache serves, each computed token at
    position q adds q + 1 pairs: the sums over the steps are fixed by the requests."""
    lens, outs = [40, 23, 57], [5, 7, 3]
    prompts = [rand_ids(n, seed=i) for i, n in enumerate(lens)]
    params = [greedy(n) for n in outs]
    llm = make_llm(ckpt, max_num_batched_tokens=32)  # 120 prompt tokens: chunks
    try:
        for run in range(2):  # the second run hits the first one's full prompt blocks
            hits = [((n - 1) // BLOCK) * BLOCK if run else 0 for n in lens]
            timings = _observe(llm, prompts, params)
            first, steps = timings[0], timings[1:]
            assert (first.num_tokens, first.num_seqs, first.context_tokens, first.attention_pairs) == (0, 0, 0, 0)
            assert sum(t.num_tokens for t in steps) == sum(lens) - sum(hits) + sum(outs) - len(outs)
            assert sum(t.attention_pairs for t in steps) == sum(map(_pairs, lens, outs, hits))
            assert run or any(t.is_prefill and t.num_tokens == 32 for t in steps)  # chunked
            for t in steps:
                assert t.num_seqs >= 1 and t.context_tokens >= t.num_tokens
                if not t.is_prefill:
                    assert t.num_seqs == t.num_tokens and t.attention_pairs == t.context_tokens
            if run:
                assert any(t.is_prefill and t.context_tokens > t.num_tokens for t in steps)  # read a prefix
    finally:
        llm.shutdown()


def _truth(llm) -> tuple[int, int]:
    """(blocks held, live tokens) counted from the block tables: every distinct block of the
    running sequences and held fork reserves; a block's live tokens are the most any holder
    has computed into it."""
    running = list(llm.scheduler.running)
    filled: dict[int, int] = {}
    for s in running:
        for i, b in enumerate(s.block_table):
            filled[b] = max(filled.get(b, 0), min(BLOCK, max(0, s.num_cached_tokens - i * BLOCK)))
    reserved = {b for s in running for b in s.reserved_blocks}
    return len(filled.keys() | reserved), sum(filled.values())


def test_kv_usage_counts_agree_with_the_block_tables(ckpt):
    """Sampled after every step, as bench.py does: allocated >= live, fragmentation under a
    block per running request, the peak concurrency max_num_seqs allows; prefix sharing (a
    common 40-token prefix, then the same prompts again) and forks (n = 2) included."""
    base = rand_ids(40, seed=7)
    prompts = [base + rand_ids(n, seed=10 + n) for n in (5, 19, 33, 2)]
    params = [greedy(9), greedy(4), SamplingParams(temperature=1.0, n=2, max_tokens=6, ignore_eos=True), greedy(12)]
    llm = make_llm(ckpt, max_num_seqs=3)
    samples = []

    def observe(_timing):
        per_request = sum(s.num_cached_tokens for s in llm.scheduler.running)
        samples.append((llm.kv_usage(), *_truth(llm), llm.block_manager.num_free_blocks, per_request))

    llm.step_observers.append(observe)
    try:
        llm.generate(prompts, params, use_tqdm=False)
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.step_observers.remove(observe)
        llm.shutdown()
    assert len(samples) > 20
    for u, used, live, free, _ in samples:
        assert isinstance(u, KVUsage) and u.block_size == BLOCK and u.num_blocks == 128
        assert u.used_blocks == used == u.num_blocks - free
        assert u.live_tokens == live
        assert 0 <= u.fragmentation_tokens == u.allocated_tokens - u.live_tokens
        # Per request: the unfilled tail of its last block (prompts fit one step: no blocks
        # allocated ahead), plus one reserve block per pending fork.
        assert u.fragmentation_tokens < BLOCK * (u.running_seqs + 1) or u.running_seqs == 0
        assert u.running_seqs <= 3
    assert max(u.running_seqs for u, *_ in samples) == 3
    # Shared prefix blocks were counted once: per request they sum to more than the live tokens.
    assert any(per_request >= u.live_tokens + 2 * BLOCK for u, *_, per_request in samples)
    assert samples[-1][0].used_blocks == 0 and samples[-1][0].live_tokens == 0  # all freed at the end


def test_block_manager_counts_shared_references():
    bm = BlockManager(16, 4)
    a = Sequence(1, list(range(9)), SamplingParams(), seed=0)
    bm.allocate(a)
    a.num_cached_tokens = 9
    bm.commit(a)
    b = Sequence(2, list(range(9)), SamplingParams(), seed=0)  # hits a's two full blocks
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and bm.num_shared_refs == 2
    u = bm.usage([a, b])
    assert (u.used_blocks, u.live_tokens, u.running_seqs) == (4, 9 + 8 - 8, 2)
    bm.free(a)
    assert bm.num_shared_refs == 0 and bm.usage([b]).live_tokens == 8
    bm.free(b)
    assert bm.usage([]) == KVUsage(4, 16, 0, 0, 0)
