"""Unit tests of the paged KV-cache bookkeeping (nanovllm/core/block_manager.py).

No model and no GPU: a "computed" token is simulated by advancing `num_cached_tokens` and
calling `commit`, which is exactly what `Scheduler.postprocess` does after a model step.
"""

from __future__ import annotations

import pytest

from nanovllm.core import prefix_cache as pc_mod
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.prefix_cache import chain_hash
from nanovllm.core.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

_ids = iter(range(10**9))


def make_seq(tokens) -> Sequence:
    return Sequence(next(_ids), list(tokens), SamplingParams(max_tokens=16), seed=0)


def compute(bm: BlockManager, seq: Sequence, n: int | None = None) -> None:
    """Pretend the model computed the next `n` uncomputed tokens (all of them by default)."""
    n = seq.num_uncomputed_tokens if n is None else n
    assert 0 < n <= seq.num_uncomputed_tokens
    assert len(seq.block_table) >= bm.blocks_for(seq.num_cached_tokens + n), "no slot for a computed token"
    seq.num_cached_tokens += n
    bm.commit(seq)


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    refs = [0] * bm.num_blocks
    for s in live:
        assert len(set(s.block_table)) == len(s.block_table), f"{s} holds a block twice: {s.block_table}"
        for b in s.block_table:
            refs[b] += 1
    assert [b.ref_count for b in bm.blocks] == refs
    assert bm.num_shared_refs == sum(max(r - 1, 0) for r in refs)
    assert set(bm.free_blocks) == {i for i, r in enumerate(refs) if r == 0}
    used = sum(1 for r in refs if r)
    assert bm.num_free_blocks + used == bm.num_blocks
    for h, b in bm.hash_to_block.items():
        assert bm.blocks[b].hash == h
        assert len(bm.blocks[b].token_ids) == bm.block_size


# ---------------------------------------------------------------------------------------- hashing
def test_chain_hash_is_deterministic_and_chained():
    assert chain_hash(0, [1, 2, 3]) == chain_hash(0, [1, 2, 3])
    assert chain_hash(0, [1, 2, 3]) != chain_hash(0, [1, 2, 4])
    assert chain_hash(0, [1, 2, 3]) != chain_hash(1, [1, 2, 3])   # the parent is part of the key
    assert chain_hash(0, [1, 2]) != chain_hash(0, [2, 1])
    assert 0 <= chain_hash(2**64 - 1, [2**32 - 1]) < 2**64


def test_constructor_validates():
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


# ---------------------------------------------------------------------- allocation and ref counts
def test_allocate_and_free_ref_counts():
    bm = BlockManager(8, 4)
    a = make_seq(range(10))                       # 3 blocks: 4 + 4 + 2
    assert bm.blocks_for(10) == 3 and bm.blocks_for(8) == 2 and bm.blocks_for(0) == 0
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert len(a.block_table) == 3 and a.num_cached_tokens == 0 and a.num_committed_blocks == 0
    assert all(bm.blocks[b].ref_count == 1 for b in a.block_table)
    assert bm.num_free_blocks == 5
    check_invariants(bm, [a])
    b = make_seq(range(100, 117))                 # 5 blocks
    bm.allocate(b)
    assert bm.num_free_blocks == 0
    check_invariants(bm, [a, b])
    c = make_seq([7])
    assert not bm.can_allocate(c)
    with pytest.raises(RuntimeError):
        bm.allocate(c)
    assert c.block_table == []
    bm.free(a)
    assert a.block_table == [] and a.num_cached_tokens == 0
    check_invariants(bm, [b])
    assert bm.num_free_blocks == 3
    bm.free(b)
    check_invariants(bm, [])
    assert bm.num_free_blocks == 8 and all(blk.ref_count == 0 for blk in bm.blocks)


def test_allocate_twice_is_an_error():
    bm = BlockManager(4, 4)
    a = make_seq(range(5))
    bm.allocate(a)
    with pytest.raises(RuntimeError):
        bm.allocate(a)


def test_append_slot_grows_the_table_one_block_at_a_time():
    bm = BlockManager(3, 2)
    a = make_seq([1, 2, 3])                       # 2 blocks
    bm.allocate(a)
    compute(bm, a)
    for tok, want_blocks in [(4, 2), (5, 3), (6, 3)]:
        a.token_ids.append(tok)
        assert bm.can_append(a)
        bm.append_slot(a)
        assert len(a.block_table) == want_blocks
        compute(bm, a)
        check_invariants(bm, [a])
    a.token_ids.append(7)                         # needs a 4th block; the cache has 3
    assert not bm.can_append(a)
    with pytest.raises(RuntimeError):
        bm.append_slot(a)
    check_invariants(bm, [a])


