"""Scheduler tests: continuous batching, chunked prefill, preemption and stop rules.

A "fake model step" stands in for the model runner: call `schedule()`, produce one token id
per scheduled sequence, account for it as the engine does (`postprocess()` below). Everything runs on the CPU in a few seconds.
The randomized test at the end drives thousands of small schedules and checks the block
manager's and scheduler's invariants after every step, including a shadow copy of the KV cache.
"""

from __future__ import annotations

import os
import random
import time

import pytest

from nanovllm.core import prefix_cache as pc_mod
from nanovllm.core import engine_extras
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.lifecycle import RequestLifecycle, is_stop_token
from nanovllm.core.scheduler import Scheduler
from nanovllm.core.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from nanovllm.features.mixed_steps import MixedSteps
from nanovllm.features.parallel_sampling import ParallelSampling
from nanovllm.sampling_params import SamplingParams

EOS = 0
_ids = iter(range(10**9))


def make_sched(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, prefix=True) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size, prefix), max_num_seqs, budget)


def add(sched: Scheduler, prompt, **params) -> Sequence:
    params.setdefault("max_tokens", 4)
    seq = Sequence(next(_ids), list(prompt), SamplingParams(**params), seed=0)
    sched.add(seq)
    return seq


def next_token(seq: Sequence) -> int:
    """A deterministic non-EOS token: the same sequence state always gives the same token."""
    return 100 + (seq.seq_id * 7 + len(seq)) % 50


def launched(sched: Scheduler, batch, max_model_len=10**6) -> None:
    """What the engine does once a step is launched (RequestLifecycle.launched)."""
    RequestLifecycle(sched, None, frozenset(), max_model_len).launched(batch)


def resolve(sched: Scheduler, batch, tokens, eos, max_model_len=10**6) -> list[Sequence]:
    """What the engine does when a launched step's tokens arrive; the sequences that got one."""
    return [o.seq for o in RequestLifecycle(sched, None, eos, max_model_len).accept(batch, tokens)]


def postprocess(sched: Scheduler, batch, tokens, eos, max_model_len) -> list[Sequence]:
    """Both at once, for a step whose tokens are already known."""
    launched(sched, batch, max_model_len)
    return resolve(sched, batch, tokens, eos, max_model_len)


def step(sched: Scheduler, token_fn=next_token, eos=frozenset({EOS}), max_model_len=10**6):
    batch = sched.schedule()
    assert batch is not None, "scheduler produced no work although requests are pending"
    bs = sched.block_manager.block_size
    assert batch.num_tokens <= sched.max_num_batched_tokens
    assert len(batch.seqs) <= sched.max_num_seqs
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        assert 1 <= n <= seq.num_uncomputed_tokens
        assert len(seq.block_table) * bs >= seq.num_cached_tokens + n
    advanced = postprocess(sched, batch, [token_fn(s) for s in batch.seqs], eos, max_model_len)
    return batch, advanced


def run_all(sched: Scheduler, max_steps=10_000, **kw) -> list:
    batches = []
    while sched.has_unfinished():
        assert len(batches) < max_steps
        batches.append(step(sched, **kw)[0])
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    return batches


def eos_at(k: int, tok: int = EOS):
    """A token function emitting `tok` as the k-th completion token (1-based)."""
    def fn(seq):
        return tok if seq.num_completion_tokens == k - 1 else next_token(seq)
    return fn


# ------------------------------------------------------------------------------- basic behaviour
def test_schedule_with_nothing_to_do_returns_none():
    sched = make_sched()
    assert not sched.has_unfinished()
    assert sched.schedule() is None


def test_add_rejects_a_sequence_larger_than_the_cache():
    sched = make_sched(num_blocks=2, block_size=4)
    with pytest.raises(ValueError):
        add(sched, range(9))
    add(sched, range(8))                          # exactly the whole cache is fine
    assert len(sched.waiting) == 1


def test_token_budget_is_respected_and_prompts_are_chunked_to_fill_it():
    sched = make_sched(budget=10)
    seqs = [add(sched, range(i * 10, i * 10 + 7), max_tokens=3) for i in range(5)]
    batch, advanced = step(sched)
    assert batch.is_prefill and batch.seqs == seqs[:2] and batch.num_new_tokens == [7, 3]
    assert advanced == [seqs[0]]                  # seqs[1] got only a chunk: no token yet
    batch, _ = step(sched)                        # the chunked prompt goes first
    assert batch.seqs == seqs[1:3] and batch.num_new_tokens == [4, 6]
    for batch in run_all(sched):
        assert batch.num_tokens <= 10
    assert all(s.is_finished and s.num_completion_tokens == 3 for s in seqs)


def test_chunked_prefill_of_a_long_prompt_yields_a_token_only_after_the_last_chunk():
    sched = make_sched(budget=8)
    seq = add(sched, range(1, 21), max_tokens=3)  # 20 prompt tokens: chunks 8, 8, 4
    for want_cached in (8, 16):
        batch, advanced = step(sched)
        assert batch.is_prefill and batch.num_new_tokens == [8]
        assert advanced == [] and len(seq) == 20 and seq.num_cached_tokens == want_cached
    batch, advanced = step(sched)
    assert batch.num_new_tokens == [4] and advanced == [seq]
    assert len(seq) == 21 and seq.num_cached_tokens == 20
    batch, advanced = step(sched)                 # now a decode
    assert not batch.is_prefill and batch.num_new_tokens == [1] and advanced == [seq]
    run_all(sched)
    assert seq.num_completion_tokens == 3 and seq.finish_reason == "length"


