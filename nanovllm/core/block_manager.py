"""Paged KV-cache bookkeeping: fixed-size blocks, ref counts and prefix caching."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import xxhash

from nanovllm.core.sequence import Sequence

_ROOT_HASH = 0  # parent hash of a sequence's first block
_ROOT_PREFIX = 0  # prefix id of the empty prefix (parent of a sequence's first block)


def roots(adapter: int) -> tuple[int, int]:
    """(hash, prefix id) of the empty prefix under a request's adapter (0: none; else a prefix id
    below -1, as -1 marks unregistered blocks): requests under different adapters compute
    different K/V for the same tokens, so they never share blocks."""
    return (_ROOT_HASH, _ROOT_PREFIX) if not adapter else (chain_hash(_ROOT_HASH, [adapter]), -1 - adapter)


def chain_hash(parent: int, token_ids: list[int]) -> int:
    """xxhash64 of (parent block's hash, this block's token ids): equal prefixes give equal hashes."""
    h = xxhash.xxh64()
    h.update(parent.to_bytes(8, "little", signed=False))
    h.update(b"".join(t.to_bytes(4, "little", signed=False) for t in token_ids))
    return h.intdigest()


class Block:
    """One KV block: its ref count and, once full and computed, the content that identifies it.
    prefix_id / parent_prefix_id identify the exact token prefix its K/V were computed with (its
    tokens and all before them) and its parent's: equal ids mean equal prefixes, whatever the
    hashes do (see BlockManager.commit)."""

    __slots__ = ("block_id", "ref_count", "hash", "parent_hash", "prefix_id", "parent_prefix_id", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.forget()

    def forget(self):
        self.hash = -1  # -1: holds no reusable content
        self.parent_hash = -1
        self.prefix_id = -1
        self.parent_prefix_id = -1
        self.token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class KVUsage:
    """The KV cache at one moment (BlockManager.usage), in tokens. used_blocks: blocks held
    (reserved ones included); live_tokens: K/V the running sequences hold that launched steps
    compute, a shared block once; the rest (fragmentation_tokens): unfilled block tails, blocks
    allocated ahead of a chunked prefill, reserved blocks."""

    block_size: int
    num_blocks: int
    used_blocks: int
    live_tokens: int
    running_seqs: int

    @property
    def allocated_tokens(self) -> int:
        return self.used_blocks * self.block_size

    @property
    def fragmentation_tokens(self) -> int:
        return self.allocated_tokens - self.live_tokens


class BlockManager:
    """Hands out KV blocks to sequences and shares full prefix blocks between them.

    Every full, computed block is keyed by a chain hash (parent hash + token ids). A later
    sequence whose leading blocks hash the same reuses them (ref count + 1) after checking the
    stored token ids and the identity of the parent prefix, so a hash collision never serves
    wrong K/V. Freed blocks stay findable until the free list (an LRU OrderedDict: O(1) allocate,
    free, revive) hands them out again. A block is registered only once its K/V are computed
    (`commit`): with chunked prefill it can be allocated steps before it is filled.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self._next_prefix_id = _ROOT_PREFIX + 1
        self.num_prefix_hit_tokens = self.num_prefix_query_tokens = 0  # statistics
        self.num_shared_refs = 0  # sum of max(ref_count - 1, 0): usage() counts shared blocks once

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def usage(self, running) -> KVUsage:
        """The cache's use now, given the running sequences (a shared block is full and computed
        in each holder: each extra reference takes block_size tokens off)."""
        computed = sum(s.num_cached_tokens for s in running)
        return KVUsage(self.block_size, self.num_blocks, self.num_blocks - len(self.free_blocks),
                       computed - self.num_shared_refs * self.block_size, len(running))

    def _hash_of(self, seq: Sequence, i: int) -> int:
        """Chain hash of the sequence's i-th full block (memoised on the sequence)."""
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            parent = seq.block_hashes[j - 1] if j else roots(seq.adapter)[0]
            seq.block_hashes.append(chain_hash(parent, seq.block_tokens(j, self.block_size)))
        return seq.block_hashes[i]

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of `seq`, leaving >= 1 token to compute
        (the last prompt token must be computed for its logits)."""
        if not self.enable_prefix_caching or not seq.reads_prefix_cache:
            return []
        bs = self.block_size
        hits = []
        parent_prefix = roots(seq.adapter)[1]
        for i in range((len(seq) - 1) // bs):
            block_id = self.hash_to_block.get(self._hash_of(seq, i))
            if block_id is None:
                break
            block = self.blocks[block_id]
            # The parent *hash* is not enough: under a collision one level up, a block whose tokens and
            # parent hash match may follow another prefix (or be the previous hit); the prefix id is exact.
            if block.parent_prefix_id != parent_prefix or list(block.token_ids) != seq.block_tokens(i, bs):
                break  # hash collision: never serve another prefix's K/V
            hits.append(block_id)
            parent_prefix = block.prefix_id
        return hits

    def _blocks_needed(self, seq: Sequence, hits: list[int], reserve: int) -> int:
        """Free blocks that allocating `seq` with these prefix hits takes (revived hits count)."""
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self.blocks_for(len(seq)) - len(hits) + revived + reserve

    def can_allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        return self._blocks_needed(seq, self._cached_prefix(seq), reserve) <= self.num_free_blocks

    # ---- mutations -----------------------------------------------------------------------
    def _take_free(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)  # least recently freed first
        block = self.blocks[block_id]
        if block.hash != -1 and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.forget()
        block.ref_count = 1
        return block_id

    def allocate(self, seq: Sequence, reserve: int = 0) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks, and
        `reserve` more free blocks held for its later use (seq.reserved_blocks)."""
        if seq.block_table:
            raise RuntimeError(f"{seq} already has blocks")
        hits = self._cached_prefix(seq)
        if self._blocks_needed(seq, hits, reserve) > self.num_free_blocks:
            raise RuntimeError(f"not enough free KV blocks for {seq}")
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            else:
                self.num_shared_refs += 1
            block.ref_count += 1
        seq.block_table = hits + [self._take_free() for _ in range(self.blocks_for(len(seq)) - len(hits))]
        seq.reserved_blocks = [self._take_free() for _ in range(reserve)]
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_committed_blocks = len(hits)
        if seq.num_cached_prompt_tokens is None:
            seq.num_cached_prompt_tokens = seq.num_cached_tokens
        self.num_prefix_hit_tokens += seq.num_cached_tokens
        self.num_prefix_query_tokens += len(seq)

    def release_reserved(self, seq: Sequence) -> None:
        """Give back the blocks reserved for `seq` that it did not take."""
        while seq.reserved_blocks:
            self.give_back(seq.reserved_blocks.pop())

    def give_back(self, block_id: int) -> None:
        """Free a block its one holder never filled (reserved, or taken for rejected drafts)."""
        block = self.blocks[block_id]
        block.ref_count = 0
        block.forget()
        self.free_blocks[block_id] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False, changing nothing, while a request holds blocks."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self.hash_to_block.clear()
        for block in self.blocks:
            block.forget()
        return True

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references. Blocks keep their content for later prefix hits; tail
        blocks, the least likely to be shared, go back to the free list first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count:
                self.num_shared_refs -= 1
            else:
                if block.hash == -1 or self.hash_to_block.get(block.hash) != block_id:
                    block.forget()
                self.free_blocks[block_id] = None
        seq.block_table = []
        seq.num_cached_tokens = 0
        seq.num_committed_blocks = 0
        self.release_reserved(seq)

    def can_append(self, seq: Sequence) -> bool:
        """True when the sequence has, or can get, a slot for its newest token."""
        return self.blocks_for(len(seq)) <= len(seq.block_table) or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence, extra: int = 0) -> None:
        """Make sure the block table covers every token of the sequence (before a decode step),
        and `extra` slots past them."""
        while len(seq.block_table) < self.blocks_for(len(seq) + extra):
            if not self.free_blocks:
                raise RuntimeError("no free KV block (call can_append first)")
            seq.block_table.append(self._take_free())

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(seq.num_committed_blocks, seq.num_cached_tokens // bs):
            seq.num_committed_blocks = i + 1
            block = self.blocks[seq.block_table[i]]
            if block.hash != -1:
                continue  # reused from the cache: registered already
            h = self._hash_of(seq, i)
            # Block i - 1 is live (held by seq) and committed already, so its prefix id is valid.
            parent = self.blocks[seq.block_table[i - 1]].prefix_id if i else roots(seq.adapter)[1]
            tokens = tuple(seq.block_tokens(i, bs))
            same = self.hash_to_block.get(h)
            if same is not None and self.blocks[same].parent_prefix_id == parent \
                    and self.blocks[same].token_ids == tokens:
                prefix_id = self.blocks[same].prefix_id  # an identical copy: same prefix
            else:
                prefix_id = self._next_prefix_id         # a prefix not seen before (or evicted)
                self._next_prefix_id += 1
            block.hash = h
            block.prefix_id = prefix_id
            block.parent_prefix_id = parent
            block.token_ids = tokens
            block.parent_hash = seq.block_hashes[i - 1] if i else roots(seq.adapter)[0]
            # An identical registered block stays canonical unless nothing can hit it any more (its
            # parent was evicted and the prefix recomputed under a new id): this reachable copy wins.
            if same is None or (not self._reachable(self.blocks[same]) and self._reachable(block)):
                self.hash_to_block[h] = block.block_id

    def _reachable(self, block: Block) -> bool:
        """Whether a prefix lookup can reach the block: its parent is the root, or the block
        registered under its parent hash has the prefix the block was computed after."""
        if block.parent_prefix_id == _ROOT_PREFIX or block.parent_prefix_id < -1:  # a root (< -1: an adapter's)
            return True
        parent = self.hash_to_block.get(block.parent_hash)
        return parent is not None and self.blocks[parent].prefix_id == block.parent_prefix_id