# ------------------------------------------------------------------------------- prefix caching
def test_prefix_hit_across_requests():
    bm = BlockManager(16, 4)
    a = make_seq(list(range(10)))                 # blocks [0..3] [4..7] [8, 9]
    bm.allocate(a)
    compute(bm, a)
    assert a.num_committed_blocks == 2            # the partial third block is never registered
    assert len(bm.hash_to_block) == 2
    b = make_seq(list(range(8)) + [50, 51, 52])   # same two leading full blocks
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert [bm.blocks[x].ref_count for x in b.block_table] == [2, 2, 1]
    assert b.num_cached_tokens == 8 and b.num_uncomputed_tokens == 3
    assert b.num_committed_blocks == 2
    assert bm.num_prefix_hit_tokens == 8 and bm.num_prefix_query_tokens == 10 + 11
    check_invariants(bm, [a, b])
    # A prompt that differs inside the first block shares nothing.
    c = make_seq([0, 1, 2, 99] + list(range(4, 8)) + [1])
    bm.allocate(c)
    assert c.num_cached_tokens == 0 and not set(c.block_table) & set(a.block_table)
    check_invariants(bm, [a, b, c])
    # Freeing one sharer leaves the other's blocks alone.
    bm.free(a)
    assert [bm.blocks[x].ref_count for x in b.block_table] == [1, 1, 1]
    check_invariants(bm, [b, c])


def test_fully_cached_prompt_still_computes_at_least_one_token():
    bm = BlockManager(16, 4)
    a = make_seq(range(8))                        # exactly two full blocks
    bm.allocate(a)
    compute(bm, a)
    assert a.num_committed_blocks == 2
    same = make_seq(range(8))
    bm.allocate(same)
    # Both blocks are cached, but the last prompt token must run through the model: the last hit
    # is given up and its block recomputed into a fresh block.
    assert same.num_cached_tokens == 4 and same.num_uncomputed_tokens == 4
    assert same.block_table[0] == a.block_table[0] and same.block_table[1] != a.block_table[1]
    longer = make_seq(list(range(8)) + [8])
    bm.allocate(longer)
    assert longer.num_cached_tokens == 8 and longer.num_uncomputed_tokens == 1
    assert longer.block_table[:2] == a.block_table
    one = make_seq([0])                           # shorter than a block: nothing to hit
    bm.allocate(one)
    assert one.num_cached_tokens == 0
    check_invariants(bm, [a, same, longer, one])


def test_hits_on_blocks_of_a_finished_sequence_revive_them():
    bm = BlockManager(4, 4)
    a = make_seq(range(12))                       # three full blocks
    bm.allocate(a)
    compute(bm, a)
    table = list(a.block_table)
    bm.free(a)                                    # finished: blocks go back but keep content
    check_invariants(bm, [])
    assert bm.num_free_blocks == 4
    assert set(bm.hash_to_block.values()) == set(table)
    b = make_seq(list(range(12)) + [77, 78])      # 4 blocks: 3 revived hits + 1 fresh
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[:3] == table and b.num_cached_tokens == 12
    assert bm.num_free_blocks == 0
    check_invariants(bm, [b])


def test_can_allocate_counts_revived_and_shared_hits_correctly():
    bm = BlockManager(4, 4)
    a = make_seq(range(8))
    bm.allocate(a)
    compute(bm, a)                                # a live, holds 2 committed blocks; 2 free
    b = make_seq(list(range(8)) + list(range(50, 58)))  # 4 blocks, 2 of them shared hits
    assert bm.can_allocate(b)                     # needs only 2 new blocks
    bm.allocate(b)
    assert bm.num_free_blocks == 0
    check_invariants(bm, [a, b])
    bm.free(b)
    bm.free(a)
    # Now both prefix blocks are cached but free: reviving them costs free blocks too.
    filler = make_seq([200])
    bm.allocate(filler)                           # 3 free left: 2 cached + 1 plain (LRU order)
    check_invariants(bm, [filler])
    c = make_seq(list(range(8)) + list(range(60, 68)))   # 2 revived hits + 2 fresh = 4 > 3
    assert not bm.can_allocate(c)
    d = make_seq(list(range(8)) + [60, 61])              # 2 revived hits + 1 fresh = 3
    assert bm.can_allocate(d)
    bm.allocate(d)
    assert d.num_cached_tokens == 8
    check_invariants(bm, [filler, d])