def test_chunked_prefill_whose_last_chunk_is_one_token():
    sched = make_sched(budget=8)
    seq = add(sched, range(1, 18), max_tokens=2)  # 17 tokens: 8, 8, 1
    computed = 0
    while seq.num_completion_tokens == 0:
        batch, advanced = step(sched)
        computed += batch.num_tokens
        assert (advanced == [seq]) == (seq.num_completion_tokens == 1)
    assert computed == 17 and seq.num_cached_tokens == 17
    run_all(sched)
    assert seq.num_completion_tokens == 2


def test_max_num_seqs_is_respected():
    sched = make_sched(max_num_seqs=2)
    seqs = [add(sched, [i, i + 1, i + 2], max_tokens=3) for i in range(5)]
    while sched.has_unfinished():
        batch, _ = step(sched)
        assert len(sched.running) <= 2 and len(batch.seqs) <= 2
    assert all(s.is_finished and s.num_completion_tokens == 3 for s in seqs)


def test_decode_schedules_every_running_sequence():
    sched = make_sched()
    seqs = [add(sched, range(i, i + 5), max_tokens=5) for i in range(3)]
    batch, advanced = step(sched)
    assert batch.is_prefill and batch.seqs == seqs and advanced == seqs
    for _ in range(4):
        batch, advanced = step(sched)
        assert not batch.is_prefill
        assert batch.seqs == seqs and batch.num_new_tokens == [1, 1, 1] and advanced == seqs
    assert all(s.is_finished for s in seqs) and not sched.has_unfinished()


def test_decode_rows_come_longest_context_first_without_reordering_the_queue():
    sched = make_sched()
    lens = [3, 9, 5, 9, 1]
    seqs = [add(sched, range(100, 100 + n), max_tokens=4) for n in lens]
    step(sched)  # prefill, in arrival order
    for _ in range(2):
        batch, _ = step(sched)
        assert not batch.is_prefill
        # Longest first (the decode kernel's tail is shorter), ties in queue order.
        assert batch.seqs == [seqs[1], seqs[3], seqs[2], seqs[0], seqs[4]]
        assert list(sched.running) == seqs  # preemption still picks the newest


def test_decode_batch_is_capped_by_the_token_budget():
    sched = make_sched(budget=2)
    seqs = [add(sched, [i], max_tokens=3) for i in range(3)]
    while sched.has_unfinished():
        batch, _ = step(sched)
        assert batch.num_tokens <= 2
    assert all(s.num_completion_tokens == 3 for s in seqs)


def test_new_prompts_are_prefilled_before_running_sequences_decode():
    sched = make_sched()
    a = add(sched, [1, 2, 3], max_tokens=4)
    step(sched)
    b = add(sched, [4, 5, 6], max_tokens=4)
    batch, _ = step(sched)
    assert batch.is_prefill and batch.seqs == [b]
    batch, _ = step(sched)
    assert not batch.is_prefill and batch.seqs == [a, b]


def test_mixed_steps_decode_rows_ride_along_with_prompt_chunks():
    sched = make_sched(budget=8)
    sched.policy = MixedSteps()
    a = add(sched, [1, 2, 3], max_tokens=8)
    step(sched)                                   # a's prompt
    b = add(sched, range(10, 40), max_tokens=2)   # 30 prompt tokens: chunks of 7 beside a's row
    chunks = []
    while b.num_completion_tokens == 0:
        before = a.num_completion_tokens
        batch, advanced = step(sched)
        assert batch.is_prefill and batch.seqs == [b, a] and a in advanced
        assert a.num_completion_tokens == before + 1 and batch.num_tokens <= 8
        chunks.append(batch.num_new_tokens[0])
    assert chunks == [7, 7, 7, 7, 2]
    batch, _ = step(sched)                        # no prompt work left: a plain decode step
    assert not batch.is_prefill and batch.seqs == [b, a]   # (longest context first)
    run_all(sched)
    assert a.num_completion_tokens == 8 and b.num_completion_tokens == 2


def test_mixed_steps_without_prompt_work_are_plain_decode_steps():
    sched = make_sched(budget=2)
    sched.policy = MixedSteps()
    seqs = [add(sched, [i, i + 1], max_tokens=3) for i in range(3)]
    batch, _ = step(sched)                        # a budget of 2: one prompt, one more chunk
    assert batch.is_prefill and batch.num_tokens == 2
    for batch in run_all(sched):
        assert batch.num_tokens <= 2
        if not batch.is_prefill:
            assert all(n == 1 for n in batch.num_new_tokens)
    assert all(s.num_completion_tokens == 3 for s in seqs)


def test_admission_is_first_come_first_served_when_the_cache_is_short():
    sched = make_sched(num_blocks=4, block_size=4)
    a = add(sched, range(12), max_tokens=2)       # 3 blocks
    b = add(sched, range(20, 28), max_tokens=2)   # 2 blocks: does not fit next to a
    c = add(sched, [30], max_tokens=2)            # 1 block: would fit, but waits behind b
    batch, _ = step(sched)
    assert batch.seqs == [a] and list(sched.waiting) == [b, c]
    run_all(sched)
    assert all(s.is_finished for s in (a, b, c))


