"""Paged KV-cache bookkeeping: fixed-size blocks, ref counts and (core/prefix_cache.py) prefix caching."""

from __future__ import annotations

from collections import OrderedDict

from nanovllm.core.sequence import Sequence

PREFIX_CACHE = None  # filled by nanovllm.wiring: loads core/prefix_cache.py at first use
KV_USAGE = None  # filled by nanovllm.wiring: loads core/kv_usage.py at first use


class Block:
    """One KV block: its ref count and, once full and computed, the content that identifies it
    (prefix ids: its exact token prefix and its parent's, whatever the hashes do; core/prefix_cache.py)."""

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


class BlockManager:
    """Hands out KV blocks to sequences and shares full prefix blocks between them (ref count + 1).
    Freed blocks stay findable in the prefix cache until the free list (an LRU OrderedDict: O(1)
    allocate, free, revive) hands them out again."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.next_prefix_id = 1  # the prefix cache's next new prefix id (0: the empty prefix)
        self.num_prefix_hit_tokens = self.num_prefix_query_tokens = 0  # statistics
        self.num_shared_refs = 0  # sum of max(ref_count - 1, 0): usage() counts shared blocks once

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def usage(self, running):
        """The cache's use now, given the running sequences (a KVUsage, core/kv_usage.py)."""
        return KV_USAGE().usage(self, running)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of `seq` (none while nothing is cached)."""
        if not self.enable_prefix_caching or not seq.reads_prefix_cache or not self.hash_to_block:
            return []
        return PREFIX_CACHE().lookup(self, seq)

    def _blocks_needed(self, seq: Sequence, hits: list[int], reserve: int) -> int:
        """Free blocks that allocating `seq` with these prefix hits takes (revived hits count)."""
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self.blocks_for(len(seq)) - len(hits) + revived + reserve

    def can_allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        return self._blocks_needed(seq, self._cached_prefix(seq), reserve) <= self.num_free_blocks

    def _take_free(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)  # least recently freed first
        block = self.blocks[block_id]
        if block.hash != -1 and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.forget()
        block.ref_count = 1
        return block_id

    def allocate(self, seq: Sequence, reserve: int = 0) -> None:
        """Blocks for all of a waiting sequence's tokens (cached prefix blocks reused), and `reserve`
        more held for its later use (seq.reserved_blocks)."""
        if seq.block_table:
            raise RuntimeError(f"{seq} already has blocks")
        hits = self._cached_prefix(seq)
        if self._blocks_needed(seq, hits, reserve) > self.num_free_blocks:
            raise RuntimeError(f"not enough free KV blocks for {seq}")
        if hits:
            PREFIX_CACHE().take(self, hits)
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
        return PREFIX_CACHE().reset(self)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks keep their content for later prefix hits (tail
        blocks, the least likely to be shared, are freed first)."""
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
        """Extend the block table to cover every token of the sequence and `extra` slots past them."""
        while len(seq.block_table) < self.blocks_for(len(seq) + extra):
            if not self.free_blocks:
                raise RuntimeError("no free KV block (call can_append first)")
            seq.block_table.append(self._take_free())

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's full, computed blocks in the prefix cache."""
        if self.enable_prefix_caching:
            PREFIX_CACHE().register(self, seq)