def test_blocks_are_not_hit_before_they_are_committed():
    """Chunked prefill: blocks are allocated up front but only shareable once computed."""
    bm = BlockManager(16, 4)
    prompt = list(range(13))
    a = make_seq(prompt)
    bm.allocate(a)                                # 4 blocks allocated, nothing computed
    assert bm.hash_to_block == {}
    b = make_seq(prompt)
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)
    compute(bm, a, 6)                             # first chunk: block 0 full, block 1 half done
    assert a.num_committed_blocks == 1 and len(bm.hash_to_block) == 1
    c = make_seq(prompt)
    bm.allocate(c)
    assert c.num_cached_tokens == 4 and c.block_table[0] == a.block_table[0]
    assert c.block_table[1] != a.block_table[1]
    compute(bm, a, 5)                             # 11 computed: block 1 complete, block 2 not
    assert a.num_committed_blocks == 2
    d = make_seq(prompt)
    bm.allocate(d)
    assert d.num_cached_tokens == 8 and d.block_table[:2] == a.block_table[:2]
    compute(bm, a)                                # whole prompt
    assert a.num_committed_blocks == 3
    e = make_seq(prompt)
    bm.allocate(e)
    assert e.num_cached_tokens == 12 and e.block_table[:3] == a.block_table[:3]
    check_invariants(bm, [a, b, c, d, e])


def test_generated_tokens_are_cached_too():
    bm = BlockManager(8, 2)
    a = make_seq([1, 2, 3])
    bm.allocate(a)
    compute(bm, a)
    for tok in (4, 5):                            # two decode steps fill the second block
        a.token_ids.append(tok)
        bm.append_slot(a)
        compute(bm, a)
    assert a.num_committed_blocks == 2
    b = make_seq([1, 2, 3, 4, 5])
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.block_table[:2] == a.block_table[:2]
    check_invariants(bm, [a, b])


def test_disabling_prefix_caching_gives_no_hits():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = make_seq(range(12))
    bm.allocate(a)
    compute(bm, a)
    assert bm.hash_to_block == {} and a.num_committed_blocks == 0
    assert all(blk.hash == -1 for blk in bm.blocks)
    b = make_seq(list(range(12)) + [5])
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)
    table = list(a.block_table)
    bm.free(a)
    c = make_seq(list(range(12)) + [5])
    bm.allocate(c)
    assert c.num_cached_tokens == 0
    assert bm.num_prefix_hit_tokens == 0
    check_invariants(bm, [b, c])
    assert set(table) & set(c.block_table)        # a's freed blocks were simply reused


# ------------------------------------------------------------------------------ hash collisions
def test_hash_collision_is_rejected_by_the_token_check(monkeypatch):
    # Every block of every sequence hashes the same: only the stored token ids tell them apart.
    monkeypatch.setattr(pc_mod, "chain_hash", lambda parent, token_ids: 12345)
    bm = BlockManager(16, 4)
    a = make_seq([1, 2, 3, 4, 5])
    bm.allocate(a)
    compute(bm, a)
    canonical = a.block_table[0]
    assert bm.hash_to_block == {12345: canonical}
    b = make_seq([9, 9, 9, 9, 5])                 # different tokens, same hash
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and b.block_table[0] != canonical
    compute(bm, b)
    # b's block was computed from b's tokens; the registered block still holds a's.
    assert bm.blocks[b.block_table[0]].token_ids == (9, 9, 9, 9)
    assert bm.blocks[canonical].token_ids == (1, 2, 3, 4)
    assert bm.hash_to_block == {12345: canonical}
    c = make_seq([1, 2, 3, 4, 6])                 # a genuine hit still works
    bm.allocate(c)
    assert c.num_cached_tokens == 4 and c.block_table[0] == canonical
    d = make_seq([9, 9, 9, 9, 6])                 # b's content is not registered: no hit
    bm.allocate(d)
    assert d.num_cached_tokens == 0
    check_invariants(bm, [a, b, c, d])