def test_prefix_hit_skips_the_cached_tokens():
    sched = make_sched(block_size=4)
    a = add(sched, range(12), max_tokens=1)
    run_all(sched)
    b = add(sched, list(range(8)) + [90, 91], max_tokens=1)
    batch, advanced = step(sched)
    assert batch.num_new_tokens == [2] and advanced == [b]
    assert sched.block_manager.num_prefix_hit_tokens == 8
    assert a.is_finished and b.is_finished


# ---------------------------------------------------------------------------------- preemption
@pytest.mark.parametrize("prefix", [True, False])
def test_preemption_by_recompute_keeps_generated_tokens(prefix):
    # 4 blocks of 2: two 3-token prompts take everything; the first decode that needs a third
    # block for the older sequence must preempt the newer one.
    sched = make_sched(num_blocks=4, block_size=2, prefix=prefix)
    old = add(sched, [1, 2, 3], max_tokens=4)
    new = add(sched, [4, 5, 6], max_tokens=4)     # blocks_for(3 + 4 - 1) = 3 <= 4: accepted
    batch, _ = step(sched)
    assert batch.seqs == [old, new] and sched.block_manager.num_free_blocks == 0
    batch, _ = step(sched)                        # decode: lengths 4 -> 5, still 2 blocks each
    assert batch.seqs == [old, new] and not batch.preempted
    kept = list(new.token_ids)
    batch, _ = step(sched)                        # old needs a third block: preempt new
    assert batch.seqs == [old] and batch.preempted == [new]
    assert new.status == SequenceStatus.WAITING and list(sched.waiting) == [new]
    assert new.block_table == [] and new.num_cached_tokens == 0
    assert new.token_ids == kept and new.num_completion_tokens == 2
    assert new.num_preemptions == 1 and sched.num_preemptions == 1
    while not old.is_finished:
        step(sched)
    recompute = step(sched)[0]                    # new comes back: prompt + generated tokens
    assert recompute.is_prefill and recompute.seqs == [new]
    assert new.token_ids[:5] == kept
    if prefix:                                    # its first full block survived in the cache
        assert recompute.num_new_tokens == [3]
    else:
        assert recompute.num_new_tokens == [5]
    run_all(sched)
    assert new.finish_reason == "length" and new.num_completion_tokens == 4
    assert old.finish_reason == "length" and old.num_completion_tokens == 4
    # A recomputed sequence continues exactly where it was: same tokens as without preemption.
    assert new.completion_token_ids == [100 + (new.seq_id * 7 + n) % 50 for n in range(3, 7)]


def test_lone_sequence_is_never_preempted_by_itself():
    # Exactly the cache the request needs (what the engine's admission check allows).
    sched = make_sched(num_blocks=3, block_size=2)
    seq = add(sched, [1, 2, 3], max_tokens=4)     # grows to 6 tokens = 3 blocks
    run_all(sched)
    assert seq.num_completion_tokens == 4 and seq.num_preemptions == 0


# --------------------------------------------------------------------------------- stop rules
def test_eos_stops_with_reason_stop_and_frees_blocks():
    sched = make_sched()
    seq = add(sched, [1, 2, 3], max_tokens=10)
    run_all(sched, token_fn=eos_at(3))
    assert seq.finish_reason == "stop" and seq.num_completion_tokens == 3
    assert seq.token_ids[-1] == EOS and seq.block_table == [] and seq.status == SequenceStatus.FINISHED


def test_ignore_eos_keeps_generating_until_max_tokens():
    sched = make_sched()
    seq = add(sched, [1, 2, 3], max_tokens=6, ignore_eos=True)
    run_all(sched, token_fn=lambda s: EOS)
    assert seq.finish_reason == "length" and seq.completion_token_ids == [EOS] * 6


def test_stop_token_ids_stop_and_are_kept():
    sched = make_sched()
    seq = add(sched, [1, 2, 3], max_tokens=10, stop_token_ids=[77])
    run_all(sched, token_fn=eos_at(2, 77))
    assert seq.finish_reason == "stop" and seq.completion_token_ids[-1] == 77
    assert seq.num_completion_tokens == 2
    # stop_token_ids apply even with ignore_eos
    seq = add(sched, [1, 2, 3], max_tokens=10, stop_token_ids=[77], ignore_eos=True)
    run_all(sched, token_fn=eos_at(4, 77))
    assert seq.finish_reason == "stop" and seq.num_completion_tokens == 4


def test_min_tokens_suppresses_eos_and_stop_ids():
    sched = make_sched()
    a = add(sched, [1, 2, 3], max_tokens=10, min_tokens=3)
    b = add(sched, [4, 5, 6], max_tokens=10, min_tokens=3, stop_token_ids=[77])
    run_all(sched, token_fn=lambda s: EOS if s is a else 77)
    assert a.finish_reason == "stop" and a.completion_token_ids == [EOS] * 3
    assert b.finish_reason == "stop" and b.completion_token_ids == [77] * 3


