"""The prefix cache: chain hashes of full blocks, lookup on admission and registration of computed
blocks, on a BlockManager's blocks and hash -> block map (reached through block_manager.PREFIX_CACHE).

Every full, computed block is keyed by a chain hash (parent hash + token ids). A later sequence
whose leading blocks hash the same reuses them after checking the stored token ids and the
identity of the parent prefix, so a hash collision never serves wrong K/V. A block is registered
only once its K/V are computed (`register`): with chunked prefill it can be allocated steps
before it is filled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import xxhash

from nanovllm.core.sequence import Sequence

if TYPE_CHECKING:
    from nanovllm.core.block_manager import Block, BlockManager

ROOT_HASH = 0  # parent hash of a sequence's first block
ROOT_PREFIX = 0  # prefix id of the empty prefix (parent of a sequence's first block)


def roots(adapter: int) -> tuple[int, int]:
    """(hash, prefix id) of the empty prefix under a request's adapter (0: none; else a prefix id
    below -1, as -1 marks unregistered blocks): requests under different adapters compute
    different K/V for the same tokens, so they never share blocks."""
    return (ROOT_HASH, ROOT_PREFIX) if not adapter else (chain_hash(ROOT_HASH, [adapter]), -1 - adapter)


def chain_hash(parent: int, token_ids: list[int]) -> int:
    """xxhash64 of (parent block's hash, this block's token ids): equal prefixes give equal hashes."""
    h = xxhash.xxh64()
    h.update(parent.to_bytes(8, "little", signed=False))
    h.update(b"".join(t.to_bytes(4, "little", signed=False) for t in token_ids))
    return h.intdigest()


def hash_of(bm: BlockManager, seq: Sequence, i: int) -> int:
    """Chain hash of the sequence's i-th full block (memoised on the sequence)."""
    while len(seq.block_hashes) <= i:
        j = len(seq.block_hashes)
        parent = seq.block_hashes[j - 1] if j else roots(seq.adapter)[0]
        seq.block_hashes.append(chain_hash(parent, seq.block_tokens(j, bm.block_size)))
    return seq.block_hashes[i]


def lookup(bm: BlockManager, seq: Sequence) -> list[int]:
    """Block ids holding the longest cached prefix of `seq`, leaving >= 1 token to compute
    (the last prompt token must be computed for its logits)."""
    bs = bm.block_size
    hits = []
    parent_prefix = roots(seq.adapter)[1]
    for i in range((len(seq) - 1) // bs):
        block_id = bm.hash_to_block.get(hash_of(bm, seq, i))
        if block_id is None:
            break
        block = bm.blocks[block_id]
        # The parent *hash* is not enough: under a collision one level up, a block whose tokens and
        # parent hash match may follow another prefix (or be the previous hit); the prefix id is exact.
        if block.parent_prefix_id != parent_prefix or list(block.token_ids) != seq.block_tokens(i, bs):
            break  # hash collision: never serve another prefix's K/V
        hits.append(block_id)
        parent_prefix = block.prefix_id
    return hits


def take(bm: BlockManager, hits: list[int]) -> None:
    """One more reference to each hit block (a freed one leaves the free list)."""
    for block_id in hits:
        block = bm.blocks[block_id]
        if block.ref_count == 0:
            del bm.free_blocks[block_id]
        else:
            bm.num_shared_refs += 1
        block.ref_count += 1


def register(bm: BlockManager, seq: Sequence) -> None:
    """Register the sequence's full, computed blocks."""
    bs = bm.block_size
    for i in range(seq.num_committed_blocks, seq.num_cached_tokens // bs):
        seq.num_committed_blocks = i + 1
        block = bm.blocks[seq.block_table[i]]
        if block.hash != -1:
            continue  # reused from the cache: registered already
        h = hash_of(bm, seq, i)
        # Block i - 1 is live (held by seq) and committed already, so its prefix id is valid.
        parent = bm.blocks[seq.block_table[i - 1]].prefix_id if i else roots(seq.adapter)[1]
        tokens = tuple(seq.block_tokens(i, bs))
        same = bm.hash_to_block.get(h)
        if same is not None and bm.blocks[same].parent_prefix_id == parent and bm.blocks[same].token_ids == tokens:
            prefix_id = bm.blocks[same].prefix_id  # an identical copy: same prefix
        else:
            prefix_id = bm.next_prefix_id          # a prefix not seen before (or evicted)
            bm.next_prefix_id += 1
        block.hash = h
        block.prefix_id = prefix_id
        block.parent_prefix_id = parent
        block.token_ids = tokens
        block.parent_hash = seq.block_hashes[i - 1] if i else roots(seq.adapter)[0]
        # An identical registered block stays canonical unless nothing can hit it any more (its
        # parent was evicted and the prefix recomputed under a new id): this reachable copy wins.
        if same is None or (not _reachable(bm, bm.blocks[same]) and _reachable(bm, block)):
            bm.hash_to_block[h] = block.block_id


def _reachable(bm: BlockManager, block: Block) -> bool:
    """Whether a lookup can reach the block: its parent is the root, or the block registered
    under its parent hash has the prefix the block was computed after."""
    if block.parent_prefix_id == ROOT_PREFIX or block.parent_prefix_id < -1:  # a root (< -1: an adapter's)
        return True
    parent = bm.hash_to_block.get(block.parent_hash)
    return parent is not None and bm.blocks[parent].prefix_id == block.parent_prefix_id


def reset(bm: BlockManager) -> bool:
    """Forget every cached prefix; False, changing nothing, while a request holds blocks."""
    if bm.num_free_blocks != bm.num_blocks:
        return False
    bm.hash_to_block.clear()
    for block in bm.blocks:
        block.forget()
    return True