def test_colliding_hash_cannot_map_a_sequence_onto_one_block_twice(monkeypatch):
    # A degenerate hash equal to the root hash: block i's parent hash check then passes for
    # any block, so only the prefix identity can stop block 0 from being hit again at index 1.
    monkeypatch.setattr(pc_mod, "chain_hash", lambda parent, token_ids: 0)
    bm = BlockManager(8, 2)
    a = make_seq([1, 1, 1, 1, 1])
    bm.allocate(a)
    compute(bm, a)
    b = make_seq([1, 1, 1, 1, 1])
    bm.allocate(b)
    # Block 0 holds the K/V of positions 0-1; positions 2-3 have the same token ids but other
    # K/V (other positions, longer context), so they must not be served from block 0.
    assert len(set(b.block_table)) == len(b.block_table), b.block_table
    assert b.num_cached_tokens == 2
    check_invariants(bm, [a, b])


def test_collision_in_a_parent_block_cannot_serve_a_child_computed_after_another_prefix(monkeypatch):
    """[1, 2] and [3, 4] collide as first blocks. A child block computed after [3, 4] must not be
    served to a sequence whose first block is [1, 2], although its own token ids and recorded
    parent hash both match: its K/V attended to [3, 4]."""
    real = chain_hash

    def colliding(parent, token_ids):
        return real(parent, [1, 2] if parent == 0 and list(token_ids) == [3, 4] else token_ids)

    monkeypatch.setattr(pc_mod, "chain_hash", colliding)
    bm = BlockManager(16, 2)
    u = make_seq([1, 2, 7, 7, 0])                 # registers block [1, 2]
    bm.allocate(u)
    compute(bm, u)
    t = make_seq([3, 4, 5, 6, 0])                 # its [3, 4] collides (not registered); [5, 6] is
    bm.allocate(t)
    assert t.num_cached_tokens == 0               # token check rejects the colliding first block
    compute(bm, t)
    s = make_seq([1, 2, 5, 6, 0])
    bm.allocate(s)
    assert s.block_table[0] == u.block_table[0]   # the genuine hit
    assert s.block_table[1] != t.block_table[1], "served K/V computed after a different prefix"
    assert s.num_cached_tokens == 2
    check_invariants(bm, [u, t, s])


def test_recomputed_prefix_is_not_shadowed_by_a_registered_child_of_an_evicted_copy():
    """Two identical prompts computed concurrently: a's first block and b's second block end up
    registered. Once a's first block is evicted, b's registered second block hangs off a prefix
    copy nobody can hit. A later recomputation of the same prefix must become hittable again."""
    bm = BlockManager(8, 2)
    a = make_seq([1, 2, 3, 4, 9])
    b = make_seq([1, 2, 3, 4, 9])
    bm.allocate(a)
    bm.allocate(b)
    compute(bm, a, 2)                             # a registers [1, 2]
    compute(bm, b)                                # b: [1, 2] is a duplicate, [3, 4] registered
    compute(bm, a)                                # a: [3, 4] is a duplicate
    assert bm.hash_to_block[a.block_hashes[0]] == a.block_table[0]
    assert bm.hash_to_block[b.block_hashes[1]] == b.block_table[1]
    bm.free(a)                                    # a's [1, 2] keeps its content, in the free list
    fillers = [make_seq([100 + i]) for i in range(bm.num_free_blocks)]
    for f in fillers:                             # ... until the free list evicts it
        bm.allocate(f)
    assert a.block_hashes[0] not in bm.hash_to_block
    for f in fillers:
        bm.free(f)
    e = make_seq([1, 2, 3, 4, 5])                 # misses, recomputes both blocks
    bm.allocate(e)
    assert e.num_cached_tokens == 0
    compute(bm, e)
    f = make_seq([1, 2, 3, 4, 6])
    bm.allocate(f)
    assert f.num_cached_tokens == 4 and f.block_table[:2] == e.block_table[:2]
    check_invariants(bm, [b, e, f])
    stale = b.block_table[1]
    bm.free(b)                                    # b's [3, 4] is no longer registered: forgotten
    assert bm.blocks[stale].hash == -1
    check_invariants(bm, [e, f])


# ------------------------------------------------------------------------- LRU reuse / eviction
def test_free_list_hands_out_least_recently_freed_blocks_first():
    bm = BlockManager(6, 2)
    a = make_seq([1, 2, 3, 4, 5, 6])              # blocks 0, 1, 2
    bm.allocate(a)
    b = make_seq([7, 8, 9])                       # blocks 3, 4
    bm.allocate(b)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4]
    compute(bm, a)
    compute(bm, b)
    bm.free(a)                                    # tail first: 2, 1, 0
    bm.free(b)                                    # then 4, 3
    assert list(bm.free_blocks) == [5, 2, 1, 0, 4, 3]
    got = []
    for tok in range(100, 106):                   # unrelated one-block sequences
        s = make_seq([tok])
        bm.allocate(s)
        got += s.block_table
    assert got == [5, 2, 1, 0, 4, 3]