def test_max_tokens_gives_reason_length():
    sched = make_sched()
    one = add(sched, [1, 2, 3], max_tokens=1)
    five = add(sched, [1, 2, 3], max_tokens=5)
    run_all(sched)
    assert one.finish_reason == "length" and one.num_completion_tokens == 1
    assert five.finish_reason == "length" and five.num_completion_tokens == 5


def test_max_model_len_gives_reason_length():
    sched = make_sched()
    seq = add(sched, range(5), max_tokens=100)
    run_all(sched, max_model_len=8)
    assert seq.finish_reason == "length" and len(seq) == 8


def test_eos_beats_length_on_the_last_token():
    sched = make_sched()
    seq = add(sched, [1, 2], max_tokens=3)
    run_all(sched, token_fn=eos_at(3))
    assert seq.finish_reason == "stop" and seq.num_completion_tokens == 3


def test_stop_token_rules():
    eos = frozenset({EOS, 5})
    seq = Sequence(0, [1, 2], SamplingParams(max_tokens=9, min_tokens=2, stop_token_ids=[9]), 0)
    seq.token_ids.append(5)
    assert not is_stop_token(seq, 5, eos)     # min_tokens=2 holds EOS back...
    assert not is_stop_token(seq, 9, eos)     # ...and stop ids
    seq.token_ids.append(5)
    assert is_stop_token(seq, 5, eos)         # any of several EOS ids
    assert is_stop_token(seq, 9, eos)
    assert not is_stop_token(seq, 4, eos)
    ignoring = Sequence(1, [1], SamplingParams(ignore_eos=True, stop_token_ids=[9]), 0)
    ignoring.token_ids.append(5)
    assert not is_stop_token(ignoring, 5, eos) and is_stop_token(ignoring, 9, eos)


def test_advance_then_resolve_matches_postprocess():
    """Overlap scheduling: the next step is scheduled on placeholders before tokens arrive."""
    sched = make_sched()
    a = add(sched, [1, 2, 3], max_tokens=2)
    b = add(sched, [4, 5], max_tokens=5)
    first = sched.schedule()
    launched(sched, first, max_model_len=100)
    assert a.token_ids[-1] == PENDING_TOKEN and b.token_ids[-1] == PENDING_TOKEN
    assert (a.pending_row, b.pending_row) == (0, 1) and not a.is_finished
    second = sched.schedule()                 # scheduled while the first step's tokens are unknown
    assert second.seqs == [a, b] and not second.is_prefill
    assert resolve(sched, first, [7, EOS], frozenset({EOS}), max_model_len=100) == [a, b]
    assert a.token_ids == [1, 2, 3, 7] and b.is_finished and b.finish_reason == "stop"
    launched(sched, second, max_model_len=100)  # b is skipped: it stopped after this launch
    # a reached max_tokens with this launch: finished for the scheduler; its reason comes with its token
    assert a.is_finished and a.finish_reason is None and b.token_ids == [4, 5, EOS]
    assert resolve(sched, second, [8, 9], frozenset({EOS}), max_model_len=100) == [a]
    assert a.finish_reason == "length"
    assert a.token_ids == [1, 2, 3, 7, 8] and not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_finish_from_outside_frees_blocks_once():
    sched = make_sched()
    seq = add(sched, [1, 2, 3, 4, 5], max_tokens=10)
    step(sched)
    lifecycle = RequestLifecycle(sched, None, frozenset(), 10**6)
    engine_extras.abort(lifecycle, seq)
    engine_extras.abort(lifecycle, seq)
    assert seq.finish_reason == "abort" and not sched.running
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


# ========================================================================= randomized property test
class ShadowRun:
    """One random schedule driven by a fake model, checking every invariant after every step.

    The shadow KV cache stores, for every slot, the id of the exact token prefix whose last
    token's K/V the fake model wrote there (ids come from a trie, so equal ids mean equal
    prefixes). K/V depend on the whole prefix, not just the token, so a block reused after a
    different prefix is caught even when its own token ids match.
    """

    def __init__(self, rng: random.Random, overlap: bool = False, forks: bool = False, mixed: bool = False):
        self.rng = rng
        self.overlap = overlap      # schedule step n+1 before resolving step n's tokens
        self.mixed = mixed          # decode rows ride along with prompt work (the MixedSteps policy)
        self.forks = forks          # some requests have n > 1 samples sharing the prompt's blocks
        self.last_tokens: list[int] = []  # what the previous fake step sampled ("on the device")
        self.bs = bs = rng.choice([1, 2, 3, 4, 5, 8, 16])
        self.num_blocks = rng.randint(4, 30)
        self.budget = rng.randint(1, 64)
        self.max_num_seqs = rng.randint(1, 8)
        self.prefix = rng.random() < 0.8
        self.max_model_len = rng.randint(4, 96)
        self.eos = frozenset({EOS})
        self.p_eos = rng.choice([0.0, 0.05, 0.2])
        vocab = rng.randint(2, 6)                  # tiny vocabulary: lots of equal blocks
        self.vocab = vocab
        self.bm = BlockManager(self.num_blocks, bs, self.prefix)
        self.sched = Scheduler(self.bm, self.max_num_seqs, self.budget)
        if mixed:
            self.sched.policy = MixedSteps()
        if forks:
            self.sched.hooks.append(ParallelSampling())
        self.kv = [[None] * bs for _ in range(self.num_blocks)]
        self.trie: dict[tuple[int, int], int] = {}
        self.node_token = [None]
        self.nodes: dict[int, list[int]] = {}      # seq_id -> prefix id of token_ids[:p + 1]
        self.expected: dict[int, list[int]] = {}   # seq_id -> the tokens it must hold
        pools = [[rng.randint(1, vocab) for _ in range(rng.randint(0, 32))] for _ in range(rng.randint(1, 3))]
        self.requests: list[tuple[int, Sequence]] = []   # (arrival step, seq)
        for _ in range(rng.randint(2, 8)):
            seq = self._make_request(pools)
            if seq is not None:
                self.requests.append((rng.choice([0, 0, 0, rng.randint(0, 12)]), seq))
        self.requests.sort(key=lambda r: r[0])
        self.steps = 0
        self.hit_tokens = 0
        self.chunks = 0
        self.wasted_rows = 0
        self.forked = 0
        self.copies = 0
        self.fresh_forks: set[int] = set()  # forked by the batch just scheduled, not launched yet
        self.mixed_steps = 0  # prefill-shaped steps that also carried decode rows
        self.decoders: list[Sequence] = []  # running sequences with one token to compute, before a schedule
        self.waiting_before: set[int] = set()

    def _make_request(self, pools):
        rng = self.rng
        for _ in range(20):  # regenerate what the engine would reject as never fitting
            pool = rng.choice(pools)
            shared = pool[:rng.randint(0, len(pool))]
            prompt = (shared + [rng.randint(1, self.vocab) for _ in range(rng.randint(0, 12))])[:40]
            if not prompt:
                prompt = [rng.randint(1, self.vocab)]
            max_tokens = rng.randint(1, 24)
            if len(prompt) + max_tokens > self.max_model_len:
                continue
            if self.bm.blocks_for(len(prompt) + max_tokens - 1) > self.num_blocks:
                continue
            n = 1
            if self.forks and self.max_num_seqs >= 2 and rng.random() < 0.5:
                n = rng.randint(2, min(4, self.max_num_seqs))
                # what LLMEngine.check_fits asks of n > 1: the prompt plus the forks' copies fit
                if self.bm.blocks_for(len(prompt)) + (n - 1) * (len(prompt) % self.bs != 0) > self.num_blocks:
                    continue
            params = SamplingParams(
                n=n,
                max_tokens=max_tokens,
                min_tokens=rng.choice([0, 0, rng.randint(0, max_tokens)]),
                ignore_eos=rng.random() < 0.1,
                stop_token_ids=[self.vocab] if rng.random() < 0.2 else None)
            seq = Sequence(next(_ids), prompt, params, seed=0)
            # as LLMEngine.add_request makes the samples of n > 1 requests (this hook's `added`)
            ParallelSampling().added(seq, lambda i: Sequence(next(_ids), prompt, params, seed=0, sample_index=i))
            assert len(seq.samples) == n and seq.pending_forks == seq.samples[1:]
            for sample in seq.samples:
                self.expected[sample.seq_id] = list(prompt)
                self.nodes[sample.seq_id] = []
            return seq
        return None

    # ---- shadow prefix ids --------------------------------------------------------------------
    def prefix_ids(self, seq: Sequence, upto: int) -> list[int]:
        nodes = self.nodes[seq.seq_id]
        while len(nodes) < upto:
            parent = nodes[-1] if nodes else 0
            tok = seq.token_ids[len(nodes)]
            if tok == PENDING_TOKEN:  # still on the "device": the runner reads it from there too
                assert len(nodes) == len(seq) - 1 and seq.pending_row >= 0
                tok = self.last_tokens[seq.pending_row]
            node = self.trie.get((parent, tok))
            if node is None:
                node = self.trie[(parent, tok)] = len(self.node_token)
                self.node_token.append(tok)
            nodes.append(node)
        return nodes

    def check_context(self, seq: Sequence, upto: int) -> None:
        """Every slot seq reads for positions < upto holds exactly that prefix's K/V."""
        bs, nodes = self.bs, self.prefix_ids(seq, upto)
        for i in range(0, self.bm.blocks_for(upto)):
            lo, hi = i * bs, min(upto, (i + 1) * bs)
            got = self.kv[seq.block_table[i]][:hi - lo]
            assert got == nodes[lo:hi], f"{seq}: block {i} (id {seq.block_table[i]}) holds wrong K/V"

    # ---- global invariants ------------------------------------------------------------------
    def check_invariants(self) -> None:
        bm, sched, bs = self.bm, self.sched, self.bs
        live = list(sched.running)
        assert len(live) <= self.max_num_seqs
        assert len({s.seq_id for s in live}) == len(live)
        assert not {s.seq_id for s in live} & {s.seq_id for s in sched.waiting}
        refs = [0] * bm.num_blocks
        holders: dict[int, list[tuple[Sequence, int]]] = {}
        for s in live:
            assert s.status == SequenceStatus.RUNNING
            assert len(set(s.block_table)) == len(s.block_table), f"{s} holds a block twice"
            assert s.num_cached_tokens < len(s), f"{s} has nothing left to compute"
            # a running sequence covers all its tokens except possibly the newest sampled one
            assert len(s.block_table) >= bm.blocks_for(len(s) - 1)
            for i, b in enumerate(s.block_table):
                refs[b] += 1
                holders.setdefault(b, []).append((s, i))
            # blocks held for the forks' copies of a partly filled last prompt block
            assert len(s.reserved_blocks) == sum(h.reserve(s, bm.block_size)[1] for h in self.sched.hooks)
            for b in s.reserved_blocks:
                refs[b] += 1
        for s in sched.waiting:
            assert s.status == SequenceStatus.WAITING and s.block_table == [] and s.num_cached_tokens == 0
        assert [b.ref_count for b in bm.blocks] == refs, "ref counts disagree with the block tables"
        assert bm.num_shared_refs == sum(max(r - 1, 0) for r in refs), "shared-reference count drifted"
        free = {i for i, r in enumerate(refs) if r == 0}
        assert set(bm.free_blocks) == free and len(bm.free_blocks) == len(free)
        assert bm.num_free_blocks + (bm.num_blocks - len(free)) == bm.num_blocks
        for b, hs in holders.items():
            if len(hs) == 1:
                continue
            block = bm.blocks[b]
            if block.hash == -1:
                # Only the samples of one request share a block the cache does not know: their
                # prompt's full blocks, with prefix caching off or being computed right now.
                fresh = any(id(x) in self.fresh_forks for x, _ in hs)
                assert fresh or not self.prefix, f"block {b} shared by {[s for s, _ in hs]} but never committed"
                owners = {id(s.samples[0]) for s, _ in hs}
                assert len(owners) == 1, f"block {b} shared by {[s for s, _ in hs]} of several requests"
                for s, i in hs:
                    assert (i + 1) * bs <= s.num_prompt_tokens
                    if fresh:
                        continue  # being computed by the batch just scheduled
                    assert (i + 1) * bs <= s.num_cached_tokens
                    assert self.kv[b] == self.prefix_ids(s, (i + 1) * bs)[i * bs:(i + 1) * bs]
                continue
            assert len(block.token_ids) == bs
            for s, i in hs:
                if id(s) in self.fresh_forks:
                    continue  # its parent computes the block in the batch just scheduled
                assert (i + 1) * bs <= s.num_cached_tokens, f"shared block {b} not computed for {s}"
                assert tuple(s.block_tokens(i, bs)) == block.token_ids
                assert self.kv[b] == self.prefix_ids(s, (i + 1) * bs)[i * bs:(i + 1) * bs]
        for h, b in bm.hash_to_block.items():
            assert bm.blocks[b].hash == h

    # ---- the fake model ---------------------------------------------------------------------
    def model_step(self, batch) -> list[int]:
        bs, bm = self.bs, self.bm
        out = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_cached_tokens
            self.check_context(seq, start)        # everything it attends to besides new tokens
            nodes = self.prefix_ids(seq, start + n)
            forks = [c for c in batch.forks if c.samples is seq.samples]
            for p in range(start, start + n):
                b = seq.block_table[p // bs]
                blk = bm.blocks[b]
                # The only other holders allowed: samples forked from seq in this very step
                # (full prompt blocks they read only from the next step on).
                readers = sum(b in c.block_table for c in forks)
                assert blk.ref_count == 1 + readers and blk.hash == -1, \
                    f"{seq} writes position {p} into block {b} that is shared or cached"
                self.kv[b][p % bs] = nodes[p]
            if self.rng.random() < self.p_eos:
                out.append(EOS)
            else:
                out.append(self.rng.randint(1, self.vocab))
        for child, row in zip(batch.forks, batch.fork_rows):
            parent = batch.seqs[row]
            assert child.block_table[:len(parent) // bs] == parent.block_table[:len(parent) // bs]
            assert batch.num_new_tokens[row] == parent.num_uncomputed_tokens  # the prompt's last chunk
            self.forked += 1
            out.append(EOS if self.rng.random() < self.p_eos else self.rng.randint(1, self.vocab))
        for src, dst in batch.block_copies:  # after the step's writes, as the runner does
            self.copies += 1
            assert bm.blocks[dst].ref_count == 1
            self.kv[dst] = list(self.kv[src])
        self.last_tokens = out
        return out

    def run(self) -> None:
        sched, bm = self.sched, self.bm
        pending = list(self.requests)
        total = sum((len(s) + s.params.max_tokens) * s.params.n for _, s in pending)
        max_steps = 4 * total * (total + 1) + 100
        inflight = None  # (batch, tokens, sequences that get a token) launched, not resolved
        while pending or sched.has_unfinished() or inflight:
            while pending and pending[0][0] <= self.steps:
                sched.add(pending.pop(0)[1])
            self.check_invariants()
            self.decoders = [s for s in sched.running if s.num_uncomputed_tokens == 1]
            self.waiting_before = {id(s) for s in sched.waiting}
            batch = sched.schedule()
            if batch is None and inflight is None:
                assert not sched.has_unfinished(), f"deadlock: {list(sched.waiting)} {list(sched.running)}"
                assert pending
                self.steps = pending[0][0]
                continue
            launched = None
            if batch is not None:
                self.steps += 1
                assert self.steps <= max_steps, "no progress: the schedule does not end"
                self.fresh_forks = {id(c) for c in batch.forks}
                self.check_batch(batch)
                self.check_invariants()
                launched = (batch, self.model_step(batch))
                self.fresh_forks = set()
            if self.overlap:
                if inflight is not None:
                    self.resolve(*inflight)
                inflight = launched and (*launched, self.advance(launched[0]))
            elif launched is not None:
                self.resolve(*launched, self.advance(batch))
        # the end: everything finished, every block free
        self.check_invariants()
        for _, parent in self.requests:
            for seq in parent.samples:
                assert seq.is_finished and seq.block_table == [] and seq.finish_reason in ("stop", "length")
                assert seq.token_ids == self.expected[seq.seq_id]
            assert not parent.pending_forks and not parent.reserved_blocks
        assert all(b.ref_count == 0 for b in bm.blocks) and bm.num_free_blocks == bm.num_blocks
        assert not sched.running and not sched.waiting
        # registered blocks still hold exactly the tokens they are registered with
        for b in bm.hash_to_block.values():
            assert [self.node_token[x] for x in self.kv[b]] == list(bm.blocks[b].token_ids)
        self.hit_tokens = bm.num_prefix_hit_tokens

    def advance(self, batch) -> list[Sequence]:
        """sched.advance(); returns the sequences that will get a token from this step."""
        will_advance = [s for s, n in zip(batch.seqs, batch.num_new_tokens)
                        if not s.is_finished and s.num_cached_tokens + n == len(s)] + list(batch.forks)
        self.chunks += sum(1 for s, n in zip(batch.seqs, batch.num_new_tokens)
                           if not s.is_finished and s.num_cached_tokens + n < len(s))
        # rows computed for sequences that stopped after this step was launched (overlap only)
        self.wasted_rows += sum(s.is_finished for s in batch.seqs)
        launched(self.sched, batch, self.max_model_len)
        return will_advance

    def resolve(self, batch, tokens, will_advance) -> None:
        advanced = resolve(self.sched, batch, tokens, self.eos, self.max_model_len)
        assert advanced == will_advance
        for seq, tok in zip(batch.rows, tokens):
            if seq in will_advance:
                self.expected[seq.seq_id].append(tok)
                self.check_stop(seq, tok)
            assert seq.token_ids == self.expected[seq.seq_id]
            assert PENDING_TOKEN not in seq.token_ids

    def check_batch(self, batch) -> None:
        sched, bm = self.sched, self.bm
        assert batch.seqs and len(batch.seqs) == len(batch.num_new_tokens) == len(set(map(id, batch.seqs)))
        assert 1 <= batch.num_tokens <= self.budget, "token budget exceeded"
        assert len(batch.rows) <= self.max_num_seqs, "sequence cap exceeded"
        assert len(batch.forks) == len(batch.fork_rows) and all(s.status == SequenceStatus.RUNNING for s in batch.forks)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert seq.status == SequenceStatus.RUNNING and seq in sched.running
            assert 1 <= n <= seq.num_uncomputed_tokens
            assert len(seq.block_table) >= bm.blocks_for(seq.num_cached_tokens + n), "scheduled token without a slot"
        for seq in batch.preempted:
            assert seq.status == SequenceStatus.WAITING and seq.block_table == [] and seq in sched.waiting
        if self.mixed:
            self.check_mixed_batch(batch)
        elif not batch.is_prefill:
            assert all(n == 1 and s.num_uncomputed_tokens == 1 for s, n in zip(batch.seqs, batch.num_new_tokens))
            # decode runs every running sequence the budget / cap allows
            cap = min(self.max_num_seqs, self.budget)
            assert len(batch.seqs) == min(cap, len(sched.running) - len(batch.forks))
            assert not any(s.num_uncomputed_tokens > 1 for s in sched.running if s not in batch.forks), \
                "decode with prefill pending"
        else:
            assert not batch.preempted

    def check_mixed_batch(self, batch) -> None:
        """Mixed steps: no decoding sequence waits for prompt work. Every sequence that had one
        token to compute gets its row, unless it was preempted or the rows reached the cap; a
        step with prompt work is prefill-shaped; a step that preempted admits nobody."""
        sched = self.sched
        cap = min(self.max_num_seqs, self.budget)
        admitted = [s for s in batch.seqs if id(s) in self.waiting_before]
        rows = [s for s in batch.seqs if s.num_uncomputed_tokens == 1 and id(s) not in self.waiting_before]
        decoders = {id(s) for s in self.decoders}
        assert all(id(s) in decoders for s in rows), "a decode row that was not decoding"
        preempted = {id(s) for s in batch.preempted}
        skipped = [s for s in self.decoders if id(s) not in preempted and s not in rows]
        assert not skipped or len(rows) == cap, f"decoding sequences {skipped} wait although rows are free"
        prompt = [s for s in batch.seqs if s.num_uncomputed_tokens > 1] + admitted
        assert batch.is_prefill == bool(prompt), "prompt work must make the step prefill-shaped, and only it"
        assert not (batch.preempted and admitted), "admitted in a step that preempted"
        if not batch.is_prefill:
            assert not any(s.num_uncomputed_tokens > 1 for s in sched.running if s not in batch.forks) \
                or len(rows) == self.budget, "prompt work left out although the budget allows"
        elif rows:
            self.mixed_steps += 1

    def check_stop(self, seq: Sequence, tok: int) -> None:
        p = seq.params
        n = seq.num_completion_tokens
        if n >= p.min_tokens and (tok in p.stop_ids or (not p.ignore_eos and tok == EOS)):
            want = "stop"
        elif n >= p.max_tokens or len(seq) >= self.max_model_len:
            want = "length"
        else:
            want = None
        assert seq.finish_reason == want and seq.is_finished == (want is not None)
        if want:
            assert seq.block_table == [] and seq not in self.sched.running
        assert n <= p.max_tokens and len(seq) <= self.max_model_len


# Complete random schedules per run (override with NANOVLLM_FUZZ_SCHEDULES; NANOVLLM_FUZZ_SEED
# moves the seeds). Each takes a couple of milliseconds.
NUM_SCHEDULES = 2000            # with the real xxhash chain hash
NUM_SCHEDULES_WEAK_HASH = 1000  # with a hash that collides constantly


def _weak_hash(parent: int, token_ids) -> int:
    """A terrible hash: collisions everywhere, so only the exact checks keep the cache correct."""
    return (parent * 3 + sum(token_ids)) % 7


@pytest.mark.parametrize("mixed", [False, True], ids=["split", "mixed"])
@pytest.mark.parametrize("overlap", [False, True], ids=["in-order", "overlapped"])
@pytest.mark.parametrize("weak_hash", [False, True], ids=["xxhash", "colliding-hash"])
def test_random_schedules_keep_every_invariant(weak_hash, overlap, mixed, monkeypatch):
    n = int(os.environ.get("NANOVLLM_FUZZ_SCHEDULES", NUM_SCHEDULES_WEAK_HASH if weak_hash else NUM_SCHEDULES))
    base = int(os.environ.get("NANOVLLM_FUZZ_SEED", "20240601")) + (10**6 if weak_hash else 0) + (5 * 10**6 if mixed else 0)
    if weak_hash:
        monkeypatch.setattr(pc_mod, "chain_hash", _weak_hash)
    totals = dict(schedules=0, requests=0, steps=0, preemptions=0, hit_tokens=0, chunks=0, wasted_rows=0,
                  mixed_steps=0)
    t0 = time.perf_counter()
    for i in range(n):
        seed = base + i
        run = ShadowRun(random.Random(seed), overlap, mixed=mixed)
        try:
            run.run()
        except AssertionError as e:
            raise AssertionError(f"schedule seed={seed} (overlap={overlap}, mixed={mixed}, bs={run.bs}, blocks={run.num_blocks}, "
                                 f"budget={run.budget}, max_num_seqs={run.max_num_seqs}, "
                                 f"prefix={run.prefix}): {e}") from e
        totals["schedules"] += 1
        totals["requests"] += len(run.requests)
        totals["steps"] += run.steps
        totals["preemptions"] += run.sched.num_preemptions
        totals["hit_tokens"] += run.hit_tokens
        totals["chunks"] += run.chunks
        totals["wasted_rows"] += run.wasted_rows
        totals["mixed_steps"] += run.mixed_steps
    print(f"\n{'colliding' if weak_hash else 'xxhash'}: {totals} in {time.perf_counter() - t0:.1f}s")
    assert totals["schedules"] == n
    if "NANOVLLM_FUZZ_SCHEDULES" not in os.environ and not weak_hash:
        assert totals["schedules"] >= 2000
    # the generator must actually exercise the interesting paths
    assert totals["preemptions"] > 0 and totals["hit_tokens"] > 0 and totals["chunks"] > 0
    assert (totals["wasted_rows"] > 0) == overlap  # stops discovered after the next launch
    assert (totals["mixed_steps"] > 0) == mixed


@pytest.mark.parametrize("mixed", [False, True], ids=["split", "mixed"])
@pytest.mark.parametrize("overlap", [False, True], ids=["in-order", "overlapped"])
def test_random_schedules_with_parallel_sampling(overlap, mixed):
    """The same shadow check with requests of n > 1 samples: the samples are forked when the
    prompt's last token is scheduled (in a prefill chunk or a decode row), share its full blocks,
    get a copy of its partly filled last block, run, get preempted and recomputed on their own,
    and every block comes back."""
    n = int(os.environ.get("NANOVLLM_FUZZ_SCHEDULES", 1000))
    base = int(os.environ.get("NANOVLLM_FUZZ_SEED", "20240601")) + 2 * 10**6 + (5 * 10**6 if mixed else 0)
    totals = dict(forked=0, copies=0, preemptions=0)
    for i in range(n):
        run = ShadowRun(random.Random(base + i), overlap, forks=True, mixed=mixed)
        try:
            run.run()
        except AssertionError as e:
            raise AssertionError(f"schedule seed={base + i} (overlap={overlap}, mixed={mixed}, bs={run.bs}, blocks={run.num_blocks}, "
                                 f"budget={run.budget}, max_num_seqs={run.max_num_seqs}, prefix={run.prefix}): {e}") from e
        totals["forked"] += run.forked
        totals["copies"] += run.copies
        totals["preemptions"] += run.sched.num_preemptions
    print(f"\nforks: {totals}")
    assert totals["forked"] > 100 and totals["copies"] > 50 and totals["preemptions"] > 0