def test_tail_blocks_are_evicted_before_prefix_blocks_and_evicted_hashes_are_forgotten():
    bm = BlockManager(4, 2)
    a = make_seq([1, 2, 3, 4, 5, 6, 7])           # 4 blocks; 3 full and committed
    bm.allocate(a)
    compute(bm, a)
    table = list(a.block_table)
    full = table[:3]
    hashes = list(a.block_hashes[:3])
    assert all(bm.hash_to_block[h] == b for h, b in zip(hashes, full))
    bm.free(a)
    assert list(bm.free_blocks) == table[::-1]    # the tail is the first to be handed out
    x = make_seq([50])                            # takes the partial tail block (no content)
    bm.allocate(x)
    y = make_seq([60])                            # evicts the third full block, not the first
    bm.allocate(y)
    assert y.block_table == [full[2]]
    assert hashes[2] not in bm.hash_to_block
    assert bm.blocks[full[2]].hash == -1 and bm.blocks[full[2]].token_ids == ()
    assert bm.hash_to_block[hashes[0]] == full[0] and bm.hash_to_block[hashes[1]] == full[1]
    # The evicted block can no longer be hit: only the two surviving prefix blocks are.
    bm.free(x)
    bm.free(y)
    b = make_seq([1, 2, 3, 4, 5, 6, 7])
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.block_table[:2] == full[:2]
    check_invariants(bm, [b])


def test_evicted_block_is_not_hit_even_when_reused_for_a_different_block():
    bm = BlockManager(2, 2)
    a = make_seq([1, 2, 3])                       # blocks: [1, 2] committed, [3] partial
    bm.allocate(a)
    compute(bm, a)
    h0 = a.block_hashes[0]
    bm.free(a)
    b = make_seq([8, 9, 10])                      # needs both blocks: evicts [1, 2]
    bm.allocate(b)
    assert h0 not in bm.hash_to_block
    compute(bm, b, 1)                             # only one token computed so far
    bm.free(b)
    c = make_seq([1, 2, 3])
    bm.allocate(c)
    assert c.num_cached_tokens == 0
    check_invariants(bm, [c])


def test_duplicate_blocks_computed_concurrently_keep_one_canonical_copy():
    bm = BlockManager(8, 2)
    a = make_seq([1, 2, 3])
    b = make_seq([1, 2, 4])
    bm.allocate(a)
    bm.allocate(b)                                # neither computed yet: no sharing
    compute(bm, a)
    compute(bm, b)
    h = a.block_hashes[0]
    assert b.block_hashes[0] == h
    assert bm.hash_to_block[h] == a.block_table[0]
    dup = b.block_table[0]
    bm.free(b)                                    # the duplicate gives up its content
    assert bm.blocks[dup].hash == -1
    assert bm.hash_to_block[h] == a.block_table[0]
    c = make_seq([1, 2, 5])
    bm.allocate(c)
    assert c.block_table[0] == a.block_table[0] and bm.blocks[a.block_table[0]].ref_count == 2
    check_invariants(bm, [a, c])


def test_free_keeps_full_block_content_but_forgets_partial_blocks():
    bm = BlockManager(4, 4)
    a = make_seq(range(6))
    bm.allocate(a)
    compute(bm, a)
    full, partial = a.block_table
    bm.free(a)
    assert bm.blocks[full].hash != -1 and bm.blocks[full].token_ids == (0, 1, 2, 3)
    assert bm.blocks[partial].hash == -1 and bm.blocks[partial].token_ids == ()
    check_invariants(bm, [])


def test_preempted_sequence_hits_its_own_blocks_again():
    bm = BlockManager(8, 2)
    a = make_seq([1, 2, 3, 4, 5])
    bm.allocate(a)
    compute(bm, a)
    a.token_ids.append(6)
    bm.append_slot(a)
    compute(bm, a)
    a.token_ids.append(7)                         # sampled, K/V not computed yet
    table = list(a.block_table)
    bm.free(a)                                    # preemption by recompute
    assert a.num_cached_tokens == 0 and a.num_committed_blocks == 0
    bm.allocate(a)
    assert a.num_cached_tokens == 6 and a.block_table[:3] == table[:3]
    assert a.num_uncomputed_tokens == 1
    check_invariants(bm, [a])
